"""``engine_args.load_format: dummy``: a model directory without its weight files loads with random
weights built from its configs (seeded: two loads are equal), serves requests of the right size
through Omni, quantizes as a real load does, and is refused where it cannot apply."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime import Omni
from omni_runtime.config import StageConfig
from omni_runtime.exceptions import ConfigError
from omni_runtime.models.builtin import ensure_builtin
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.conftest import make_config

pytestmark = pytest.mark.integration

WEIGHT_FILES = ("*.safetensors", "*.bin")


def configs_only(name: str, into: Path) -> Path:
    """A copy of builtin ``name`` with every weight file left out."""
    target = into / name
    shutil.copytree(ensure_builtin(name), target, ignore=shutil.ignore_patterns(*WEIGHT_FILES))
    assert not [p for pattern in WEIGHT_FILES for p in target.rglob(pattern)]
    return target


@pytest.fixture(scope="module")
def models(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    into = tmp_path_factory.mktemp("configs")
    return {name: configs_only(name, into) for name in ("tiny-sdxl", "tiny-flux")}


def dummy_stage(model: Path, **engine_args: object) -> dict:
    return {
        "stage_id": 0,
        "stage_type": "diffusion",
        "model": str(model),
        "runtime": {"torch_threads": 1},
        "engine_args": {"load_format": "dummy", **engine_args},
        "final_output": True,
        "final_output_type": "image",
    }


def runner(model: Path, **engine_args: object) -> DiffusionRunner:
    stage = dummy_stage(model, **engine_args)
    stage.pop("runtime")
    r = DiffusionRunner(msgspec.convert(stage, StageConfig))
    r.load()
    return r


def test_a_directory_of_configs_serves_images_of_the_requested_size_through_omni(models) -> None:
    with Omni(make_config([dummy_stage(models["tiny-sdxl"])])) as omni:
        (out,) = omni.generate("a red fox", {"height": 48, "width": 64, "num_inference_steps": 2, "seed": 1})
    assert out.error is None
    (image,) = out.images
    assert image.size == (64, 48)
    assert np.asarray(image).std() > 0  # random weights draw noise, not a blank


def test_dummy_weights_are_seeded_in_the_stage_dtype() -> None:
    """Two loads build equal weights; bfloat16 is built as bfloat16 (never made in float32 first)."""
    path = Path(ensure_builtin("tiny-flux"))
    first, second = runner(path, dtype="bfloat16"), runner(path, dtype="bfloat16")
    a, b = first.pipe.transformer.state_dict(), second.pipe.transformer.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert {t.dtype for t in a.values()} == {torch.bfloat16}
    # Random, not the builtin's saved weights.
    saved = runner(path, dtype="bfloat16", load_format="auto").pipe.transformer.state_dict()
    assert not all(torch.equal(a[k], saved[k]) for k in a)


def test_quantization_applies_to_the_built_modules(models) -> None:
    plain = runner(models["tiny-flux"])
    int8 = runner(models["tiny-flux"], quantization={"quant_type": "int8wo"})
    weights = int8.stats()["weight_bytes_by_component"]["transformer"]
    assert weights < 0.5 * plain.stats()["weight_bytes_by_component"]["transformer"]


@pytest.mark.unit
def test_a_stage_that_loads_no_diffusers_directory_refuses_dummy() -> None:
    stage = {
        "stage_id": 0,
        "stage_type": "text",
        "model": "builtin:tiny-lm",
        "engine_args": {"load_format": "dummy"},
        "final_output": True,
        "final_output_type": "text",
    }
    with pytest.raises(ConfigError, match=r"stage_args\[0\].engine_args.load_format"):
        make_config([stage])
