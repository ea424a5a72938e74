"""Helpers shared by the reliability tests: engines on fault-injecting runners, outcomes, memory."""

from __future__ import annotations

import asyncio
import os

import psutil

from omni_runtime import AsyncOmni
from omni_runtime.engine.status import StageStatus
from tests.conftest import echo_stage, eventually, make_config  # noqa: F401 - eventually: re-exported

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


def status(engine: AsyncOmni, stage_id: int = 0) -> StageStatus:
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
    runtime = {"backend": "process", "torch_threads": 1, "max_restarts": 0}
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
