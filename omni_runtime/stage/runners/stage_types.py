"""The builtin stage types: the one registry of ``stage_type`` names.

Read by config validation (which names are known), by ``resolve`` (params class, whether a model is
needed) and by :func:`omni_runtime.stage.runners.base.runner_class` (the runner to import). It
imports no runner: a process that only routes must not load torch and diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from omni_runtime.params import DiffusionSamplingParams, EchoSamplingParams, TextSamplingParams


@dataclass(frozen=True)
class BuiltinRunner:
    """What the caller's side knows of a builtin stage type without importing its runner (which
    would load torch and diffusers into a process that only routes)."""

    #: ``module:Class`` of the runner.
    path: str
    params_cls: type[msgspec.Struct]
    needs_model: bool
    max_batch_size: int | None = None


BUILTIN_RUNNERS: dict[str, BuiltinRunner] = {
    "diffusion": BuiltinRunner(
        "omni_runtime.stage.runners.diffusion:DiffusionRunner", DiffusionSamplingParams, needs_model=True
    ),
    "text": BuiltinRunner("omni_runtime.stage.runners.text:TextRunner", TextSamplingParams, needs_model=True),
    "echo": BuiltinRunner("omni_runtime.stage.runners.echo:EchoRunner", EchoSamplingParams, needs_model=False),
}
