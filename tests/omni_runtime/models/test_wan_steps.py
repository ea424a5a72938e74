"""Wan text-to-video in step execution through a real engine (one stage process): a video request
joins a running batch of its frame count and size, leaves when its steps are done, and each video
equals the one it makes alone (same seed); ``max_video_pixels`` bounds a step's batch; a video
request aborted mid-denoise frees its slot, so the request behind it runs. The runner-level
equality with request-level videos is in tests/omni_runtime/stage/runners/test_diffusion_steps.py
(every family with a step loop)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_runtime import AsyncOmni
from omni_runtime.exceptions import RequestAbortedError
from omni_runtime.media import VideoItem
from tests.conftest import eventually, make_config

pytestmark = pytest.mark.integration

#: Small videos: 5 frames (2 latent frames) of 32 x 32.
DEFAULTS = {"num_inference_steps": 4, "guidance_scale": 5.0, "height": 32, "width": 32, "num_frames": 5}


def wan_stage() -> dict:
    return {
        "stage_id": 0,
        "stage_type": "diffusion",
        "model": "builtin:tiny-wan",
        "runtime": {"backend": "process", "torch_threads": 1},
        "final_output": True,
        "final_output_type": "video",
        "default_sampling_params": DEFAULTS,
        # Two 5-frame 32 x 32 videos' worth: a step's batch holds two of them at most.
        # Progress after every step: a test waits for a request's first step, which must not
        # depend on the throttle letting one through before a fast request is done.
        "engine_args": {
            "max_num_seqs": 4,
            "step_execution": True,
            "max_video_pixels": 2 * 5 * 32 * 32,
            "progress_interval_s": 0,
        },
    }


@pytest.fixture(scope="module")
async def engine(model_cache: Path):
    engine = AsyncOmni(make_config([wan_stage()]))
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


async def outputs(engine: AsyncOmni, prompt: str, rid: str | None = None, **params: Any) -> list:
    return [out async for out in engine.generate(prompt, params, rid)]


async def first_progress(engine: AsyncOmni, prompt: str, rid: str, **params: Any) -> asyncio.Task:
    """Start a request and return a task for all its outputs once its first step is done."""
    stream = engine.generate(prompt, params, rid)
    first = await stream.__anext__()
    assert first.progress is not None and first.progress.step >= 1 and not first.finished, (
        f"first output: error {first.error!r}, finished {first.finished}, stage {first.stage_id}"
    )

    async def rest() -> list:
        return [first] + [out async for out in stream]

    return asyncio.create_task(rest())


def video(final: Any) -> VideoItem:
    assert final.finished and final.error is None, final.error
    (item,) = final.videos
    return item


def assert_same_video(got: VideoItem, solo: VideoItem) -> None:
    # Batched kernels are not bitwise batch-1 ones: within two uint8 levels.
    assert got.frames.shape == solo.frames.shape and got.fps == solo.fps
    assert np.abs(got.frames.astype(int) - solo.frames.astype(int)).max() <= 2


async def stats(engine: AsyncOmni) -> dict:
    return (await engine.collective_rpc("get_stats"))[0].result


async def test_a_video_joins_a_running_batch_leaves_when_done_and_equals_its_solo_video(engine) -> None:
    long = await first_progress(engine, "a long boat ride", "long", seed=1, num_inference_steps=120)
    short = (await outputs(engine, "a boat", "short", seed=2, fps=8))[-1]
    assert not long.done()  # it did not wait for the running batch to end
    assert short.metrics["batch_size"] == 2 and short.metrics["steps_run"] == 4  # stepped alongside
    joined = video(short)
    assert joined.fps == 8 and joined.frames.shape == (5, 32, 32, 3) and joined.frames.dtype == np.uint8
    left = (await long)[-1]  # it went on alone after the short one left
    assert left.metrics["steps_run"] == 120
    # Alone, the same seeds make the same videos.
    solo_short = (await outputs(engine, "a boat", "solo-short", seed=2, fps=8))[-1]
    solo_long = (await outputs(engine, "a long boat ride", "solo-long", seed=1, num_inference_steps=120))[-1]
    assert solo_short.metrics["batch_size"] == 1 and solo_long.metrics["batch_size"] == 1
    assert_same_video(joined, video(solo_short))
    assert_same_video(video(left), video(solo_long))
    assert np.abs(joined.frames.astype(int) - video(left).frames.astype(int)).max() > 10  # not one video twice


async def test_two_frame_counts_run_in_steps_of_their_own(engine) -> None:
    before = (await stats(engine))["steps"]
    five, nine = await asyncio.gather(
        outputs(engine, "a boat", seed=3, num_frames=5), outputs(engine, "a boat", seed=3, num_frames=9)
    )
    assert video(five[-1]).frames.shape[0] == 5 and video(nine[-1]).frames.shape[0] == 9
    # Latents of two frame counts never share a denoiser call: 4 steps each.
    assert (await stats(engine))["steps"] - before == 4 + 4


async def test_max_video_pixels_bounds_a_step_batch_and_the_third_video_waits(engine) -> None:
    before = (await stats(engine))["batch_size_histogram"]
    finals = [out[-1] for out in await asyncio.gather(*(outputs(engine, "a boat", seed=seed) for seed in (6, 7, 8)))]
    sizes = [f.metrics["batch_size"] for f in finals]
    assert max(sizes) == 2, sizes  # two stepped together, never three (max_num_seqs is 4)
    after = (await stats(engine))["batch_size_histogram"]
    assert set(after) - set(before) <= {"1", "2"} and "3" not in after and "4" not in after, after
    for seed, final in zip((6, 7, 8), finals, strict=True):
        assert_same_video(video(final), video((await outputs(engine, "a boat", seed=seed))[-1]))


async def queued(engine: AsyncOmni) -> bool:
    return (await stats(engine))["queue_len"] > 0


async def test_aborting_a_video_mid_denoise_frees_the_replica(engine) -> None:
    # The quiet window is taken under step execution, and has no effect: nothing is held.
    [res] = await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 1, "batch_quiet_window_ms": 50})
    assert res.ok and res.result["max_num_seqs"] == 1 and res.result["batch_quiet_window_ms"] == 0.0
    try:
        hog = await first_progress(engine, "a very long boat ride", "hog", seed=4, num_inference_steps=300)
        waiting = asyncio.create_task(outputs(engine, "next", seed=5))
        await eventually(lambda: queued(engine), what="the next video waiting for the slot")
        engine.abort("hog")
        with pytest.raises(RequestAbortedError):
            await hog
        final = (await waiting)[-1]
        assert video(final).frames.shape == (5, 32, 32, 3) and final.metrics["steps_run"] == 4
        s = await stats(engine)
        assert s["running"] == 0 and s["queue_len"] == 0
    finally:
        await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 4})
