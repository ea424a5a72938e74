"""The process stage client on real stage processes: no send ever blocks the loop it runs on, a
replica that fails to load is a StageStartupError with the reason, and whatever interrupts a
start (a failure, a cancellation) leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import psutil
import pytest

from omni_runtime.config import StageConfig
from omni_runtime.engine.backends import EngineResources
from omni_runtime.engine.backends.process import ProcessBackend, ProcessStageClient
from omni_runtime.exceptions import StageDeadError, StageStartupError
from omni_runtime.messages import StagePing, StageRequest
from tests.conftest import echo_stage, make_config

FAULTS = "tests.reliability.runners"


def stage_config(**overrides: object) -> StageConfig:
    return make_config([echo_stage(**overrides)]).stage_args[0]


class Harness:
    """One ProcessStageClient on a ProcessBackend of its own, and what the client reports."""

    def __init__(self, stage: StageConfig) -> None:
        self.resources = EngineResources()
        self.backend = ProcessBackend(make_config([msgspec.to_builtins(stage)]), self.resources)
        self.stage = stage
        self.messages: list[object] = []
        self.deaths: list[str] = []
        self.client = None

    async def open(self) -> ProcessStageClient:
        await self.backend.open()
        self.client = self.backend.client(
            self.stage, 0, 0, lambda c, m: self.messages.append(m), lambda c, why: self.deaths.append(why)
        )
        return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close(timeout=2.0)
        self.resources.release()
        assert not self.backend.ipc_dir.exists()


def request(i: int, prompt: str = "x") -> StageRequest:
    return StageRequest(request_id=f"r{i}", prompt=prompt, params={})


async def test_a_send_to_a_replica_that_just_died_returns_at_once(no_leaks):
    """The defect: a blocking send on a PUSH socket whose peer is gone hung the orchestrator."""
    h = Harness(stage_config())
    try:
        await (await h.open()).start()
        pid = h.client.pid
        os.kill(pid, signal.SIGKILL)
        # Wait for the death without giving the loop a turn: the pidfd cannot report it yet,
        # but the socket has lost its peer.
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)  # a zombie of the engine's, or reaped by the launcher that forked it
        time.sleep(0.2)
        start = time.monotonic()
        with pytest.raises(StageDeadError, match="cannot be reached"):
            for i in range(10):
                h.client.send(request(i))
        assert time.monotonic() - start < 0.1
        assert not h.client.alive
        await asyncio.sleep(0.1)
        assert len(h.deaths) == 1  # reported once, on a later loop turn
    finally:
        await h.close()


async def test_sends_to_a_stopped_replica_return_at_once_and_it_resumes(no_leaks):
    """A SIGSTOPped peer keeps its connection: messages queue, the sender never waits."""
    h = Harness(stage_config(runtime={"transport": "tcp"}))  # no shared memory: all bytes on the socket
    try:
        await (await h.open()).start()
        os.kill(h.client.pid, signal.SIGSTOP)
        big = "y" * 200_000
        start = time.monotonic()
        for i in range(200):  # 40 MB: far past every kernel buffer
            h.client.send(request(i, big))
        assert time.monotonic() - start < 2.0
        os.kill(h.client.pid, signal.SIGCONT)
        h.client.send(StagePing(seq=7))
        deadline = time.monotonic() + 20
        while sum(1 for m in h.messages if getattr(m, "request_id", "").startswith("r")) < 200:
            assert time.monotonic() < deadline, "the resumed replica did not answer everything"
            await asyncio.sleep(0.05)
        assert any(getattr(m, "seq", None) == 7 for m in h.messages)
        assert not h.deaths
    finally:
        await h.close()


async def test_a_replica_that_fails_to_load_is_a_startup_error_with_the_reason(no_leaks):
    h = Harness(stage_config(stage_type=f"{FAULTS}:LoadFailRunner"))
    client = await h.open()
    start = time.monotonic()
    with pytest.raises(StageStartupError, match="failed to load: OSError: weights not found"):
        await client.start()
    assert time.monotonic() - start < 15
    await h.close()


async def test_a_runner_module_that_does_not_exist_is_a_startup_error(no_leaks):
    h = Harness(stage_config(stage_type="no.such.module:Runner"))
    client = await h.open()
    with pytest.raises(StageStartupError, match="No module named 'no'"):
        await client.start()
    await h.close()


async def test_cancelling_a_start_leaves_no_process(no_leaks):
    h = Harness(stage_config(stage_type=f"{FAULTS}:LoadFailRunner", runner_args={"fail_replicas": [], "load_s": 30}))
    task = asyncio.ensure_future((await h.open()).start())
    deadline = time.monotonic() + 10
    while h.client._proc is None:  # spawned: it is loading (for 30 s) now
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    assert h.client._proc.poll() is None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h.client._proc.poll() is not None  # closed on the way out
    await h.close()


async def test_a_message_no_wire_can_carry_is_an_encode_error_and_nothing_is_sent(no_leaks):
    h = Harness(stage_config())
    try:
        await (await h.open()).start()
        with pytest.raises(msgspec.EncodeError, match="UnicodeEncodeError"):
            h.client.send(request(0, "a\ud800b"))
        h.client.send(request(1, "fine"))
        deadline = time.monotonic() + 10
        while not h.messages:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert [m.request_id for m in h.messages] == ["r1"] and h.client.alive
    finally:
        await h.close()
