"""The model-running options of engine_args (channels-last, attention slicing, VAE tiling,
torch.compile, regional and warmed up at load) on real tiny pipelines: applied where the pipeline
has a use for them, and the image stays the plain pipeline's within float tolerance."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import ConfigError
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from omni_runtime.stage.runners.sizes import denoiser as _denoiser
from tests.helpers import diffusion_params

NOT_ABORTED = ExecuteContext(lambda rid: False)
PARAMS = {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 5.0, "seed": 4, "output_type": "np"}
OPTIONS = {
    "channels_last": True,
    "attention_slicing": 1,
    "vae_tiling": True,
    # The eager backend runs the graph torch captures as it is: the wiring is tested without
    # the minutes of CPU code generation inductor would take.
    "torch_compile": {"backend": "eager"},
}


@pytest.fixture(scope="module", autouse=True)
def _cache(model_cache: object) -> None:
    """A private model cache and one torch thread (tests/conftest.py)."""


def loaded(model: str, defaults: dict | None = None, **engine_args: Any) -> DiffusionRunner:
    data = {"stage_id": 0, "stage_type": "diffusion", "model": model, "engine_args": engine_args}
    if defaults:
        data["default_sampling_params"] = defaults
    runner = DiffusionRunner(msgspec.convert(data, StageConfig))
    runner.load()
    return runner


def image(runner: DiffusionRunner) -> np.ndarray:
    (out,) = runner.execute([RunnerRequest("r", "a lighthouse", diffusion_params(PARAMS))], NOT_ABORTED)
    assert out.error is None
    return out.tensors["images"]


@pytest.mark.parametrize("model", ["builtin:tiny-sd", "builtin:tiny-sd3"])
def test_options_apply_and_leave_the_image_unchanged(model: str) -> None:
    plain = image(loaded(model))
    tuned = loaded(model, **OPTIONS)
    denoiser = _denoiser(tuned.pipe)
    assert denoiser._compiled_call_impl is not None  # compiled in place: still the pipeline's module
    assert tuned.pipe.vae.use_tiling
    if model == "builtin:tiny-sd":  # convolutions: the UNet's weights are NHWC now
        weight = next(p for p in denoiser.parameters() if p.dim() == 4)
        assert weight.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_allclose(image(tuned), plain, rtol=0, atol=1e-4)


def test_regional_compile_is_paid_at_load() -> None:
    plain = image(loaded("builtin:tiny-sd"))
    defaults = {k: v for k, v in PARAMS.items() if k not in ("seed", "output_type")}
    compiled = loaded("builtin:tiny-sd", defaults, torch_compile={"backend": "eager", "regional": True, "warmup": True})
    unet = compiled.pipe.unet
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)  # each block, not the UNet
    assert unet._compiled_call_impl is None
    assert compiled.stats()["compile_warmup_s"] > 0
    # The warm-up's shapes: served by what it compiled (another size may recompile).
    np.testing.assert_allclose(image(compiled), plain, rtol=0, atol=1e-4)


def test_regional_compile_refused_without_repeated_blocks() -> None:
    with pytest.raises(ConfigError, match=r"engine_args\.torch_compile\.regional.*SD3Transformer2DModel"):
        loaded("builtin:tiny-sd3", torch_compile={"backend": "eager", "regional": True})


def test_step_execution_stays_supported_with_a_compiled_denoiser() -> None:
    runner = loaded("builtin:tiny-sd", torch_compile=True, step_execution=True)  # inductor: compiles lazily
    assert runner.step_support() is None
    assert _denoiser(runner.pipe)._compiled_call_impl is not None


@pytest.mark.parametrize(
    "engine_args",
    [
        {"torch_compile": "yes"},
        {"torch_compile": {"backend": "eager", "warp_speed": True}},
        {"attention_slicing": 0},
        {"attention_slicing": "most"},
        {"channels_last": "sometimes"},
    ],
)
def test_bad_options_are_config_errors_naming_the_field(engine_args: dict) -> None:
    from omni_runtime.config import parse_config

    field = next(iter(engine_args))
    stage = {"stage_id": 0, "stage_type": "diffusion", "model": "builtin:tiny-sd", "engine_args": engine_args}
    with pytest.raises(ConfigError, match=f"engine_args.{field}"):
        parse_config({"stage_args": [stage]}, source="t.yaml")
