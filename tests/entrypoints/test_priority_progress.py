"""Priority and progress through a real engine (stage processes): a higher-priority request
overtakes waiting ones, progress outputs arrive while a request-level wave denoises, and a split
pipeline reports each inner stage as it finishes."""

from __future__ import annotations

import asyncio

import pytest

from omni_runtime import AsyncOmni, Omni
from omni_runtime.exceptions import InvalidRequestError, QueueFullError
from omni_runtime.params import DiffusionSamplingParams, EchoSamplingParams
from tests.conftest import echo_stage, eventually, has_progress, make_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def echo():
    # Learned batching, seeded by a start-up profile; a request's own slo_ms may shed it.
    engine_args = {"max_num_seqs": 1, "batch_policy": "learned", "slo_shed": True, "batch_profile": {"max_s": 10}}
    engine = AsyncOmni(make_config([echo_stage(engine_args=engine_args)]))
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


async def finish(engine: AsyncOmni, prompt: str, params: object, order: list[str]) -> None:
    async for out in engine.generate(prompt, params):
        if out.finished:
            order.append(prompt)


async def running(engine: AsyncOmni) -> bool:
    """Whether stage 0 is running a request (not only holding it in its queue)."""
    [stats] = await engine.collective_rpc("get_stats")
    return stats.result["running"] > 0


async def test_a_higher_priority_request_overtakes_waiting_ones(echo: AsyncOmni) -> None:
    order: list[str] = []
    hog = asyncio.create_task(finish(echo, "hog", EchoSamplingParams(delay_ms=400), order))
    await eventually(lambda: running(echo), what="the hog running")  # the others queue behind it
    tasks = [
        asyncio.create_task(finish(echo, name, EchoSamplingParams(delay_ms=1, priority=p), order))
        for name, p in (("low-a", 0), ("low-b", 0), ("high", 5), ("mid", 1))
    ]
    await asyncio.gather(hog, *tasks)
    assert order == ["hog", "high", "mid", "low-a", "low-b"]


async def test_priority_is_validated_and_a_bad_one_names_the_field(echo: AsyncOmni) -> None:
    for bad in (10**7, -(10**7), "high", 1.5, True):
        with pytest.raises(InvalidRequestError) as e:
            echo.validate("x", {"priority": bad})
        assert e.value.param == "priority"
    assert echo.validate("x", {"priority": -3}).priority == -3
    assert echo.validate("x").priority == 0
    async for out in echo.generate("still serves", {"priority": 2}):
        last = out
    assert last.finished and last.text == "still serves"


def sd(stage_id: int = 0, **engine_args: object) -> dict:
    return {
        "stage_id": stage_id,
        "stage_type": "diffusion",
        "model": "builtin:tiny-sd",
        "runtime": {"backend": "process", "torch_threads": 1},
        "final_output": True,
        "final_output_type": "image",
        "default_sampling_params": {"height": 32, "width": 32, "guidance_scale": 1.0},
        # Progress at every step: a few steps show it, and nothing waits for the throttle.
        "engine_args": {"max_num_seqs": 2, "progress_interval_s": 0, **engine_args},
    }


@pytest.fixture(scope="module")
async def tiny_sd():
    engine = AsyncOmni(make_config([sd()]))
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


async def test_request_level_waves_report_progress_before_the_image(tiny_sd: AsyncOmni) -> None:
    steps = 8
    outs = [o async for o in tiny_sd.generate("a red kite", DiffusionSamplingParams(num_inference_steps=steps))]
    progress = [o.progress for o in outs if o.progress is not None]
    assert progress and progress[0].step == 1, "no progress output from the first step"
    assert all(p.stage_id == 0 and p.steps == steps and p.step is not None and 1 <= p.step <= steps for p in progress)
    assert [p.step for p in progress] == sorted({p.step for p in progress})  # increasing, no repeats
    assert all(not o.finished and not o.images for o in outs[:-1])
    final = outs[-1]
    assert final.finished and final.progress is None and len(final.images) == 1


