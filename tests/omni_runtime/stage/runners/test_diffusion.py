"""DiffusionRunner on the builtin tiny-sd: batching, seeds, outputs, abort, sleep."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import RequestAbortedError
from omni_runtime.messages import StageConstraints
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.helpers import diffusion_params

NOT_ABORTED = ExecuteContext(lambda rid: False)
#: What the caller merges in from the stage's default_sampling_params.
DEFAULTS = {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 7.5}


def req(rid: str, prompt: str = "a cup of coffee", **params: Any) -> RunnerRequest:
    return RunnerRequest(request_id=rid, prompt=prompt, params=diffusion_params({**DEFAULTS, **params}))


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DiffusionRunner]:
    # The worker sets the thread count; one thread keeps these tests steady on a busy machine
    # (intra-op threads that wait for each other slow down badly under contention).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_RUNTIME_CACHE", str(tmp_path_factory.mktemp("cache")))
        stage = msgspec.convert({"stage_id": 0, "stage_type": "diffusion", "model": "builtin:tiny-sd"}, StageConfig)
        r = DiffusionRunner(stage)
        r.load()
        yield r
    torch.set_num_threads(threads)


def run(runner: DiffusionRunner, *requests: RunnerRequest, ctx: ExecuteContext = NOT_ABORTED) -> list:
    outs = runner.execute(list(requests), ctx)
    assert len(outs) == len(requests)
    for out in outs:
        if out.error is None:
            assert out.metrics["batch_size"] == len(requests)
            assert out.metrics["execution_ms"] > 0
    return outs


def floats(out: RunnerOutput) -> np.ndarray:
    return out.tensors["images"]


# ---------------------------------------------------------------------------- model


def test_load_facts(runner: DiffusionRunner) -> None:
    assert runner.max_batch_size is None  # StableDiffusion takes lists
    # tiny-sd's VAE scale is 2, but StableDiffusionPipeline itself insists on multiples of 8.
    assert runner.constraints() == StageConstraints(
        size_multiple=8,
        size_multiple_reason="the VAE scale factor 2, and the pipeline takes multiples of 8 only",
        max_pixels=4 * 64 * 64,  # 4 x the native 64 x 64
        native_size=(64, 64),
        image_inputs=("image", "mask_image"),  # img2img and inpainting forms of the same model
        default_strength={"image": 0.8, "inpaint": 1.0},
        lora=True,
        # DDIM with steps_offset 1 indexes past its 1,000 training timesteps at 1,000 steps.
        min_inference_steps=1,
        max_inference_steps=999,
        inference_steps_reason="DDIMScheduler (1000 training timesteps)",
        # No diffusers cache hooks on a UNet: a request's `cache` is refused before it is queued.
        cache_types=(),
        cache_note=(
            "the sd family's UNet2DConditionModel has no diffusers cache hooks (CacheMixin); "
            "step caching serves the flux and wan families"
        ),
    )


def test_output_types_and_sizes(runner: DiffusionRunner) -> None:
    pil = run(runner, req("a", seed=1, output_type="pil"))[0]
    assert len(pil.media) == 1
    assert pil.media[0].data.shape == (64, 64, 3) and pil.media[0].data.dtype == np.uint8
    np_out = run(runner, req("b", seed=1, output_type="np", height=32, width=48))[0]
    assert np_out.media == [] and floats(np_out).shape == (1, 32, 48, 3)
    assert floats(np_out).dtype == np.float32 and 0 <= floats(np_out).min() <= floats(np_out).max() <= 1
    latent = run(runner, req("c", seed=1, output_type="latent"))[0]
    assert latent.tensors["latents"].shape == (1, 4, 32, 32)
    # Absent params take the pipeline's own defaults (tiny-sd's native size is 64 px).
    bare = RunnerRequest("d", "a fox", diffusion_params({"num_inference_steps": 2, "output_type": "np", "seed": 3}))
    assert floats(run(runner, bare)[0]).shape == (1, 64, 64, 3)


def test_same_seed_is_bitwise_reproducible_and_seeds_differ(runner: DiffusionRunner) -> None:
    first = floats(run(runner, req("a", seed=7, output_type="np"))[0])
    again = floats(run(runner, req("b", seed=7, output_type="np"))[0])
    other = floats(run(runner, req("c", seed=8, output_type="np"))[0])
    assert np.array_equal(first, again)
    assert np.abs(first - other).max() > 0.05


@pytest.mark.parametrize("output_type", ["np", "pil"])
def test_a_batch_equals_each_request_run_alone(runner: DiffusionRunner, output_type: str) -> None:
    prompts = ["a cup of coffee", "a toy dinosaur", "a fox yawning", "the running river"]
    batch = [req(f"r{i}", p, seed=100 + i, output_type=output_type) for i, p in enumerate(prompts)]
    fused = run(runner, *batch)
    for request, out in zip(batch, fused, strict=True):
        solo = run(runner, request)[0]
        assert out.metrics["seed"] == solo.metrics["seed"] == request.params.seed
        if output_type == "np":
            np.testing.assert_allclose(floats(out), floats(solo), rtol=0, atol=1e-4)
        else:
            assert np.abs(out.media[0].data.astype(int) - solo.media[0].data.astype(int)).max() <= 1
    # Distinct prompts and seeds: the outputs were really split per request.
    first, second = (o.media[0].data if output_type == "pil" else floats(o) for o in fused[:2])
    assert not np.array_equal(first, second)


def test_fresh_seed_is_reported_and_reproduces_the_image(runner: DiffusionRunner) -> None:
    a, b = run(runner, req("a", output_type="np"), req("b", output_type="np"))
    seed = a.metrics["seed"]
    assert isinstance(seed, int) and seed != b.metrics["seed"]
    redo = run(runner, req("a2", output_type="np", seed=seed), req("b2", output_type="np", seed=b.metrics["seed"]))
    assert np.array_equal(floats(a), floats(redo[0]))


def test_num_images_per_prompt(runner: DiffusionRunner) -> None:
    a, b = run(
        runner,
        req("a", seed=5, num_images_per_prompt=2, output_type="np"),
        req("b", "a fox", seed=9, num_images_per_prompt=2, output_type="np"),
    )
    assert floats(a).shape == floats(b).shape == (2, 64, 64, 3)
    assert np.abs(floats(a)[0] - floats(a)[1]).max() > 0.05
    # The k images of a request come from seed, seed + 1... whatever it was batched with.
    for j in range(2):
        solo = floats(run(runner, req("s", seed=5 + j, output_type="np"))[0])[0]
        np.testing.assert_allclose(floats(a)[j], solo, rtol=0, atol=1e-4)
    alone_b = floats(run(runner, req("b", "a fox", seed=9, num_images_per_prompt=2, output_type="np"))[0])
    np.testing.assert_allclose(floats(b), alone_b, rtol=0, atol=1e-4)
    pil = run(runner, req("p", seed=5, num_images_per_prompt=2))[0]
    assert len(pil.media) == 2 and [m.seed for m in pil.media] == [5, 6]  # image j: seed + j


def test_negative_prompts(runner: DiffusionRunner) -> None:
    plain = floats(run(runner, req("a", seed=3, output_type="np"))[0])
    batch = [
        req("n1", seed=3, negative_prompt="blurry", output_type="np"),
        req("n2", "a fox", seed=4, negative_prompt="dark", output_type="np"),
    ]
    fused = run(runner, *batch)
    assert np.abs(floats(fused[0]) - plain).max() > 1e-3
    for request, out in zip(batch, fused, strict=True):
        np.testing.assert_allclose(floats(out), floats(run(runner, request)[0]), rtol=0, atol=1e-4)


def test_batch_key(runner: DiffusionRunner) -> None:
    key = runner.batch_key(req("a", seed=1))
    assert runner.batch_key(req("b", "something else", seed=2)) == key
    assert runner.batch_key(req("c")) == key
    # Defaults resolved: the pipeline's native size and one image per prompt, spelled out or not.
    implicit = RunnerRequest("d", "x", diffusion_params({"num_inference_steps": 4, "guidance_scale": 7.5}))
    assert runner.batch_key(implicit) == runner.batch_key(req("e", num_images_per_prompt=1, output_type="pil"))
    for change in (
        {"height": 32},
        {"width": 32},
        {"num_inference_steps": 8},
        {"guidance_scale": 1.0},
        {"negative_prompt": "blurry"},
        {"num_images_per_prompt": 2},
        {"output_type": "np"},
    ):
        assert runner.batch_key(req("f", **change)) != key, change
    hash(key)


def test_abort_of_the_whole_wave_stops_the_forward_early(runner: DiffusionRunner) -> None:
    unet_calls = []
    hook = runner.pipe.unet.register_forward_hook(lambda *args: unet_calls.append(1))
    try:
        # Every caller leaves after the first step has run: is_aborted flips at the 2nd check.
        ctx = ExecuteContext(lambda rid: len(unet_calls) >= 2)
        outs = run(runner, req("a", seed=1, num_inference_steps=20), req("b", seed=2, num_inference_steps=20), ctx=ctx)
        assert len(unet_calls) == 2  # (CFG runs both halves in one UNet call per step)
        assert all(isinstance(o.error, RequestAbortedError) for o in outs)
        assert [o.metrics["seed"] for o in outs] == [1, 2]

        # Aborted before it starts: no forward at all.
        unet_calls.clear()
        outs = run(runner, req("c"), ctx=ExecuteContext(lambda rid: True))
        assert unet_calls == [] and isinstance(outs[0].error, RequestAbortedError)

        # One of two aborted: the wave finishes for the other one.
        unet_calls.clear()
        outs = run(runner, req("d", seed=1), req("e", seed=2), ctx=ExecuteContext(lambda rid: rid == "d"))
        assert len(unet_calls) == 4
        assert all(o.error is None and len(o.media) == 1 for o in outs)
    finally:
        hook.remove()


def test_pipeline_errors_propagate(runner: DiffusionRunner) -> None:
    with pytest.raises(ValueError):
        run(runner, req("a", height=36))  # StableDiffusionPipeline wants multiples of 8


def test_sleep_and_wake_up(runner: DiffusionRunner) -> None:
    before = floats(run(runner, req("a", seed=11, output_type="np"))[0])
    assert runner.sleep() == {"released": True}
    assert runner.pipe is None
    assert runner.constraints().size_multiple == 8  # still answerable while asleep
    assert runner.wake_up() == {"reloaded": True}
    assert runner.wake_up() == {"reloaded": False}
    after = floats(run(runner, req("b", seed=11, output_type="np"))[0])
    assert np.array_equal(before, after)


def test_engine_dtype_is_applied_and_outputs_stay_float32(runner: DiffusionRunner) -> None:
    stage = msgspec.convert(
        {"stage_id": 1, "stage_type": "diffusion", "model": "builtin:tiny-sd", "engine_args": {"dtype": "bfloat16"}},
        StageConfig,
    )
    half = DiffusionRunner(stage)
    half.load()
    assert half.pipe.unet.dtype == half.pipe.text_encoder.dtype == torch.bfloat16
    latent, _ = run(
        half,
        req("a", seed=1, output_type="latent", height=32, width=32, num_inference_steps=1),
        req("b", seed=2, output_type="latent", height=32, width=32, num_inference_steps=1),
    )
    assert latent.tensors["latents"].dtype == np.float32 and latent.tensors["latents"].shape == (1, 4, 16, 16)


def test_the_step_limit_it_reports_is_one_the_pipeline_runs(runner: DiffusionRunner) -> None:
    """The most steps reported at READY runs through the pipeline's own call (1,000, one more, was
    an IndexError in DDIM mid-denoise); the engine refuses more before the queue."""
    limits = runner.constraints()
    assert (limits.min_inference_steps, limits.max_inference_steps) == (1, 999)
    steps = limits.max_inference_steps
    (out,) = run(runner, req("most", num_inference_steps=steps, height=16, width=16, guidance_scale=0.0))
    assert out.error is None and out.media[0].data.shape == (16, 16, 3)
