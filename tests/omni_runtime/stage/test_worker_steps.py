"""The stage worker in process (no engine, no socket): in step execution, preemption by priority at a
step boundary with a real tiny-sd runner, abort at the next boundary, progress events, and the
fallback of a runner that cannot run step by step; the quiet-window engine arg."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import Progress, StageAbort, StageOutput, StageOutputs, StageRequest
from omni_runtime.params import DiffusionSamplingParams, EchoSamplingParams, resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.worker import StageWorker

pytestmark = pytest.mark.integration

SD = {"height": 64, "width": 64, "guidance_scale": 7.5, "output_type": "np"}
#: An echo request's params as the engine sends them (resolved: nothing set, the fallbacks in force).
ECHO = resolve_params(EchoSamplingParams, {}, {})


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache


def stage(stage_type: str, model: str | None = None, **engine_args: Any) -> StageConfig:
    data = {"stage_id": 0, "stage_type": stage_type, "model": model, "engine_args": engine_args}
    return msgspec.convert(data, StageConfig)


class Outbox(list):
    """What the worker sent (a wave's outputs one by one), and a way to wait for a message."""

    def add(self, msg: Any) -> None:
        self.extend(msg.outputs if isinstance(msg, StageOutputs) else [msg])

    async def wait_for(self, predicate: Callable[[Any], bool], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in self:
                if predicate(msg):
                    return msg
            await asyncio.sleep(0.005)
        raise TimeoutError(f"no such message in {[type(m).__name__ for m in self]}")

    def finals(self) -> list[StageOutput]:
        return [m for m in self if isinstance(m, StageOutput) and m.finished]

    def progress(self, rid: str) -> list[Progress]:
        return [
            m.payload.progress
            for m in self
            if isinstance(m, StageOutput) and not m.finished and m.request_id == rid and m.payload.progress
        ]


async def started(config: StageConfig) -> tuple[StageWorker, Outbox]:
    outbox = Outbox()
    worker = StageWorker(config, 0, send=outbox.add)
    await worker.start()
    return worker, outbox


def is_final(rid: str) -> Callable[[Any], bool]:
    return lambda m: isinstance(m, StageOutput) and m.finished and m.request_id == rid


async def test_a_higher_priority_request_preempts_and_the_other_resumes_unchanged(cache: Path) -> None:
    worker, outbox = await started(stage("diffusion", "builtin:tiny-sd", max_num_seqs=1, step_execution=True))
    try:
        low = resolve_params(DiffusionSamplingParams, {}, {**SD, "num_inference_steps": 12, "seed": 1})
        high = resolve_params(DiffusionSamplingParams, {}, {**SD, "num_inference_steps": 3, "seed": 2})
        worker.handle(StageRequest(request_id="low", prompt="a cup of coffee", params=low))
        await outbox.wait_for(lambda m: isinstance(m, StageOutput) and m.request_id == "low")  # it is stepping
        worker.handle(StageRequest(request_id="high", prompt="a toy dinosaur", params=high, priority=5))
        await outbox.wait_for(is_final("low"))
        finals = outbox.finals()
        assert [m.request_id for m in finals] == ["high", "low"]  # the one place went to high first
        by_id = {m.request_id: m for m in finals}
        assert by_id["low"].payload.metrics.pauses == 1 and by_id["high"].payload.metrics.pauses == 0
        assert by_id["low"].payload.metrics.steps_run == 12 and by_id["high"].payload.metrics.batch_size == 1
        progress = outbox.progress("low")
        assert progress[0] == Progress(step=1, steps=12) and all(p.steps == 12 for p in progress)
        assert len(progress) < 12  # bursts, not an event per step
        # Its state was kept while it waited: the image is the one it makes alone.
        ctx = ExecuteContext(lambda rid: False)
        for rid, params, prompt in (("low", low, "a cup of coffee"), ("high", high, "a toy dinosaur")):
            (solo,) = worker.runner.execute([RunnerRequest(rid, prompt, params)], ctx)
            np.testing.assert_allclose(by_id[rid].payload.tensors["images"], solo.tensors["images"], rtol=0, atol=1e-3)
        stats = worker.stats()
        assert stats["step_execution"] is True and stats["requests_served"] == 2 and stats["running"] == 0
    finally:
        await worker.close()


async def test_abort_frees_the_slot_at_the_next_step_and_sends_nothing_more(cache: Path) -> None:
    config = stage("tests.helpers:SteppingEcho", max_num_seqs=2, step_execution=True)
    worker, outbox = await started(config)
    try:
        slow = EchoSamplingParams(delay_ms=30.0)  # 8 steps of 30 ms
        for rid in ("a", "b", "c"):
            worker.handle(StageRequest(request_id=rid, prompt=rid, params=slow))
        await outbox.wait_for(lambda m: isinstance(m, StageOutput) and m.request_id == "a")
        worker.handle(StageAbort(request_ids=["a"]))
        await outbox.wait_for(is_final("c"))
        await outbox.wait_for(is_final("b"))
        assert all(m.request_id != "a" for m in outbox.finals())  # its caller was answered upstream
        c = next(m for m in outbox.finals() if m.request_id == "c")
        # c took a's slot at the next boundary, long before a's 8 steps would have ended.
        assert c.payload.text == "c" and c.payload.metrics.queue_wait_ms < 8 * 30 and c.payload.metrics.steps_run == 8
        stats = worker.stats()
        assert stats["requests_served"] == 2 and stats["running"] == 0 and stats["queue_len"] == 0
    finally:
        await worker.close()


async def test_a_progress_interval_of_zero_reports_every_step() -> None:
    worker, outbox = await started(stage("tests.helpers:SteppingEcho", step_execution=True, progress_interval_s=0))
    try:
        worker.handle(StageRequest(request_id="a", prompt="a", params=EchoSamplingParams(delay_ms=1.0)))
        await outbox.wait_for(is_final("a"))
        # Every step but the last, whose output is the final one (the throttle would send one or two).
        assert [p.step for p in outbox.progress("a")] == list(range(1, 8))
    finally:
        await worker.close()


async def test_a_request_the_runner_does_not_step_fails_instead_of_holding_its_slot(cache: Path) -> None:
    worker, outbox = await started(stage("tests.helpers:ForgetfulStepper", max_num_seqs=2, step_execution=True))
    try:
        worker.handle(StageRequest(request_id="lost", prompt="lost", params=ECHO))
        worker.handle(StageRequest(request_id="ok", prompt="ok", params=ECHO))
        lost = await outbox.wait_for(is_final("lost"))
        ok = await outbox.wait_for(is_final("ok"))
        assert lost.error is not None and "no result" in lost.error.message and ok.payload.text == "ok"
        assert worker.stats()["running"] == 0
    finally:
        await worker.close()


async def test_a_runner_that_cannot_step_falls_back_with_a_logged_reason(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="omni_runtime.stage.worker"):
        worker, outbox = await started(stage("echo", max_num_seqs=4, step_execution=True))
    try:
        assert "request-level batching: EchoRunner does not run requests step by step" in caplog.text
        worker.handle(StageRequest(request_id="r", prompt="hi", params=ECHO))
        out = await outbox.wait_for(is_final("r"))
        assert out.payload.text == "hi" and out.payload.metrics.batch_id == 1
        assert worker.stats()["step_execution"] is False
    finally:
        await worker.close()


def test_the_quiet_window_engine_arg_reaches_the_request_level_scheduler() -> None:
    fixed = StageWorker(stage("echo", request_batch_max_wait_ms=50, batch_quiet_window_ms=12), 0, send=print)
    assert fixed.scheduler.stable_window_ms == 12
    adaptive = StageWorker(stage("echo", request_batch_max_wait_ms=50), 0, send=print)
    assert adaptive.scheduler.stable_window_ms == 5.0  # the floor, until arrivals say otherwise


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"request_batch_max_wait_ms": 1e300}, "request_batch_max_wait_ms"),
        ({"max_num_seqs": 2**62}, "max_num_seqs"),
        ({"request_batch_max_wait_ms": float("nan")}, "request_batch_max_wait_ms"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"batch_quiet_window_ms": -1}, "batch_quiet_window_ms"),
        ({"wait": 1}, "wait"),
    ],
)
async def test_the_stage_checks_set_batching_against_the_yaml_bounds_too(kwargs: dict, param: str) -> None:
    """Whatever path a control call took to the stage, its kwargs meet the YAML's bounds there."""
    worker = StageWorker(stage("echo", max_num_seqs=4, request_batch_max_wait_ms=50), 0, send=print)
    with pytest.raises(InvalidRequestError) as err:
        await worker._call("set_batching", [], kwargs)
    assert err.value.param == param
    assert (worker.scheduler.max_num_seqs, worker.scheduler.max_wait_ms) == (4, 50)
    applied = await worker._call("set_batching", [], {"max_num_seqs": 1024, "request_batch_max_wait_ms": 60_000})
    assert applied["max_num_seqs"] == 1024 and applied["request_batch_max_wait_ms"] == 60_000


