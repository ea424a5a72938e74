"""DiffusionRunner step by step, for every family it supports (video ones too): a request's result
equals its solo request-level one (same seed, within float tolerance) whenever it joined and whoever it ran with,
with different step counts and guidance scales in one batched call; abort at a step boundary,
preemption (a pause of any length) and a failing request that fails alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime.config import StageConfig, load_config
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.models.families import GOLDEN_PARAMS, GOLDEN_PROMPT, families, family
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from omni_runtime.stage.runners.diffusion_steps import StepState, step_family
from omni_runtime.stage.runners.prompt_cache import PromptEmbeddingCache
from tests.helpers import diffusion_params

pytestmark = pytest.mark.integration

CTX = ExecuteContext(lambda rid: False)
#: Every registered family with a step loop, by its tiny builtin.
FAMILIES = [f.tiny for f in families() if f.steps and f.tiny]


class RecordingRunner(DiffusionRunner):
    """Records the requests of each batched denoiser call; a prompt with ``poison`` makes the call
    raise, as a model bug triggered by one request's input would."""

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.calls: list[list[str]] = []

    def _step_denoise(self, states: list[StepState]) -> list[torch.Tensor]:
        self.calls.append([s.request_id for s in states])
        if any("poison" in s.prompt for s in states):
            raise RuntimeError("NaN in the denoiser for a poisoned prompt")
        return super()._step_denoise(states)


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache


@pytest.fixture(scope="module", params=FAMILIES)
def name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def runner(cache: Path, name: str) -> RecordingRunner:
    stage = msgspec.convert({"stage_id": 0, "stage_type": "diffusion", "model": f"builtin:{name}"}, StageConfig)
    r = RecordingRunner(stage)
    r.load()
    assert r.step_support() is None
    return r


def req(runner: RecordingRunner, rid: str, prompt: str, **params: Any) -> RunnerRequest:
    model = runner.stage.model.removeprefix("builtin:")
    defaults = dict(load_config(model).stage_args[0].default_sampling_params)
    typed = diffusion_params({**defaults, "output_type": "np", **params})
    return RunnerRequest(request_id=rid, prompt=prompt, params=typed)


class Driver:
    """Admits requests and runs steps the way the worker does, collecting final outputs."""

    def __init__(self, runner: RecordingRunner) -> None:
        self.runner = runner
        self.running: list[str] = []
        self.outputs: dict[str, RunnerOutput] = {}
        self.steps: dict[str, int] = {}

    def admit(self, *requests: RunnerRequest) -> None:
        failed = self.runner.step_admit(list(requests), CTX)
        assert not failed, failed
        self.running += [r.request_id for r in requests]

    def step(self, ids: list[str] | None = None) -> None:
        results = self.runner.step_run(list(self.running if ids is None else ids), CTX)
        for rid, result in results.items():
            self.steps[rid] = result.steps
            if result.output is not None:
                self.outputs[rid] = result.output
                self.running.remove(rid)

    def finish(self) -> None:
        while self.running:
            self.step()


def solo(runner: RecordingRunner, request: RunnerRequest) -> RunnerOutput:
    (out,) = runner.execute([request], CTX)
    assert out.error is None, out.error
    return out


def images(out: RunnerOutput) -> np.ndarray:
    """The output's images (a video family's videos, ``N x F x H x W x 3``)."""
    assert out.error is None, out.error
    return out.tensors["videos"] if "videos" in out.tensors else out.tensors["images"]


def assert_equal_to_solo(runner: RecordingRunner, out: RunnerOutput, request: RunnerRequest) -> None:
    # Batched kernels are not bitwise equal to batch-1 ones: equal within float tolerance.
    np.testing.assert_allclose(images(out), images(solo(runner, request)), rtol=0, atol=1e-3)
    assert out.metrics["seed"] == request.params.seed


# ---------------------------------------------------------------------------- per family


