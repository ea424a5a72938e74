"""Step-level continuous batching through a real engine (a stage process each): a request joins a
running batch and still gets its solo image, progress events, abort and deadlines free a slot at the
next step, two sizes and step counts in flight, the blocking API, and the liveness contract."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime import AsyncOmni, Omni
from omni_runtime.config import StageConfig
from omni_runtime.exceptions import (
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    RequestTimeoutError,
    StageDeadError,
)
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.conftest import eventually, make_config
from tests.helpers import SD_DEFAULTS, diffusion_params, tiny_sd_stage

pytestmark = pytest.mark.integration

DEFAULTS = SD_DEFAULTS


def sd_stage(**engine_args: object) -> dict:
    return tiny_sd_stage(step_execution=True, **engine_args)


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache


@pytest.fixture(scope="module")
async def engine(cache: Path):
    engine = AsyncOmni(make_config([sd_stage()]))
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


@pytest.fixture(scope="module")
def reference(cache: Path) -> Iterator[DiffusionRunner]:
    """The same model in this process, request-level, for solo results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runner = DiffusionRunner(msgspec.convert(sd_stage(), StageConfig))
    runner.load()
    yield runner
    torch.set_num_threads(threads)


def solo_images(runner: DiffusionRunner, prompt: str, **params: object) -> np.ndarray:
    request = RunnerRequest("solo", prompt, diffusion_params({**DEFAULTS, "output_type": "np", **params}))
    (out,) = runner.execute([request], ExecuteContext(lambda rid: False))
    return out.tensors["images"]


async def outputs(engine: AsyncOmni, prompt: str, rid: str | None = None, **params: object) -> list:
    return [out async for out in engine.generate(prompt, params, rid)]


async def first_progress(engine: AsyncOmni, prompt: str, rid: str, **params: object):
    """Start a request and return (its task, the output stream) once its first step is done."""
    stream = engine.generate(prompt, params, rid)
    first = await stream.__anext__()
    assert first.progress.step >= 1 and not first.finished

    async def rest() -> list:
        return [first] + [out async for out in stream]

    return asyncio.create_task(rest())


async def stats(engine: AsyncOmni) -> dict:
    return (await engine.collective_rpc("get_stats"))[0].result


async def test_a_request_joins_a_running_batch_and_gets_its_solo_image(engine, reference) -> None:
    long = await first_progress(engine, "a long one", "long", seed=1, num_inference_steps=60)
    short = await outputs(engine, "a toy dinosaur", seed=2, num_inference_steps=4, output_type="np")
    assert not long.done()  # the short one did not wait for the running batch to end
    final = short[-1]
    assert final.finished and final.metrics["steps_run"] == 4
    assert final.metrics["batch_size"] == 2  # it stepped alongside the long one
    assert final.metrics["queue_wait_ms"] < final.metrics["execution_ms"]
    np.testing.assert_allclose(
        final.tensors["images"], solo_images(reference, "a toy dinosaur", seed=2), rtol=0, atol=1e-3
    )
    engine.abort("long")
    with pytest.raises(RequestAbortedError):
        await long


async def test_progress_events_come_before_the_final_output_and_are_throttled(engine) -> None:
    start = time.monotonic()
    outs = await outputs(engine, "a fox", seed=3, num_inference_steps=24)
    elapsed = time.monotonic() - start
    *partials, final = outs
    steps = [p.progress.step for p in partials]
    # A burst at most every 0.3 s: one at least in a request this long, never one per step.
    assert 1 <= len(steps) <= elapsed / 0.3 + 1 and steps == sorted(steps) and max(steps) < 24
    assert all(not p.finished and not p.images and p.progress.steps == 24 for p in partials)
    assert final.finished and len(final.images) == 1 and final.metrics["seed"] == 3
    assert 0 < final.metrics["time_to_first_step_ms"] <= final.metrics["e2e_ms"]
    s = await stats(engine)
    assert s["step_execution"] is True and s["progress_events"] >= len(partials) >= 1
    assert s["progress_bursts"] <= s["step_time_ms"] / 300 + 5


async def queued(engine: AsyncOmni) -> bool:
    return (await stats(engine))["queue_len"] > 0


async def running(engine: AsyncOmni) -> bool:
    return (await stats(engine))["running"] > 0