async def test_the_deadline_policy_lets_an_urgent_request_through_and_sheds_what_cannot_make_it(cache: Path) -> None:
    """tiny-sd in step execution with ``batch_policy: deadline`` and ``slo_shed``: a request with a
    target takes the one place from a long one without a target at the next step, and, once the
    cost of a step is known, a request whose target its steps alone exceed is refused at once
    with when to come back; one of an unknown key is never refused."""
    config = stage(
        "diffusion", "builtin:tiny-sd", max_num_seqs=1, step_execution=True, batch_policy="deadline", slo_shed=True
    )
    worker, outbox = await started(config)
    try:

        def params(steps: int, seed: int, **extra: Any) -> DiffusionSamplingParams:
            given = {**SD, "num_inference_steps": steps, "seed": seed, **extra}
            return resolve_params(DiffusionSamplingParams, {}, given)

        # Unknown key at first: an impossible target is not refused without evidence.
        worker.handle(StageRequest(request_id="first", prompt="a kite", params=params(2, 0, slo_ms=1)))
        await outbox.wait_for(is_final("first"))
        assert outbox.finals()[0].error is None
        worker.handle(StageRequest(request_id="long", prompt="a cup of coffee", params=params(16, 1)))
        await outbox.wait_for(lambda m: isinstance(m, StageOutput) and m.request_id == "long")  # it is stepping
        worker.handle(StageRequest(request_id="urgent", prompt="a toy dinosaur", params=params(3, 2, slo_ms=5000)))
        worker.handle(StageRequest(request_id="hopeless", prompt="a boat", params=params(10, 3, slo_ms=1)))
        await outbox.wait_for(is_final("long"))
        by_id = {m.request_id: m for m in outbox.finals()}
        assert [m.request_id for m in outbox.finals()][1:] == ["hopeless", "urgent", "long"]
        shed = by_id["hopeless"].error
        assert shed is not None and shed.type == "QueueFullError" and "past the request's slo_ms 1" in shed.message
        assert shed.retry_after_s is not None and shed.retry_after_s > 0
        assert by_id["urgent"].payload.metrics.pauses == 0 and by_id["long"].payload.metrics.pauses == 1
        assert worker.stats()["requests_served"] == 3
    finally:
        await worker.close()


