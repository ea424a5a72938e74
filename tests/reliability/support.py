"""Helpers shared by the reliability tests: engines on fault-injecting runners, outcomes, memory."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import psutil
import yaml

from omni_runtime import AsyncOmni
from tests.conftest import REPO, echo_stage, make_config

FAULTS = "tests.reliability.runners:FaultRunner"


def fault_stage(stage_id: int = 0, *, replicas: int = 1, max_restarts: int = 3, **engine_args: object) -> dict:
    """An echo-compatible stage on :class:`~tests.reliability.runners.FaultRunner`."""
    return echo_stage(
        stage_id,
        stage_type=FAULTS,
        runtime={"num_replicas": replicas, "max_restarts": max_restarts},
        engine_args={"max_num_seqs": 8, **engine_args},
    )


def start(*stages: dict, **top: object) -> AsyncOmni:
    return AsyncOmni(make_config(list(stages), **top))


async def close(engine: AsyncOmni) -> None:
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


async def last(engine: AsyncOmni, prompt: str, params: dict | None = None, **kw: object):
    out = None
    async for item in engine.generate(prompt, params, **kw):
        out = item
    return out


async def pids(engine: AsyncOmni, stage_id: int = 0) -> dict[int, int]:
    """replica id -> pid of every live replica, asked over the control channel."""
    results = await engine.collective_rpc("ping", stage_ids=[stage_id], timeout=5)
    return {r.replica_id: r.result["pid"] for r in results if r.ok}


async def stats(engine: AsyncOmni, stage_id: int = 0) -> dict[int, dict]:
    results = await engine.collective_rpc("get_stats", stage_ids=[stage_id], timeout=5)
    return {r.replica_id: r.result for r in results if r.ok}


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = "condition"
) -> float:
    """Wait until ``predicate()`` (a bool, or a coroutine giving one) holds; returns the seconds it took."""
    start = time.monotonic()
    while not await _value(predicate()):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout:g} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _value(x: bool | Awaitable[bool]) -> bool:
    return await x if inspect.isawaitable(x) else x


def status(engine: AsyncOmni, stage_id: int = 0) -> dict:
    return engine.engine.stage_status()[stage_id]


def tree_rss() -> int:
    """Resident memory of this process and every descendant (the engine's whole process tree)."""
    me = psutil.Process(os.getpid())
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


# --------------------------------------------------------------------------- a real server


def http_config(delay_ms: float = 0.0) -> dict:
    """A deploy config for HTTP tests, cheap to serve: an image stage without a model
    (:class:`~tests.reliability.runners.TinyImageRunner`) and an echo text stage, both final and
    both fed by the prompt, each taking ``delay_ms`` per wave."""
    runtime = {"process": True, "torch_threads": 1, "max_restarts": 0}
    return {
        "model": "reliability",
        "stage_args": [
            {
                "stage_id": 0,
                "stage_type": "tests.reliability.runners:TinyImageRunner",
                "runtime": runtime,
                "engine_args": {"max_num_seqs": 8},
                "final_output": True,
                "final_output_type": "image",
                "default_sampling_params": {"height": 64, "width": 64},
                "runner_args": {"delay_ms": delay_ms},
            },
            {
                "stage_id": 1,
                "stage_type": "echo",
                "runtime": runtime,
                "engine_args": {"max_num_seqs": 8},
                "final_output": True,
                "final_output_type": "text",
                "default_sampling_params": {"delay_ms": delay_ms},
            },
        ],
    }


class Server:
    """``omni-runtime serve`` in a subprocess on a free port; its output goes to ``log``."""

    def __init__(self, config: dict, workdir: Path, *args: str) -> None:
        path = workdir / "server.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()
        cmd = [sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve", str(path), "--port", str(self.port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([*cmd, *args], cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server not healthy after {timeout:g} s:\n{self.log()[-3000:]}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; SIGKILL (and -9) if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9