def test_joins_mid_way_with_mixed_step_counts_equal_solo_runs(runner: RecordingRunner) -> None:
    base = req(runner, "x", "x").params
    a = req(runner, "a", "a cup of coffee", seed=1, num_inference_steps=4)
    b = req(runner, "b", "a toy dinosaur", seed=2, num_inference_steps=3, guidance_scale=base.guidance_scale + 1)
    # A negative prompt among requests without one (SDXL encodes it, and zeroes theirs).
    c = req(runner, "c", "a fox yawning", seed=3, num_inference_steps=2, negative_prompt="blurry")
    assert len({runner.step_key(r) for r in (a, b, c)}) == 1  # steps, guidance, negatives: per sample
    runner.calls.clear()
    d = Driver(runner)
    d.admit(a)
    d.step()  # a: 1 of 4
    d.admit(b)  # joins a running batch
    d.step()  # a 2/4, b 1/3
    d.admit(c)
    d.finish()  # a 3,4; b 2,3; c 1,2: all three in one call, each at its own timestep
    assert runner.calls[:3] == [["a"], ["a", "b"], ["a", "b", "c"]]
    assert d.steps == {"a": 4, "b": 3, "c": 2}
    for request in (a, b, c):
        assert_equal_to_solo(runner, d.outputs[request.request_id], request)
    # The comparison means something: different seeds, different images.
    assert np.abs(images(d.outputs["a"]) - images(d.outputs["c"])).max() > 0.05


def test_abort_at_a_step_boundary_frees_the_request_and_the_others_continue(runner: RecordingRunner) -> None:
    a = req(runner, "a", "a cup of coffee", seed=5)
    b = req(runner, "b", "a toy dinosaur", seed=6)
    d = Driver(runner)
    d.admit(a, b)
    d.step()
    runner.step_drop(["b"])  # aborted: the worker drops it at the boundary
    d.running.remove("b")
    assert runner.step_run(["b"], CTX) == {}  # no state left
    d.finish()
    assert set(d.outputs) == {"a"}
    assert_equal_to_solo(runner, d.outputs["a"], a)


def test_a_paused_request_resumes_where_it_left_off(runner: RecordingRunner) -> None:
    # Preemption keeps the state; the request only misses steps while another runs.
    low = req(runner, "low", "a cup of coffee", seed=7)
    high = req(runner, "high", "a toy dinosaur", seed=8)
    d = Driver(runner)
    d.admit(low)
    d.step()
    d.step()
    d.admit(high)
    while "high" in d.running:
        d.step(["high"])
    d.finish()
    assert_equal_to_solo(runner, d.outputs["low"], low)
    assert_equal_to_solo(runner, d.outputs["high"], high)


def test_images_per_prompt_and_latent_outputs_per_request(runner: RecordingRunner) -> None:
    two = req(runner, "two", "a cup of coffee", seed=9, num_images_per_prompt=2)
    latent = req(runner, "lat", "a toy dinosaur", seed=10, output_type="latent")
    d = Driver(runner)
    d.admit(two, latent)
    d.finish()
    got = images(d.outputs["two"])
    assert got.shape[0] == 2
    np.testing.assert_allclose(got, images(solo(runner, two)), rtol=0, atol=1e-3)
    np.testing.assert_allclose(
        d.outputs["lat"].tensors["latents"], solo(runner, latent).tensors["latents"], rtol=0, atol=1e-3
    )


def test_a_prompt_seen_again_comes_from_the_prompt_cache_and_makes_the_uncached_image(
    runner: RecordingRunner,
) -> None:
    # The stage's cache as engine_args.prompt_cache makes it in step execution (64 MiB).
    runner.prompt_cache = PromptEmbeddingCache(64 * 2**20)
    try:
        first = req(runner, "first", "a lighthouse at dusk", seed=13, negative_prompt="fog")
        again = req(runner, "again", "a lighthouse at dusk", seed=14, negative_prompt="fog")
        twin = req(runner, "twin", "a red kite", seed=15)
        twin_too = req(runner, "twin-too", "a red kite", seed=16)
        d = Driver(runner)
        d.admit(first)
        d.finish()
        d.admit(again, twin, twin_too)  # a hit, and one prompt asked for twice in one admission
        d.finish()
        hits = {rid: out.metrics["prompt_cache_hit"] for rid, out in d.outputs.items()}
        assert hits == {"first": 0, "again": 1, "twin": 0, "twin-too": 1}
        stats = runner.stats()["prompt_cache"]
        assert (stats["hits"], stats["misses"], stats["entries"]) == (2, 2, 2)
        assert stats["bytes"] == d.outputs["twin-too"].metrics["prompt_cache_bytes"] > 0
        for request in (first, again, twin, twin_too):
            assert_equal_to_solo(runner, d.outputs[request.request_id], request)
        # Another guidance scale is another key (Flux's guidance is an encoder output).
        scale = first.params.guidance_scale
        other = req(runner, "other", "a lighthouse at dusk", seed=13, negative_prompt="fog", guidance_scale=scale + 1)
        d.admit(other)
        d.finish()
        assert d.outputs["other"].metrics["prompt_cache_hit"] == 0
        # A LoRA control call clears it, even one that fails (it may have changed an adapter).
        with pytest.raises(InvalidRequestError):
            runner.rpc_add_lora("late", "/nonexistent/adapter.safetensors")
        assert runner.stats()["prompt_cache"]["entries"] == 0
        assert runner.stats()["prompt_cache"]["invalidations"] == 1
    finally:
        runner.prompt_cache = None


