"""The builtin stage types: the one registry of ``stage_type`` names.

Core types (``diffusion``, ``text``, ``speech``, ``transcribe``, ``echo``, ``subprocess``,
``worker``, and ``omni_thinker``, ``omni_talker``, ``omni_code2wav``) are listed in
:mod:`~omni_runtime.stage.runners.core_stage_types` (with :class:`StageType`, below this module
and the families); a model family brings its own in
its spec (:attr:`omni_runtime.models.families.FamilySpec.stage_types`: the SD family's split
stages ``sd_text_encoder``, ``sd_denoise``, ``sd_vae_decode``), and :func:`stage_type` reads both.
Read by config validation (which names are known), by ``resolve`` (params class, whether a model is
needed) and by :func:`omni_runtime.stage.runners.base.runner_class` (the runner to import). It
imports no runner: a process that only routes must not load torch and diffusers.
"""

from __future__ import annotations

from omni_runtime.models.families import stage_types as family_stage_types
from omni_runtime.stage.runners.core_stage_types import BUILTIN_RUNNERS, StageType

__all__ = ["BUILTIN_RUNNERS", "BuiltinRunner", "StageType", "stage_type", "stage_types"]

#: The former name of :class:`StageType`.
BuiltinRunner = StageType


def stage_types() -> dict[str, StageType]:
    """Every builtin stage type: the core ones, then those the registered families bring."""
    return {**BUILTIN_RUNNERS, **family_stage_types()}


def stage_type(name: str) -> StageType | None:
    """The builtin stage type ``name``, or None (a ``module:Class``, or unknown)."""
    return BUILTIN_RUNNERS.get(name) or stage_types().get(name)
