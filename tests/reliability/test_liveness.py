"""Liveness: a replica that stops answering (SIGSTOP, a blocked event loop) or whose forward is
stuck in native code is found by the heartbeat, reported unhealthy, killed and restarted; what it
held fails with StageDeadError, also requests that set no deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from omni_runtime.exceptions import StageDeadError
from tests.conftest import echo_stage

from .support import close, eventually, last, pids, start, status

WEDGE = "tests.reliability.runners:WedgeRunner"


def live_stage(**runtime: object) -> dict:
    return echo_stage(
        stage_type=WEDGE,
        runtime={"max_restarts": 2, "heartbeat_timeout_s": 1.0, **runtime},
        engine_args={"max_num_seqs": 4},
    )


async def test_a_stopped_replica_is_killed_its_requests_fail_and_it_returns(no_leaks):
    engine = start(live_stage())
    try:
        [pid] = (await pids(engine)).values()
        os.kill(pid, signal.SIGSTOP)
        start_t = time.monotonic()
        # No deadline on these: before liveness they waited forever.
        tasks = [asyncio.create_task(last(engine, f"r{i}", {"delay_ms": 10})) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        waited = time.monotonic() - start_t
        assert all(isinstance(r, StageDeadError) for r in results), results
        assert "answered no heartbeat" in str(results[0]) and 0.9 < waited < 5
        s = status(engine)
        assert s.unresponsive_kills == 1 and s.restarts == 1
        await eventually(lambda: status(engine).live_replicas == 1, what="the restart")
        out = await last(engine, "after")
        assert out.text == "after"
        [new_pid] = (await pids(engine)).values()
        assert new_pid != pid
    finally:
        await close(engine)


async def test_status_shows_a_stopped_replica_as_not_live_before_its_restart(no_leaks):
    engine = start(live_stage(max_restarts=1))
    try:
        [pid] = (await pids(engine)).values()
        os.kill(pid, signal.SIGSTOP)
        await eventually(lambda: status(engine).live_replicas == 0, timeout=5, what="the kill")
        assert status(engine).replica_states == ["restarting"]
        await eventually(lambda: status(engine).replica_states == ["live"], what="the restart")
    finally:
        await close(engine)


async def test_a_forward_stuck_in_native_code_is_killed_and_the_replica_restarted(no_leaks):
    engine = start(live_stage(stall_timeout_s=1.0))
    try:
        [pid] = (await pids(engine)).values()
        start_t = time.monotonic()
        with pytest.raises(StageDeadError, match="made no progress"):
            await asyncio.wait_for(last(engine, "wedge"), 10)
        assert time.monotonic() - start_t < 5
        # While wedged, pings were answered (its loop is fine): it is the stall that counted.
        assert status(engine).unresponsive_kills == 1
        await eventually(lambda: status(engine).live_replicas == 1, what="the restart")
        assert (await last(engine, "fine")).text == "fine"
        assert pid not in (await pids(engine)).values()
    finally:
        await close(engine)


async def test_a_forward_that_steps_is_not_a_stall(no_leaks):
    """``hang`` loops on ``ctx.is_aborted`` (a model between steps): alive, just long."""
    engine = start(live_stage(stall_timeout_s=0.5))
    try:
        with pytest.raises(Exception, match="deadline"):
            await last(engine, "hang", {"timeout": 2.5})
        assert status(engine).unresponsive_kills == 0 and status(engine).restarts == 0
    finally:
        await close(engine)
