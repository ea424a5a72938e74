"""Step caching per request in step execution (first block, MagCache), on tiny-flux in-process: a cached request's
image is the same alone as when it joins a running batch of uncached and differently cached
requests, it runs fewer blocks than uncached, and abort and preemption keep or free its state."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import ConfigError, InvalidRequestError
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from omni_runtime.stage.runners.row_cache import RowCacheState
from tests.helpers import diffusion_params

pytestmark = pytest.mark.integration

CTX = ExecuteContext(lambda rid: False)
DEFAULTS = {"height": 64, "width": 64, "num_inference_steps": 8, "guidance_scale": 3.5, "output_type": "np"}
#: Surely skips on random weights (their first-block residuals change by far more than 0.05).
SKIPPING = {"type": "first_block", "threshold": 1.0}
OTHER = {"type": "first_block", "threshold": 0.3}
#: Uncalibrated (ratios of 1): skips up to max_skip_steps in a row after the retained steps.
MAG = {"type": "mag", "max_skip_steps": 2}
#: A request alone vs in a batch: batched kernels are not bitwise batch-1 ones, and the skip
#: decisions are the request's own, so only float noise is left (seen: ~1e-6).
BATCH_TOLERANCE = 1e-3
#: Cached vs uncached image of tiny-flux's random weights (a bound on drift, not a quality claim).
CACHE_TOLERANCE = 0.05


def load(model: str, **engine_args: Any) -> DiffusionRunner:
    stage = msgspec.convert(
        {
            "stage_id": 0,
            "stage_type": "diffusion",
            "model": model,
            "engine_args": {"step_execution": True, **engine_args},
        },
        StageConfig,
    )
    r = DiffusionRunner(stage)
    r.load()
    return r


@pytest.fixture(scope="module", autouse=True)
def _cache(model_cache: object) -> None:
    """A private model cache and one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def flux() -> DiffusionRunner:
    r = load("builtin:tiny-flux")
    assert r.step_support() is None
    return r


def req(rid: str, seed: int, **params: Any) -> RunnerRequest:
    typed = diffusion_params({**DEFAULTS, "seed": seed, **params})
    return RunnerRequest(request_id=rid, prompt=f"a red fox {seed}", params=typed)


class Driver:
    """Admits requests and runs steps as the worker does; keeps each request's cache state."""

    def __init__(self, runner: DiffusionRunner) -> None:
        self.runner = runner
        self.running: list[str] = []
        self.outputs: dict[str, RunnerOutput] = {}
        self.states: dict[str, RowCacheState | None] = {}

    def admit(self, *requests: RunnerRequest) -> None:
        assert not self.runner.step_admit(list(requests), CTX)
        for r in requests:
            self.states[r.request_id] = self.runner._states[r.request_id].cache
            self.running.append(r.request_id)

    def step(self, ids: list[str] | None = None) -> None:
        for rid, result in self.runner.step_run(list(self.running if ids is None else ids), CTX).items():
            if result.output is not None:
                assert result.output.error is None, result.output.error
                self.outputs[rid] = result.output
                self.running.remove(rid)

    def finish(self) -> None:
        while self.running:
            self.step()


def alone(runner: DiffusionRunner, request: RunnerRequest) -> tuple[np.ndarray, RowCacheState | None, int, int]:
    """A request run step by step alone: its image, cache state, blocks called and run."""
    assert runner.cache is not None
    before = (runner.cache.blocks_called, runner.cache.blocks_run)
    d = Driver(runner)
    d.admit(request)
    d.finish()
    called, run = runner.cache.blocks_called - before[0], runner.cache.blocks_run - before[1]
    out = d.outputs[request.request_id]
    if d.states[request.request_id] is not None:  # its own count, for /metrics: alone, the stage's
        assert (out.metrics["request_cache_blocks_called"], out.metrics["request_cache_blocks_run"]) == (called, run)
    return out.tensors["images"], d.states[request.request_id], called, run


def test_a_cached_request_is_the_same_alone_and_in_a_mixed_batch(flux: DiffusionRunner) -> None:
    cached = req("c", 3, cache=SKIPPING)
    solo, solo_state, called, run = alone(flux, cached)
    assert solo_state is not None and solo_state.steps_skipped > 0
    assert called == 8 * 3 and run < called  # 3 blocks x 8 steps; skipped ones not run
    plain, _, _, _ = alone(flux, req("c", 3, cache="off"))
    assert 0 < float(np.abs(solo - plain).max()) < CACHE_TOLERANCE
    # The same rule as diffusers' first-block cache: a request-level wave with its hooks agrees.
    (wave,) = flux.execute([cached], CTX)
    np.testing.assert_allclose(wave.tensors["images"], solo, rtol=0, atol=BATCH_TOLERANCE)
    # Joins a running batch of an uncached request and a differently cached one, two steps in.
    d = Driver(flux)
    d.admit(req("u", 1, cache="off"), req("o", 2, cache=OTHER, num_inference_steps=12), req("m", 4, cache=MAG))
    d.step()
    d.step()
    d.admit(cached)
    d.finish()
    state = d.states["c"]
    assert state is not None and state is not solo_state
    assert (state.steps_run, state.steps_skipped) == (solo_state.steps_run, solo_state.steps_skipped)
    np.testing.assert_allclose(d.outputs["c"].tensors["images"], solo, rtol=0, atol=BATCH_TOLERANCE)
    # The uncached batch-mate is the plain image of its own seed, untouched by the others' skips.
    plain_u, _, _, _ = alone(flux, req("u", 1, cache="off"))
    np.testing.assert_allclose(d.outputs["u"].tensors["images"], plain_u, rtol=0, atol=BATCH_TOLERANCE)
    assert d.states["u"] is None
    assert flux.stats()["cache"]["hit_rate"] > 0


