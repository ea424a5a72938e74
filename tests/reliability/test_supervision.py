"""Supervision and total error paths on real stage processes: a dead orchestrator is a dead
engine (nothing hangs), start-up failures leave nothing behind, and every error a stage can
produce reaches its caller with its type."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from omni_runtime import AsyncOmni
from omni_runtime.exceptions import (
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    StageAsleepError,
    StageExecutionError,
    StageStartupError,
)
from tests.conftest import children, echo_stage, make_config

from .support import close, eventually, last, pids, start, stats, status

RUNNERS = "tests.reliability.runners"


def runner_stage(name: str, stage_id: int = 0, **overrides: object) -> dict:
    return echo_stage(stage_id, stage_type=f"{RUNNERS}:{name}", **overrides)


# --------------------------------------------------------------------------- a dead orchestrator


async def test_requests_pending_when_the_orchestrator_dies_fail_at_once(no_leaks):
    """The defect: the deadline timer lived in the dead thread, so even timeout=2 hung."""
    # Two branches from the prompt: stage 0 (slow, final) and stage 1 -> stage 2 (final), whose
    # input function raises SystemExit for "die": the die request kills the orchestrator while
    # the others are held in stage 0.
    branch = echo_stage(1, final_output=False)
    branch.pop("final_output_type")
    config = make_config(
        [
            echo_stage(0, engine_args={"max_num_seqs": 8}),
            branch,
            echo_stage(2, engine_input_source=[1], custom_process_input_func=f"{RUNNERS}:exit_on_die"),
        ]
    )
    engine = AsyncOmni(config)
    try:
        deaths: list[EngineDeadError] = []
        engine.on_dead(deaths.append)
        slow, deadline = [{"delay_ms": 3000}, None, None], [{"delay_ms": 3000, "timeout": 2}, None, None]
        waiting = [asyncio.create_task(last(engine, f"slow {i}", slow)) for i in range(3)]
        timed = asyncio.create_task(last(engine, "with a deadline", deadline))
        await eventually(lambda: status(engine).inflight == 4, what="the requests reaching stage 0")
        start_t = time.monotonic()
        with pytest.raises(EngineDeadError, match="orchestrator thread died"):
            await asyncio.wait_for(last(engine, "die now"), 5)
        results = await asyncio.wait_for(asyncio.gather(*waiting, timed, return_exceptions=True), 1.0)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert time.monotonic() - start_t < 1.0
        await eventually(lambda: deaths, what="the on_dead callback")
        assert not engine.engine.is_running and engine.engine.num_pending == 0
        await eventually(
            lambda: all(s.inflight == 0 for s in engine.engine.stage_status().values()), what="stages emptied"
        )  # /readyz says so too
        with pytest.raises(EngineDeadError):
            await last(engine, "after")
        with pytest.raises(EngineDeadError):
            await engine.collective_rpc("ping")
    finally:
        await close(engine)


# --------------------------------------------------------------------------- start-up failures


def test_a_stage_that_fails_to_load_fails_the_engine_with_the_reason(no_leaks):
    start_t = time.monotonic()
    with pytest.raises(StageStartupError, match="OSError: weights not found"):
        AsyncOmni(make_config([runner_stage("LoadFailRunner")]))
    assert time.monotonic() - start_t < 20


def test_one_replica_failing_to_load_leaves_none_of_the_others_running(no_leaks):
    stage = runner_stage(
        "LoadFailRunner", runtime={"num_replicas": 3}, runner_args={"fail_replicas": [1], "load_s": 1.0}
    )
    with pytest.raises(StageStartupError, match=r"replica 1\)"):
        AsyncOmni(make_config([stage]))


def test_a_failing_stage_does_not_leave_a_slow_sibling_stage_starting(no_leaks):
    slow = runner_stage("LoadFailRunner", 0, final_output=False, runner_args={"fail_replicas": [], "load_s": 2.0})
    slow.pop("final_output_type")
    failing = runner_stage("LoadFailRunner", 1, engine_input_source=[0])
    with pytest.raises(StageStartupError, match="weights not found"):
        AsyncOmni(make_config([slow, failing]))


async def test_closing_during_a_restart_leaves_no_process(no_leaks, tmp_path):
    stage = runner_stage(
        "SlowRestartRunner", runtime={"max_restarts": 2}, runner_args={"marker": str(tmp_path / "m"), "load_s": 30}
    )
    engine = AsyncOmni(make_config([stage]))
    try:
        [pid] = (await pids(engine)).values()
        others = {p.pid for p in children()} - {pid}  # other tests' processes (a Ray cluster, say)
        os.kill(pid, signal.SIGKILL)

        def restarting() -> bool:
            now = {p.pid for p in children()} - others
            return len(now) == 1 and pid not in now

        await eventually(restarting, what="the restart's process")
        assert status(engine).replica_states == ["restarting"]
    finally:
        await close(engine)  # cancels the restart in the middle of its load


# --------------------------------------------------------------------------- typed errors from stages


@pytest.fixture(scope="module")
def typed():
    config = make_config(
        [
            runner_stage(
                "SleepyRunner",
                engine_args={"max_num_seqs": 4, "max_queue_len": 1},
                runner_args={"sleep_s": 1.0},
            )
        ]
    )
    with AsyncOmni(config) as engine:
        yield engine


async def test_a_stage_side_queue_full_is_a_queue_full_error_not_a_hang(typed):
    """The defect: QueueFullError could not be rebuilt from the wire, so the request never ended."""
    slow = {"delay_ms": 500}
    results = await asyncio.wait_for(
        asyncio.gather(*(last(typed, f"q{i}", slow) for i in range(4)), return_exceptions=True), 10
    )
    refused = [r for r in results if isinstance(r, QueueFullError)]
    assert refused and all(isinstance(r, QueueFullError) or r.text for r in results)
    assert refused[0].stage_id == 0
    assert typed.engine.num_pending == 0 and status(typed).inflight == 0


async def test_a_typed_error_raised_by_a_runner_keeps_its_type(typed):
    with pytest.raises(InvalidRequestError, match="refused by the model") as err:
        await last(typed, "refuse this")
    assert err.value.param == "prompt"


async def test_requests_during_sleep_get_stage_asleep_never_a_freed_model(typed):
    """The defect: asleep was set after the model was freed, so a wave ran on a freed model (500)."""
    sleeping = asyncio.create_task(typed.collective_rpc("sleep", timeout=10))

    async def asleep() -> bool:  # sleep() is freeing the model now (it takes a second)
        return (await stats(typed))[0]["asleep"]

    await eventually(asleep, what="the stage marked asleep")
    with pytest.raises(StageAsleepError):
        await last(typed, "during")
    [res] = await sleeping
    assert res.ok
    with pytest.raises(StageAsleepError):
        await last(typed, "while asleep")
    [res] = await typed.collective_rpc("wake_up", timeout=10)
    assert res.ok
    assert (await last(typed, "awake")).text == "awake"


async def test_set_batching_cannot_lift_the_runners_batch_limit(no_leaks):
    engine = start(runner_stage("OneAtATimeRunner", engine_args={"max_num_seqs": 4}))
    try:
        [res] = await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 4})
        assert res.ok and res.result["max_num_seqs"] == 1 and res.result["max_batch_size"] == 1
        outs = await asyncio.gather(*(last(engine, f"p{i}", {"delay_ms": 50}) for i in range(4)))
        assert {o.metrics["batch_size"] for o in outs} == {1}
    finally:
        await close(engine)


async def test_an_output_no_message_can_carry_fails_that_request_alone(no_leaks):
    engine = start(runner_stage("BadOutputRunner", engine_args={"max_num_seqs": 4}))
    try:
        results = await asyncio.wait_for(
            asyncio.gather(
                last(engine, "surrogate"), last(engine, "bigint"), last(engine, "plain"), return_exceptions=True
            ),
            10,
        )
        assert isinstance(results[0], StageExecutionError) and "cannot be sent" in str(results[0])
        assert isinstance(results[1], StageExecutionError) and "OverflowError" in str(results[1])
        assert results[2].text == "plain"
        [res] = await engine.collective_rpc("bigint", timeout=5)
        assert not res.ok and "cannot be sent" in res.error
        assert (await last(engine, "after")).text == "after"
    finally:
        await close(engine)


async def test_a_closed_engine_refuses_with_engine_closed(no_leaks):
    engine = start(echo_stage())
    await close(engine)
    with pytest.raises(EngineClosedError):
        await last(engine, "late")
    with pytest.raises(EngineClosedError):
        await engine.collective_rpc("ping")
    with pytest.raises(EngineClosedError):  # not UnknownRequestError: every call says the engine is closed
        engine.add_streaming_update("late", "more")
