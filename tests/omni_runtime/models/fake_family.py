"""A model family registered from outside the package: a pipeline class of its own (a subclass
of diffusers' SD pipeline defined here, so diffusers cannot find it by name), a builtin model, and
spec facts that differ from what the runner would derive, so a test sees that they are read: a
fixed call argument the runner pins, a size floor of 16 (the tiny SD's own step is 8) and the
legacy ``callback`` / ``callback_steps`` style (abort checks and progress). A config names this
module in ``runner_args.families``.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import StableDiffusionPipeline

from omni_runtime.models.families import FamilySpec, register

MODULE = __name__


class FakeFamilyPipeline(StableDiffusionPipeline):
    """SD's call under another class name."""


def build_fake_family(path: Path) -> None:
    from omni_runtime.models.families.sd.tiny import build_tiny_sd

    build_tiny_sd(path)
    index = json.loads((path / "model_index.json").read_text())
    index["_class_name"] = FakeFamilyPipeline.__name__
    (path / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


SPEC = register(
    FamilySpec(
        name="fake-family",
        pipelines=(FakeFamilyPipeline.__name__,),
        denoiser="UNet2DConditionModel",
        builders={"fake-family": f"{MODULE}:build_fake_family"},
        pipeline_class=f"{MODULE}:FakeFamilyPipeline",
        # Observable from outside: every request runs without guidance, whatever it asks for.
        fixed_kwargs={"guidance_scale": 1.0},
        size_floor=16,
        callback="legacy",
    )
)
