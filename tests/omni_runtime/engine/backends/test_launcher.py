"""The stage launcher on real processes: replicas are forked from it and named, a restart forks a
new one, a killed launcher takes its replicas with it and later replicas are spawned, a killed
engine leaves neither behind, ``start_method: spawn`` starts fresh interpreters, and what is not a
launcher message is dropped without harm."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from omni_runtime import Omni
from omni_runtime.engine.backends import EngineResources
from omni_runtime.engine.backends.process import ProcessBackend
from omni_runtime.messages import StageRequest
from tests.conftest import REPO, children, echo_stage, make_config, stage_processes
from tests.entrypoints.openai.server_process import assert_gone, wait_for

pytestmark = pytest.mark.integration


def cmdline(p: psutil.Process) -> str:
    return " ".join(p.cmdline()).strip()


def launchers() -> list[psutil.Process]:
    return [p for p in children() if "omni_runtime stage launcher" in cmdline(p)]


def test_replicas_are_forked_from_the_launcher_and_named(no_leaks):
    with Omni(make_config([echo_stage(runtime={"num_replicas": 2})])) as omni:
        (launcher,) = launchers()
        replicas = stage_processes()
        assert [p.ppid() for p in replicas] == [launcher.pid, launcher.pid]
        assert sorted(cmdline(p) for p in replicas) == [
            "omni_runtime.stage.process stage 0 replica 0",
            "omni_runtime.stage.process stage 0 replica 1",
        ]
        assert [o.text for o in omni.generate(["a", "b", "c"], use_tqdm=False)] == ["a", "b", "c"]


def test_a_closed_engine_leaves_no_replica_a_zombie(no_leaks):
    """The engine reads its replicas' exits from pidfds and closes the launcher right after: the
    launcher collects them before it goes, or they are left zombies of an init that may never
    collect them (a fresh-clone run left two)."""
    for _ in range(3):
        with Omni(make_config([echo_stage(runtime={"num_replicas": 2})])) as omni:
            replicas = stage_processes()
            assert len(replicas) == 2
            assert [o.text for o in omni.generate(["a"], use_tqdm=False)] == ["a"]

        def collected(replicas: list[psutil.Process] = replicas) -> bool:
            return not [p for p in replicas if p.is_running()]  # a zombie is still "running"

        assert wait_for(collected, timeout=5), [(p.pid, p.status()) for p in replicas if p.is_running()]


def test_a_killed_replica_is_restarted_from_the_launcher(no_leaks):
    with Omni(make_config([echo_stage(runtime={"max_restarts": 2})])) as omni:
        (launcher,) = launchers()
        (replica,) = stage_processes()
        os.kill(replica.pid, signal.SIGKILL)
        assert wait_for(lambda: [p.pid for p in stage_processes()] not in ([], [replica.pid]), timeout=30)
        (again,) = stage_processes()
        assert again.ppid() == launcher.pid
        assert wait_for(lambda: omni.engine.health().ok, timeout=30)
        assert omni.generate(["still here"], use_tqdm=False)[0].text == "still here"


def test_a_killed_launcher_takes_its_replicas_and_later_ones_are_spawned(no_leaks):
    stage = echo_stage(runtime={"num_replicas": 2, "max_restarts": 4})
    with Omni(make_config([stage])) as omni:
        (launcher,) = launchers()
        replicas = stage_processes()
        os.kill(launcher.pid, signal.SIGKILL)
        assert_gone([launcher, *replicas], timeout=10)  # PR_SET_PDEATHSIG: they die with it

        def respawned() -> bool:
            fresh = stage_processes()
            return len(fresh) == 2 and all(p.ppid() == os.getpid() for p in fresh)

        assert wait_for(respawned, timeout=60)
        assert all("-m omni_runtime.stage.process" in cmdline(p) for p in stage_processes())
        assert wait_for(lambda: omni.engine.health().ok, timeout=30)
        assert omni.generate(["spawned"], use_tqdm=False)[0].text == "spawned"


def test_spawn_start_method_starts_each_replica_as_a_fresh_interpreter(no_leaks):
    with Omni(make_config([echo_stage(runtime={"start_method": "spawn"})])) as omni:
        assert launchers() == []
        (replica,) = stage_processes()
        assert replica.ppid() == os.getpid() and "-m omni_runtime.stage.process" in cmdline(replica)
        assert omni.generate(["fresh"], use_tqdm=False)[0].text == "fresh"


def test_a_killed_engine_leaves_no_launcher_and_no_replica():
    script = (
        "import os, sys, time, psutil\n"
        "from omni_runtime import Omni\n"
        "from tests.conftest import echo_stage, make_config\n"
        "omni = Omni(make_config([echo_stage(runtime={'num_replicas': 2})]))\n"
        "print(' '.join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)\n"
        "time.sleep(600)\n"
    )
    engine = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(pids) == 3  # the launcher and two replicas
        descendants = [psutil.Process(pid) for pid in pids]
        engine.kill()
        engine.wait(10)
        assert_gone(descendants, timeout=10)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


async def test_what_is_not_a_launcher_message_is_dropped_and_it_goes_on_launching(no_leaks):
    resources = EngineResources()
    config = make_config([echo_stage()])
    backend = ProcessBackend(config, resources)
    await backend.open()
    try:
        launcher = backend.launcher
        assert launcher is not None and launcher._sock is not None
        for junk in (b"", b"\xff", b"\x81\xa4type\xa6launch", b"\x00" * 4096, "é".encode()):
            if junk:
                launcher._sock.send(junk)
        got: list[object] = []
        client = backend.client(config.stage_args[0], 0, 0, lambda c, m: got.append(m), lambda c, why: None)
        await client.start()
        client.send(StageRequest(request_id="r", prompt="after junk", params={}))
        deadline = time.monotonic() + 30
        while not any(getattr(m, "request_id", None) == "r" for m in got) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert any(getattr(m, "request_id", None) == "r" for m in got)
        await client.close(timeout=2.0)
    finally:
        resources.release()


def test_a_stopped_launcher_is_given_up_the_replica_spawned_and_close_is_quick(no_leaks, caplog):
    # startup_timeout_s bounds the wait for the launcher's answer; the replica is then spawned.
    stage = echo_stage(runtime={"max_restarts": 2, "startup_timeout_s": 3})
    omni = Omni(make_config([stage]))
    try:
        (launcher,) = launchers()
        (replica,) = stage_processes()
        os.kill(launcher.pid, signal.SIGSTOP)
        try:
            os.kill(replica.pid, signal.SIGKILL)
            killed = time.monotonic()
            # Its death is known from its pidfd, without the (stopped) launcher's report.
            assert wait_for(lambda: omni.engine.stage_status()[0].restarts == 1, timeout=2)

            def spawned() -> bool:
                fresh = [p for p in stage_processes() if p.status() != psutil.STATUS_ZOMBIE]
                return len(fresh) == 1 and fresh[0].ppid() == os.getpid()

            assert wait_for(spawned, timeout=20)
            assert wait_for(lambda: omni.engine.health().ok, timeout=20)
            restarted_s = time.monotonic() - killed
            assert restarted_s < 0.5 + 3 + 10, restarted_s  # backoff, the launcher's bound, a spawn
            assert omni.generate(["spawned"], use_tqdm=False)[0].text == "spawned"
            started = time.monotonic()
            omni.close()
            closed_s = time.monotonic() - started
            assert closed_s < 4, closed_s
            assert "did not exit after SIGKILL" not in caplog.text
            print(f"restart with a stopped launcher {restarted_s:.1f} s, close {closed_s:.1f} s")
        finally:
            if launcher.is_running():
                os.kill(launcher.pid, signal.SIGCONT)
    finally:
        omni.close()


def test_a_dead_engine_releases_its_launcher_before_close(no_leaks):
    omni = Omni(make_config([echo_stage(runtime={"max_restarts": 0})]))
    try:
        (launcher,) = launchers()
        (replica,) = stage_processes()
        os.kill(replica.pid, signal.SIGKILL)
        assert wait_for(lambda: not omni.engine.health().ok, timeout=5)
        assert_gone([launcher], timeout=5)
    finally:
        omni.close()
