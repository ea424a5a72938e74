"""tiny-sd split into text encoder -> denoiser -> VAE decoder stages (``tiny-sd-split.yaml``), each
in its own process: the images equal the one-stage pipeline's, and each stage batches on its own."""

from __future__ import annotations

import asyncio
import os

import msgspec
import numpy as np
import pytest

from omni_runtime import AsyncOmni
from omni_runtime.config import DeployConfig, load_config
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.params import DiffusionSamplingParams

#: Requests compared between the two pipelines: guidance with and without a negative prompt,
#: no guidance, and two images from one prompt.
CASES: list[tuple[str, DiffusionSamplingParams]] = [
    ("a cup of coffee", DiffusionSamplingParams(seed=11)),
    ("a toy dinosaur", DiffusionSamplingParams(seed=12, negative_prompt="blurry, dark")),
    ("a fox yawning", DiffusionSamplingParams(seed=13, guidance_scale=1.0)),
    ("the moon over a lake", DiffusionSamplingParams(seed=14, num_images_per_prompt=2)),
]


def for_tests(name: str) -> DeployConfig:
    """A bundled config with one torch thread per stage (the test machine has two cores and runs
    both engines) and a long admission wait, so concurrent requests reliably meet in one wave."""
    config = load_config(name)
    stages = [
        msgspec.structs.replace(
            s,
            runtime=msgspec.structs.replace(s.runtime, torch_threads=1),
            engine_args=msgspec.structs.replace(s.engine_args, request_batch_max_wait_ms=200),
        )
        for s in config.stage_args
    ]
    return msgspec.structs.replace(config, stage_args=stages)


async def run(engine: AsyncOmni, prompt: str, params=None):
    out = None
    async for item in engine.generate(prompt, params):
        out = item
    return out


async def run_cases(engine: AsyncOmni, output_type: str) -> list:
    return await asyncio.gather(
        *(run(engine, prompt, msgspec.structs.replace(p, output_type=output_type)) for prompt, p in CASES)
    )


async def stage_stats(engine: AsyncOmni, stage_id: int) -> dict:
    [res] = await engine.collective_rpc("get_stats", stage_ids=[stage_id], timeout=10)
    return res.result


def histogram_delta(before: dict, after: dict) -> dict[str, int]:
    old, new = before["batch_size_histogram"], after["batch_size_histogram"]
    return {k: v - old.get(k, 0) for k, v in new.items() if v - old.get(k, 0)}


@pytest.fixture(scope="module")
async def split():
    engine = AsyncOmni(for_tests("tiny-sd-split"))
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


@pytest.fixture(scope="module")
async def reference():
    """CASES through the one-stage tiny-sd, as float arrays, uint8 images and latents; the engine
    is closed again before the split tests go on."""
    engine = AsyncOmni(for_tests("tiny-sd"))
    try:
        yield {kind: await run_cases(engine, kind) for kind in ("np", "pil", "latent")}
    finally:
        await asyncio.get_running_loop().run_in_executor(None, engine.close)


async def test_three_stages_run_in_three_processes(split):
    pings = await split.collective_rpc("ping", timeout=10)
    pids = {r.stage_id: r.result["pid"] for r in pings}
    assert sorted(pids) == [0, 1, 2]
    assert len(set(pids.values())) == 3 and os.getpid() not in pids.values()


async def test_split_images_equal_the_one_stage_pipeline(split, reference):
    floats = await run_cases(split, "np")
    for got, want, (_, params) in zip(floats, reference["np"], CASES, strict=True):
        assert (
            got.tensors["images"].shape
            == want.tensors["images"].shape
            == (params.num_images_per_prompt or 1, 64, 64, 3)
        )
        np.testing.assert_allclose(got.tensors["images"], want.tensors["images"], atol=1e-4, rtol=0)
        assert got.metrics["seed"] == params.seed  # the denoiser's seed, reported by the final stage
    images = await run_cases(split, "pil")
    for got, want in zip(images, reference["pil"], strict=True):
        assert len(got.images) == len(want.images)
        for a, b in zip(got.images, want.images, strict=True):
            assert np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max() <= 1


async def test_latent_output_skips_the_decoding(split, reference):
    outs = await run_cases(split, "latent")
    for got, want in zip(outs, reference["latent"], strict=True):
        assert not got.images and got.tensors["latents"].shape == want.tensors["latents"].shape
        # Latents are of order 10: batched CPU kernels differ from batch-1 ones by ~1e-4 there.
        np.testing.assert_allclose(got.tensors["latents"], want.tensors["latents"], atol=1e-3, rtol=0)


async def test_params_per_stage_as_a_list(split, reference):
    # The seed and size go to the denoiser, the output type to the decoder; the encoder's defaults
    # include guidance, so it makes the negative embeddings the denoiser needs.
    out = await run(split, CASES[0][0], [None, {"seed": CASES[0][1].seed, "height": 64}, {"output_type": "np"}])
    np.testing.assert_allclose(out.tensors["images"], reference["np"][0].tensors["images"], atol=1e-4, rtol=0)


async def test_a_drawn_seed_is_reported_and_reproduces_the_image(split):
    first = await run(split, "a red fox")
    seed = first.metrics["seed"]
    again = await run(split, "a red fox", DiffusionSamplingParams(seed=seed))
    assert np.abs(np.asarray(first.images[0], np.int16) - np.asarray(again.images[0], np.int16)).max() <= 1


async def test_each_stage_batches_on_its_own_key(split):
    # A hold ends once nothing has arrived for the quiet window (5 ms by default): a loaded machine
    # that delayed one hand-off between stages longer than that split a wave in two. Fixed at the
    # whole wait, a hold lasts until the wave is full or the wait is over.
    applied = await split.collective_rpc("set_batching", kwargs={"batch_quiet_window_ms": 200.0}, timeout=10)
    assert [r.result["batch_quiet_window_ms"] for r in applied] == [200.0] * 3
    before = [await stage_stats(split, sid) for sid in range(3)]
    sizes = [64, 32, 64, 32]
    outs = await asyncio.gather(
        *(run(split, f"prompt {i}", DiffusionSamplingParams(seed=i, height=h)) for i, h in enumerate(sizes))
    )
    after = [await stage_stats(split, sid) for sid in range(3)]
    assert [o.images[0].size for o in outs] == [(64, h) for h in sizes]
    # The encoder fuses all four prompts; the denoiser runs one wave per size, and so does the
    # decoder (its key is the latent shape).
    assert histogram_delta(before[0], after[0]) == {"4": 1}
    assert histogram_delta(before[1], after[1]) == {"2": 2}
    assert histogram_delta(before[2], after[2]) == {"2": 2}
    assert {o.metrics["batch_size"] for o in outs} == {2}


async def test_guidance_without_negative_embeddings_fails_that_request(split):
    # Guidance off at the encoder but on at the denoiser: there is nothing to guide against.
    with pytest.raises(InvalidRequestError, match="negative_prompt_embeds") as info:
        await run(split, "a cat", [{"guidance_scale": 1.0}, {"guidance_scale": 7.5}, None])
    assert info.value.stage_id == 1
    assert (await run(split, "a cat", DiffusionSamplingParams(seed=1))).images  # the engine serves on


async def test_sleep_releases_every_stage_and_wake_up_reloads_it(split):
    slept = await split.collective_rpc("sleep", timeout=30)
    assert [r.result["released"] for r in slept] == [True] * 3
    woke = await split.collective_rpc("wake_up", timeout=60)
    assert [r.result["reloaded"] for r in woke] == [True] * 3
    assert (await run(split, "after a nap", DiffusionSamplingParams(seed=3))).images