def test_mag_cache_per_request_skips_whole_steps_as_diffusers_does(flux: DiffusionRunner) -> None:
    cached = req("m", 4, cache=MAG)
    solo, state, called, run = alone(flux, cached)
    assert state is not None and state.steps_skipped > 0
    assert run < called == 8 * 3  # a skipped step runs no block, the first one neither
    (wave,) = flux.execute([cached], CTX)  # diffusers' own MagCache hooks, request-level
    np.testing.assert_allclose(wave.tensors["images"], solo, rtol=0, atol=BATCH_TOLERANCE)
    d = Driver(flux)
    d.admit(req("c", 3, cache=SKIPPING), req("u", 1, cache="off"))
    d.step()
    d.admit(cached)
    d.finish()
    np.testing.assert_allclose(d.outputs["m"].tensors["images"], solo, rtol=0, atol=BATCH_TOLERANCE)


def test_preemption_keeps_the_state_and_abort_frees_it(flux: DiffusionRunner) -> None:
    low, high = req("low", 5, cache=SKIPPING), req("high", 6, cache=OTHER)
    solo, _, _, _ = alone(flux, low)
    d = Driver(flux)
    d.admit(low)
    d.step()
    d.step()
    d.admit(high)
    while "high" in d.running:  # low is paused while high runs
        d.step(["high"])
    d.finish()
    np.testing.assert_allclose(d.outputs["low"].tensors["images"], solo, rtol=0, atol=BATCH_TOLERANCE)
    # Aborted at a step boundary: the state goes with the request.
    d = Driver(flux)
    d.admit(req("gone", 7, cache=SKIPPING))
    d.step()
    state = d.states.pop("gone")
    assert state is not None and state.head_residual is not None
    ref = weakref.ref(state)
    del state
    flux.step_drop(["gone"])
    gc.collect()
    assert ref() is None


def test_video_rows_under_guidance_decide_per_request() -> None:
    """tiny-wan under classifier-free guidance: a request's unconditional and conditional rows sit
    apart in the batch and decide together."""
    wan = load("builtin:tiny-wan")
    video = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 6, "guidance_scale": 5.0}
    cached = req("c", 3, cache=SKIPPING, **video)
    d = Driver(wan)
    d.admit(cached)
    d.finish()
    solo, solo_state = d.outputs["c"].tensors["videos"], d.states["c"]
    assert solo_state is not None and solo_state.steps_skipped > 0
    d = Driver(wan)
    d.admit(req("u", 1, cache="off", **video))
    d.step()
    d.admit(cached)
    d.finish()
    state = d.states["c"]
    assert state is not None and state.steps_skipped == solo_state.steps_skipped
    np.testing.assert_allclose(d.outputs["c"].tensors["videos"], solo, rtol=0, atol=BATCH_TOLERANCE)


def test_a_denoiser_call_that_fails_half_way_leaves_the_states_as_they_were(flux: DiffusionRunner) -> None:
    """The step loop retries a failed batched call request by request; the retry must start from
    the states before the failed call, not from a first block's half-taken step."""
    cached, mag = req("c", 3, cache=SKIPPING), req("m", 4, cache=MAG)
    solo_c, state_c, _, _ = alone(flux, cached)
    solo_m, state_m, _, _ = alone(flux, mag)
    assert state_c is not None and state_m is not None
    fail = {"now": False}

    def fails_in_a_batch(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if fail["now"] and kwargs["hidden_states"].shape[0] > 1:  # a model bug batch sizes trigger
            fail["now"] = False
            raise RuntimeError("NaN in the last block")

    last = flux.pipe.transformer.single_transformer_blocks[-1]
    handle = last.register_forward_pre_hook(fails_in_a_batch, with_kwargs=True)
    try:
        d = Driver(flux)
        d.admit(cached, mag)
        for _ in range(4):
            d.step()
        fail["now"] = True
        d.finish()
    finally:
        handle.remove()
    assert not fail["now"]  # it did fail once
    for rid, solo, before in (("c", solo_c, state_c), ("m", solo_m, state_m)):
        after = d.states[rid]
        assert after is not None and (after.steps_run, after.steps_skipped) == (before.steps_run, before.steps_skipped)
        np.testing.assert_allclose(d.outputs[rid].tensors["images"], solo, rtol=0, atol=BATCH_TOLERANCE)


def test_step_caches_other_than_first_block_and_mag_fail_their_own_admission(flux: DiffusionRunner) -> None:
    failed = flux.step_admit([req("t", 1, cache={"type": "taylorseer"}), req("ok", 2, cache=SKIPPING)], CTX)
    assert set(failed) == {"t"}
    error = failed["t"].error
    assert isinstance(error, InvalidRequestError) and "first_block" in str(error)
    flux.step_drop(["ok"])


def test_a_family_without_cache_hooks_refuses_a_step_cache() -> None:
    with pytest.raises(ConfigError, match=r"sd family's UNet2DConditionModel") as e:
        load("builtin:tiny-sd", cache={"type": "first_block"})
    assert e.value.path == "engine_args.cache.type"
