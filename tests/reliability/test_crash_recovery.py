"""A stage process that dies: detected at once, its requests fail typed, the pool restarts it
(exponential backoff, capped), other replicas keep serving, and stage_status says so throughout.

Each test starts its own engine: a death spends restarts and backoff, and ``no_leaks`` checks
that closing the engine afterwards leaves no process behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from omni_runtime.exceptions import EngineDeadError, StageDeadError
from tests.reliability.support import close, eventually, fault_stage, last, pids, start, stats, status

SLOW = {"delay_ms": 10_000}


async def runs(engine, n: int) -> bool:
    """Whether ``n`` requests run as one fused wave (asked over the control channel, which the
    worker answers while the forward runs)."""
    return (await stats(engine))[0]["running"] == n


async def test_sigkill_mid_fused_batch_fails_it_fast_and_the_replica_returns(no_leaks):
    # A fixed quiet window, so a request a loaded machine delivers late still joins the wave.
    engine = start(fault_stage(max_restarts=2, request_batch_max_wait_ms=200, batch_quiet_window_ms=200))
    try:
        [pid] = (await pids(engine)).values()
        tasks = [asyncio.create_task(last(engine, f"fused-{i}", SLOW)) for i in range(8)]
        await eventually(lambda: runs(engine, 8), what="one fused wave of 8")
        assert status(engine).inflight == 8

        start_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        assert time.monotonic() - start_kill < 1.0
        assert all(isinstance(r, StageDeadError) and r.stage_id == 0 for r in results), results
        assert "code -9" in str(results[0])

        # During the backoff: no live replica, one restart under way, nothing held.
        s = status(engine)
        assert (s.live_replicas, s.restarts, s.inflight) == (0, 1, 0)
        t = time.monotonic()
        with pytest.raises(StageDeadError):
            await last(engine, "while down")
        assert time.monotonic() - t < 0.1

        await eventually(lambda: status(engine).live_replicas == 1, what="the restarted replica")
        assert status(engine).restarts == 1
        assert list((await pids(engine)).values()) != [pid]
        assert (await last(engine, "back")).text == "back"
    finally:
        await close(engine)


@pytest.mark.parametrize(
    ("prompt", "exit_code", "backend"),
    [
        ("crash", 13, "process"),  # os._exit from the forward
        ("abort", -signal.SIGABRT, "process"),  # os.abort(), as a failed C assertion
        ("segfault", -signal.SIGSEGV, "process"),  # a real segfault in native code
        ("systemexit", 3, "process"),  # SystemExit escaping the forward
        ("garble", 70, "process"),  # a runner bug that kills the worker's scheduling loop
        ("garble", None, "inproc"),  # the same, in-process
    ],
)
async def test_a_runner_fault_kills_the_replica_and_the_pool_restarts_it(no_leaks, prompt, exit_code, backend):
    stage = fault_stage(max_restarts=1, request_batch_max_wait_ms=200)
    stage["runtime"]["backend"] = backend
    engine = start(stage)
    try:
        # The fault rides in a fused wave with three innocent requests: all four end typed, at once.
        prompts = ["ok-1", prompt, "ok-2", "ok-3"]
        tasks = [asyncio.create_task(last(engine, p, {"delay_ms": 50})) for p in prompts]
        t = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        assert time.monotonic() - t < 1.0
        assert all(isinstance(r, StageDeadError) for r in results), results
        if exit_code is not None:
            assert f"exited with code {exit_code}" in str(results[0])
        else:
            assert "worker loop died" in str(results[0])
        assert status(engine).restarts == 1

        await eventually(lambda: status(engine).live_replicas == 1, what="the restarted replica")
        assert (await last(engine, "after")).text == "after"
    finally:
        await close(engine)


async def test_after_max_restarts_the_engine_is_dead_and_fails_fast(no_leaks):
    engine = start(fault_stage(max_restarts=1))
    try:
        [pid] = (await pids(engine)).values()
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: status(engine).live_replicas == 0, what="the first death noticed")
        assert status(engine).restarts == 1
        await eventually(lambda: status(engine).live_replicas == 1, what="the first restart")
        assert engine.engine.dead is None
        [pid] = (await pids(engine)).values()
        deaths = []
        engine.on_dead(deaths.append)

        # The second death is past the cap: no restart is left, so the engine is dead. The
        # request the replica held keeps its own cause; everything after gets EngineDeadError.
        task = asyncio.create_task(last(engine, "in flight", SLOW))
        await eventually(lambda: status(engine).inflight == 1, what="the request reaching the stage")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(StageDeadError, match="exited with code -9"):
            await asyncio.wait_for(task, 1.0)
        await eventually(lambda: deaths, what="the on_dead callback")
        assert isinstance(deaths[0], EngineDeadError) and not engine.engine.is_running
        # Longer than the next backoff (1 s) would have been: still dead, and it says so.
        await asyncio.sleep(1.5)
        s = status(engine)
        assert (s.live_replicas, s.restarts, s.inflight, s.replica_states) == (0, 1, 0, ["dead"])
        for i in range(20):
            t = time.monotonic()
            with pytest.raises(EngineDeadError, match="stage 0 has no live replica"):
                await last(engine, f"refused-{i}")
            assert time.monotonic() - t < 0.05
        with pytest.raises(EngineDeadError):
            await engine.collective_rpc("ping", timeout=2)
        assert engine.engine.num_pending == 0
    finally:
        await close(engine)


async def test_two_replicas_one_dies_the_other_keeps_serving(no_leaks):
    engine = start(fault_stage(replicas=2, max_restarts=1))
    try:
        before = await pids(engine)
        assert len(before) == 2 and status(engine).live_replicas == 2
        # Least-loaded routing puts one on each replica (which one first rotates).
        doomed = asyncio.create_task(last(engine, "first", {"delay_ms": 400}))
        await eventually(lambda: sum(status(engine).per_replica_inflight) == 1, what="the first routed")
        d = status(engine).per_replica_inflight.index(1)  # the replica that will die
        k = 1 - d  # the one that keeps serving
        survivor = asyncio.create_task(last(engine, "second", {"delay_ms": 400}))
        await eventually(lambda: status(engine).per_replica_inflight == [1, 1], what="one on each replica")

        os.kill(before[d], signal.SIGKILL)
        with pytest.raises(StageDeadError):
            await asyncio.wait_for(doomed, 1.0)
        s = status(engine)
        assert (s.live_replicas, s.restarts, s.per_replica_inflight[k]) == (1, 1, 1)

        # While the dead replica is down, the other finishes what it held and serves new requests.
        out = await asyncio.wait_for(survivor, 2.0)
        assert out.text == "second" and out.metrics["replica_id"] == k
        served = await asyncio.gather(*(last(engine, f"meanwhile-{i}") for i in range(10)))
        assert [o.text for o in served] == [f"meanwhile-{i}" for i in range(10)]
        assert {o.metrics["replica_id"] for o in served} == {k}
        assert status(engine).live_replicas == 1, "the dead replica came back too soon to prove anything"

        await eventually(lambda: status(engine).live_replicas == 2, what="the dead replica back")
        after = await pids(engine)
        assert after[k] == before[k] and after[d] != before[d]
        assert status(engine).restarts == 1
        outs = await asyncio.gather(*(last(engine, f"both-{i}", {"delay_ms": 50}) for i in range(8)))
        assert {o.metrics["replica_id"] for o in outs} == {0, 1}
    finally:
        await close(engine)