def test_the_blocking_api_returns_the_final_output_not_a_progress_notice() -> None:
    # A stepping echo sends progress at each of its 8 steps, as a diffusion stage does, without a
    # model to load.
    stepping = echo_stage(
        stage_type="tests.helpers:SteppingEcho", engine_args={"step_execution": True, "progress_interval_s": 0}
    )
    with Omni(make_config([stepping])) as omni:
        (out,) = omni.generate(["a green kite"], EchoSamplingParams(delay_ms=1))
    assert out.finished and out.progress is None and out.text == "a green kite"


async def test_a_split_pipeline_reports_each_inner_stage_when_it_is_done() -> None:
    async with AsyncOmni("tiny-sd-split") as engine:
        outs = [
            o async for o in engine.generate("a blue kite", engine.sampling_params(image={"num_inference_steps": 2}))
        ]
    done = [o.progress.stage_id for o in outs if o.progress and o.progress.stage_done]
    assert done == [0, 1]  # the encoder, then the denoiser; the decoder's output is the final one
    assert outs[-1].finished and outs[-1].images and outs[-1].stage_id == 2


async def test_with_step_execution_a_higher_priority_request_preempts_at_a_step_boundary() -> None:
    async with AsyncOmni(make_config([sd(max_num_seqs=1, step_execution=True)])) as engine:
        order: list[str] = []
        low_outs: list = []

        async def low() -> None:
            async for out in engine.generate("a slow ship", DiffusionSamplingParams(num_inference_steps=60, seed=1)):
                low_outs.append(out)
            order.append("low")

        task = asyncio.create_task(low())
        await eventually(lambda: has_progress(low_outs), timeout=120, what="low stepping")  # alone in the batch
        await finish(engine, "high", DiffusionSamplingParams(num_inference_steps=2, priority=9), order)
        await task
    assert order == ["high", "low"]
    final = low_outs[-1]
    assert final.finished and final.metrics["pauses"] >= 1 and final.metrics["steps_run"] == 60


async def test_get_stats_reports_the_learned_cost_of_a_batch(echo: AsyncOmni) -> None:
    [res] = await echo.collective_rpc("set_batching", kwargs={"max_num_seqs": 4})
    assert res.ok
    try:
        for burst in range(3):  # the first runs alone, the rest queue behind it and run together
            order: list[str] = []
            await asyncio.gather(
                *(finish(echo, f"cost-{burst}-{i}", EchoSamplingParams(delay_ms=30), order) for i in range(4))
            )
        [stats] = await echo.collective_rpc("get_stats")
        cost = stats.result["cost_model"]
        assert cost["policy"] == "learned" and cost["num_keys"] >= 1
        [key] = cost["keys"]
        assert key["samples"] >= 3 and key["fixed_ms"] >= 0 and key["per_item_ms"] >= 0
        assert 1 <= key["best_batch"] <= 4
    finally:
        await echo.collective_rpc("set_batching", kwargs={"max_num_seqs": 1})


async def test_the_start_up_profile_gave_a_fit_before_any_request(echo: AsyncOmni) -> None:
    [stats] = await echo.collective_rpc("get_stats")
    profile = stats.result["batch_profile"]
    # Timed at 1, 2 and 4 though max_num_seqs is 1: a later set_batching may raise it.
    assert profile["forwards"] == {"1": 1, "2": 1, "4": 1} and profile["note"] is None
    assert profile["fixed_ms"] >= 0 and profile["per_item_ms"] >= 0 and profile["seconds"] <= 10


async def test_a_request_that_cannot_meet_its_own_slo_is_shed_with_a_retry_after(echo: AsyncOmni) -> None:
    order: list[str] = []
    for i in range(3):  # the model learns that a forward here takes about 100 ms
        await finish(echo, f"learn-{i}", EchoSamplingParams(delay_ms=100), order)
    hog = asyncio.create_task(finish(echo, "hog", EchoSamplingParams(delay_ms=300), order))
    await eventually(lambda: running(echo), what="the hog running")
    with pytest.raises(QueueFullError) as e:
        await finish(echo, "hurried", EchoSamplingParams(slo_ms=1), order)
    assert e.value.retry_after_s > 0 and "slo_ms" in str(e.value)
    await finish(echo, "patient", EchoSamplingParams(slo_ms=600_000), order)
    await hog
    assert order[-2:] == ["hog", "patient"]
    [stats] = await echo.collective_rpc("get_stats")
    assert stats.result["slo_shed"] >= 1
