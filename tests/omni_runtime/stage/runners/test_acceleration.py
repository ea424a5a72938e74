"""Acceleration options on real tiny models in-process: step caching engages (fewer denoiser blocks
run) within a stated tolerance, per request and switched between waves; int8 quantization and
layerwise casting shrink the stored weights within a tolerance; refusals at load."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import ConfigError, InvalidRequestError
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.helpers import diffusion_params

pytestmark = pytest.mark.integration

NOT_ABORTED = ExecuteContext(lambda rid: False)
DEFAULTS = {"height": 64, "width": 64, "num_inference_steps": 12, "guidance_scale": 3.5, "output_type": "np"}
#: Largest per-pixel difference (images in [0, 1]) allowed between an accelerated and the plain
#: image of tiny-flux's random weights; what was seen: caching <= 0.013, int8 weights ~0.003,
#: float8 storage ~0.012 (random weights: a bound on drift, not a statement about quality).
TOLERANCE = 0.05
#: A cache that surely skips on random weights: first-block residuals change by far more than the
#: default 0.05 between steps of an untrained model.
SKIPPING = {"type": "first_block", "threshold": 1.0}


def load(model: str, defaults: dict | None = None, **engine_args: Any) -> DiffusionRunner:
    stage = msgspec.convert(
        {
            "stage_id": 0,
            "stage_type": "diffusion",
            "model": model,
            "engine_args": engine_args,
            "default_sampling_params": defaults or {},
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
    return load("builtin:tiny-flux")


@pytest.fixture(scope="module")
def plain(flux: DiffusionRunner) -> np.ndarray:
    return image(flux, cache="off")


def image(runner: DiffusionRunner, **params: Any) -> np.ndarray:
    out = run(runner, **params)
    assert out.error is None, out.error
    return out.tensors["images"]


def run(runner: DiffusionRunner, **params: Any) -> RunnerOutput:
    typed = diffusion_params({**DEFAULTS, "seed": 7, **params})
    request = RunnerRequest(request_id="r", prompt="a red fox", params=typed)
    runner.batch_key(request)  # what the worker does first: a bad `cache` fails here
    (out,) = runner.execute([request], NOT_ABORTED)
    return out


def test_cache_per_request_skips_blocks_within_tolerance(flux: DiffusionRunner, plain: np.ndarray) -> None:
    assert flux.cache is not None
    before = flux.cache.stats()
    cached = run(flux, cache=SKIPPING)
    off = run(flux, cache="off")  # counted too, once a wave has cached
    assert off.metrics["cache_blocks_run"] == off.metrics["cache_blocks_called"] == 12 * 3  # 3 blocks x 12 steps
    assert cached.metrics["cache_blocks_called"] == 36
    assert cached.metrics["cache_blocks_run"] < 36  # the hook answered some blocks from its cache
    deviation = float(np.abs(cached.tensors["images"] - plain).max())
    assert 0 < deviation < TOLERANCE
    after = flux.cache.stats()
    assert after["blocks_skipped"] - before["blocks_skipped"] == 36 - cached.metrics["cache_blocks_run"]
    assert flux.stats()["cache"]["hit_rate"] > 0
    # Switched off again for the next wave: the hooks are gone, the output is the plain one.
    np.testing.assert_array_equal(image(flux, cache="off"), plain)


@pytest.mark.parametrize(
    "cache",
    [{"type": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}, {"type": "mag"}, {"type": "pab"}],
)
def test_each_cache_type_engages(flux: DiffusionRunner, plain: np.ndarray, cache: dict[str, Any]) -> None:
    out = run(flux, cache=cache)
    assert out.metrics["cache_blocks_run"] < out.metrics["cache_blocks_called"]
    assert float(np.abs(out.tensors["images"] - plain).max()) < TOLERANCE
    # The same setting twice: each wave starts from a reset cache, so the image repeats exactly.
    np.testing.assert_array_equal(image(flux, cache=cache), out.tensors["images"])


def test_cache_key_and_refusals(flux: DiffusionRunner) -> None:
    key = flux.batch_key
    plain = RunnerRequest("a", "p", diffusion_params(DEFAULTS))
    off = RunnerRequest("b", "p", diffusion_params({**DEFAULTS, "cache": "off"}))
    fbc = RunnerRequest("c", "p", diffusion_params({**DEFAULTS, "cache": SKIPPING}))
    fbc2 = RunnerRequest("d", "p", diffusion_params({**DEFAULTS, "cache": {"threshold": 1.0, "type": "first_block"}}))
    assert len({key(plain), key(off), key(fbc)}) == 3
    assert key(fbc) == key(fbc2)
    with pytest.raises(InvalidRequestError, match="FasterCache"):
        key(RunnerRequest("e", "p", diffusion_params({**DEFAULTS, "cache": {"type": "faster"}})))


def test_weight_bytes_reported(flux: DiffusionRunner) -> None:
    stats = flux.stats()
    by = stats["weight_bytes_by_component"]
    assert stats["weight_bytes"] == sum(by.values()) > 0
    assert by["transformer"] == sum(p.numel() * 4 for p in flux.pipe.transformer.parameters())


def test_int8_weights_and_layerwise_casting(flux: DiffusionRunner, plain: np.ndarray) -> None:
    pytest.importorskip("torchao", reason="quantization needs the accel extra (make installs it)")
    full = flux.stats()["weight_bytes_by_component"]["transformer"]
    quantized = load("builtin:tiny-flux", quantization={"quant_type": "int8wo", "components": ["transformer"]})
    q_bytes = quantized.stats()["weight_bytes_by_component"]["transformer"]
    # Linear weights at 1 byte instead of 4, with a float32 scale per row; norms and biases stay float32.
    assert q_bytes <= full / 2
    assert float(np.abs(image(quantized, cache="off") - plain).max()) < TOLERANCE
    del quantized
    cast = load(
        "builtin:tiny-flux",
        layerwise_casting={"storage_dtype": "float8_e4m3fn", "compute_dtype": "float32"},
    )
    # diffusers keeps embeddings, norms (their modulation layers too) and the output projection in
    # the compute dtype; attention and feed-forward layers are stored in float8.
    named = cast.pipe.transformer.named_modules()
    linears = [m for name, m in named if isinstance(m, torch.nn.Linear) and (".attn." in name or ".ff." in name)]
    assert linears and {m.weight.dtype for m in linears} == {torch.float8_e4m3fn}
    assert cast.stats()["weight_bytes_by_component"]["transformer"] <= full / 2
    assert float(np.abs(image(cast, cache="off") - plain).max()) < TOLERANCE


def test_cache_refused_for_unet_family() -> None:
    with pytest.raises(ConfigError, match=r"engine_args\.cache\.type.*sd family's UNet2DConditionModel"):
        load("builtin:tiny-sd", cache={"type": "first_block"})


def test_quantizing_a_component_the_pipeline_lacks_is_refused() -> None:
    pytest.importorskip("torchao", reason="quantization needs the accel extra (make installs it)")
    with pytest.raises(ConfigError, match=r"FluxPipeline has no model component 'unet'; it has .*transformer") as e:
        load("builtin:tiny-flux", quantization={"quant_type": "int8wo", "components": ["unet"]})
    assert e.value.path == "engine_args.quantization.components[0]"