async def test_abort_and_deadline_free_the_slot_at_the_next_step(engine) -> None:
    [res] = await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 1})
    assert res.ok and res.result["max_num_seqs"] == 1
    try:
        # Abort: the waiting request takes the slot a step later, not 300 steps later.
        hog = await first_progress(engine, "hog", "hog", seed=4, num_inference_steps=300)
        waiting = asyncio.create_task(outputs(engine, "next", seed=5))
        await eventually(lambda: queued(engine), what="the next request waiting in the stage")
        engine.abort("hog")
        with pytest.raises(RequestAbortedError):
            await hog
        final = (await waiting)[-1]
        per_step_ms = final.metrics["execution_ms"] / 4
        assert final.metrics["queue_wait_ms"] < 200 + 50 * per_step_ms
        # Deadline: the same, through the engine's timer.
        start = time.monotonic()
        timed = asyncio.create_task(outputs(engine, "slow", seed=6, num_inference_steps=300, timeout=1.0))
        await eventually(lambda: running(engine), what="the slow request stepping")
        behind = await outputs(engine, "behind", seed=7)
        with pytest.raises(RequestTimeoutError):
            await timed
        assert behind[-1].finished and time.monotonic() - start < 1.0 + 50 * per_step_ms / 1000
    finally:
        await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 4})


async def test_two_sizes_and_step_counts_run_together(engine) -> None:
    shapes = [(64, 4), (48, 6), (64, 2), (48, 3)]
    before = (await stats(engine))["steps"]
    outs = await asyncio.gather(
        *(outputs(engine, f"p{i}", seed=10 + i, height=h, num_inference_steps=n) for i, (h, n) in enumerate(shapes))
    )
    for (h, n), out in zip(shapes, outs, strict=True):
        final = out[-1]
        assert final.images[0].size == (64, h) and final.metrics["steps_run"] == n
    # Each step is one key: 64 px takes 4 steps in all (2 and 4 together), 48 px 6.
    assert (await stats(engine))["steps"] - before == 4 + 6


def test_the_blocking_api_runs_a_prompt_list_step_by_step(cache: Path) -> None:
    with Omni(make_config([sd_stage()])) as omni:
        outs = omni.generate(["a cup", "a dog", "a fox"], {"seed": 20, "num_inference_steps": 3})
    assert [o.finished and len(o.images) for o in outs] == [1, 1, 1]
    assert all(o.metrics["steps_run"] == 3 and o.metrics["seed"] == 20 for o in outs)


def test_each_step_counts_as_progress_for_the_liveness_check(cache: Path) -> None:
    stage = {
        "stage_id": 0,
        "stage_type": "tests.helpers:SteppingEcho",
        "runtime": {
            "backend": "process",
            "torch_threads": 1,
            "stall_timeout_s": 1.0,
            "heartbeat_timeout_s": 2.0,
            "max_restarts": 0,
        },
        "final_output": True,
        "final_output_type": "text",
        "engine_args": {"max_num_seqs": 2, "step_execution": True},
    }
    with Omni(make_config([stage])) as omni:
        # 8 steps of 0.4 s: 3.2 s in all, past the 1 s stall timeout, which no single step reaches.
        [out] = omni.generate(["still alive"], {"delay_ms": 400.0})
        assert out.error is None and out.text == "still alive" and out.metrics["steps_run"] == 8
        # A step that does not return (stuck in native code, say) is caught: the replica is killed.
        start = time.monotonic()
        [stuck] = omni.generate(["stuck"], {"delay_ms": 30_000.0})
    assert isinstance(stuck.error, StageDeadError | EngineDeadError) and "progress" in str(stuck.error)
    assert time.monotonic() - start < 15


async def test_the_schedulers_real_step_limit_runs_and_one_past_it_is_refused(engine):
    # The step loop uses the same scheduler: 1,000 steps failed mid-denoise (IndexError) here too.
    with pytest.raises(InvalidRequestError) as err:
        await outputs(engine, "too many", num_inference_steps=1000)
    assert err.value.param == "num_inference_steps" and "1..999" in str(err.value)
    *_, out = await outputs(engine, "the most", seed=1, num_inference_steps=999, height=16, width=16, guidance_scale=0)
    assert out.error is None and out.images[0].size == (16, 16) and out.metrics["steps_run"] == 999