@pytest.mark.parametrize("name", ["tiny-sd"], indirect=True)  # what a key weighs: one family shows it
def test_a_long_prompt_counts_toward_the_prompt_cache_bound(runner: RecordingRunner) -> None:
    """The key holds the prompt's text (up to 100,000 characters, kept with the entry): a bound
    with room for one such entry beside its embeddings holds one, not two (counted by their
    embeddings alone, a few KB, thousands of 100 KB prompts fitted under 64 MiB)."""
    d = Driver(runner)
    try:
        runner.prompt_cache = PromptEmbeddingCache(64 * 2**20)
        d.admit(req(runner, "short", "x", seed=0))
        d.finish()
        embeds = runner.stats()["prompt_cache"]["bytes"] - 1
        runner.prompt_cache = PromptEmbeddingCache(2 * embeds + 150_000)
        for i in range(2):
            d.admit(req(runner, f"long-{i}", f"{i} " + "x" * 99_998, seed=i))
            d.finish()
        stats = runner.stats()["prompt_cache"]
        assert stats["bytes"] == embeds + 100_000, stats
        assert (stats["entries"], stats["evictions"]) == (1, 1), stats
    finally:
        runner.prompt_cache = None


# ---------------------------------------------------------------------------- family-independent


@pytest.mark.parametrize("name", ["tiny-sd"], indirect=True)
def test_a_failing_request_fails_alone_and_the_batch_goes_on(runner: RecordingRunner) -> None:
    good = req(runner, "good", "a cup of coffee", seed=11)
    bad = req(runner, "bad", "poison", seed=12)
    d = Driver(runner)
    d.admit(good, bad)
    d.step()
    assert isinstance(d.outputs["bad"].error, RuntimeError)  # retried alone: only it fails
    d.finish()
    assert_equal_to_solo(runner, d.outputs["good"], good)


@pytest.mark.parametrize("name", ["tiny-sd"], indirect=True)
def test_step_key_is_size_and_guidance_mode_only(runner: RecordingRunner) -> None:
    key = runner.step_key(req(runner, "a", "a", seed=1))
    same = req(runner, "b", "b", seed=2, num_inference_steps=9, guidance_scale=3.0, negative_prompt="blur")
    assert runner.step_key(same) == key
    assert runner.step_key(req(runner, "c", "c", height=48)) != key
    assert runner.step_key(req(runner, "d", "d", guidance_scale=1.0)) != key  # no classifier-free guidance


@pytest.mark.parametrize("name", ["tiny-sd"], indirect=True)
def test_bad_params_fail_their_own_admission(runner: RecordingRunner) -> None:
    good = req(runner, "good", "a", seed=1)
    bad = req(runner, "bad", "b", seed=1)
    # The caller's checks let nothing like it by: set past them.
    msgspec.structs.force_setattr(bad.params, "num_images_per_prompt", "two")
    failed = runner.step_admit([good, bad], CTX)
    assert list(failed) == ["bad"] and failed["bad"].error is not None
    runner.step_drop(["good"])


def test_an_unknown_pipeline_falls_back_with_a_reason() -> None:
    family, reason = step_family(object(), "cpu")
    assert family is None and "object has no step loop" in reason and "StableDiffusionPipeline" in reason


def test_golden_slice(runner: RecordingRunner, name: str) -> None:
    """The family's tiny model with a fixed prompt and seed makes the spec's stored numbers (a
    silent change in a builder, a library upgrade or the call path fails here first). Recorded
    on CPU with one torch thread; a deliberate change re-records them (the failure prints them)."""
    spec = next(f for f in families() if f.tiny == name)
    out = solo(runner, req(runner, "golden", GOLDEN_PROMPT, **GOLDEN_PARAMS))
    first = images(out)[0]
    last = first[-1] if first.ndim == 4 else first  # a video's slice is of its last frame
    got = [round(float(v), 4) for v in last[-3:, -3:, -1].flatten()]
    assert spec.golden, f"{spec.name}: no golden slice stored; this run made {got}"
    np.testing.assert_allclose(got, spec.golden, rtol=0, atol=1e-3, err_msg=f"{spec.name} made {got}")
    assert family(spec.name) is spec