async def test_a_burst_of_extreme_targets_aborts_and_repeats_each_gets_one_answer(cache: Path) -> None:
    """The deadline policy with shedding and the result cache together, under a seeded burst: slo_ms
    at its bounds (the least positive float, an hour), none, repeats of one seeded request (hits),
    and aborts of some of them, of each kind. Every request that is not aborted gets exactly one
    final answer (served, or shed with a finite hint), an aborted one at most one, nothing is left
    queued or pending, and the worker serves afterwards."""
    config = stage(
        "diffusion", "builtin:tiny-sd", max_num_seqs=2, step_execution=True, batch_policy="deadline",
        slo_shed=True, result_cache={"max_bytes": 2**20},
    )  # fmt: skip
    worker, outbox = await started(config)
    try:

        def params(steps: int, seed: int, slo_ms: float | None) -> DiffusionSamplingParams:
            given = {**SD, "num_inference_steps": steps, "seed": seed, "slo_ms": slo_ms}
            return resolve_params(DiffusionSamplingParams, {}, given)

        # The cost of a step of this key is known from here on (evidence for shedding).
        worker.handle(StageRequest(request_id="warm", prompt="a kite", params=params(2, 0, None)))
        await outbox.wait_for(is_final("warm"))
        rng = np.random.default_rng(7)
        targets = [5e-324, 1e-9, 1.0, 3_600_000.0, None]
        ids, aborted = [], set()
        for i in range(24):
            rid = f"b{i}"
            if i % 4 == 0:  # the warm-up again: a result-cache hit
                worker.handle(StageRequest(request_id=rid, prompt="a kite", params=params(2, 0, None)))
            else:
                slo = targets[int(rng.integers(len(targets)))]
                steps = int(rng.integers(1, 4))
                worker.handle(StageRequest(request_id=rid, prompt=f"p{i % 3}", params=params(steps, i, slo)))
            ids.append(rid)
            if rng.random() < 0.3:
                worker.handle(StageAbort(request_ids=[rid]))
                aborted.add(rid)
            if i % 5 == 0:
                await asyncio.sleep(0)  # let steps run between arrivals

        async def settled() -> bool:
            s = worker.stats()
            return s["queue_len"] == 0 and s["running"] == 0 and s["result_cache"]["pending"] == 0

        deadline = time.monotonic() + 60
        while not await settled():
            assert time.monotonic() < deadline, worker.stats()
            await asyncio.sleep(0.01)
        finals: dict[str, list[StageOutput]] = {}
        for m in outbox.finals():
            finals.setdefault(m.request_id, []).append(m)
        for rid in ids:
            answers = finals.get(rid, [])
            assert len(answers) == (len(answers) if rid in aborted else 1) <= 1, (rid, answers)
            for m in answers:
                if m.error is not None:
                    assert m.error.type == "QueueFullError", m.error
                    assert m.error.retry_after_s is not None and 0 < m.error.retry_after_s < 3600
        kinds = {
            "shed" if m.error else "hit" if m.payload.metrics.extra.get("result_cache_hit") else "ran"
            for m in outbox.finals()
        }
        assert kinds == {"shed", "hit", "ran"}  # the seeded burst reaches every path
        worker.handle(StageRequest(request_id="after", prompt="a boat", params=params(2, 99, 3_600_000.0)))
        after = await outbox.wait_for(is_final("after"))
        assert after.error is None
    finally:
        await worker.close()


def test_the_deadline_policy_needs_step_execution() -> None:
    from omni_runtime.config import parse_config
    from omni_runtime.exceptions import ConfigError

    echo = {"stage_id": 0, "stage_type": "echo", "final_output": True, "final_output_type": "text"}
    echo["engine_args"] = {"batch_policy": "deadline"}
    data = {"stage_args": [echo]}
    with pytest.raises(ConfigError, match=r"stage_args\[0\]\.engine_args\.batch_policy.*step_execution: true"):
        parse_config(data)
    data["stage_args"][0]["engine_args"]["step_execution"] = True
    assert parse_config(data).stage_args[0].engine_args.batch_policy == "deadline"
