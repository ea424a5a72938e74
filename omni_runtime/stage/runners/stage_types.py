"""The builtin stage types: the one registry of ``stage_type`` names.

Core types (``diffusion``, ``text``, ``speech``, ``echo``, and ``omni_thinker``, ``omni_talker``,
``omni_code2wav``) are listed here; a model family brings its own in
its spec (:attr:`omni_runtime.models.families.FamilySpec.stage_types`: the SD family's split
stages ``sd_text_encoder``, ``sd_denoise``, ``sd_vae_decode``), and :func:`stage_type` reads both.
Read by config validation (which names are known), by ``resolve`` (params class, whether a model is
needed) and by :func:`omni_runtime.stage.runners.base.runner_class` (the runner to import). It
imports no runner: a process that only routes must not load torch and diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from omni_runtime.params import (
    Code2WavSamplingParams,
    DiffusionSamplingParams,
    EchoSamplingParams,
    SpeechSamplingParams,
    TalkerSamplingParams,
    TextSamplingParams,
)


@dataclass(frozen=True)
class StageType:
    """What the caller's side knows of a builtin stage type without importing its runner (which
    would load torch and diffusers into a process that only routes)."""

    #: ``module:Class`` of the runner.
    path: str
    params_cls: type[msgspec.Struct]
    needs_model: bool
    max_batch_size: int | None = None
    #: Its runner streams partial outputs (text deltas, or tensors' new items along axis 0) that a
    #: chunked downstream stage (``input_chunking``) can take as they come.
    streams: bool = False


#: The former name of :class:`StageType`.
BuiltinRunner = StageType

#: The core stage types; the families' own come from their specs (:func:`stage_type`).
BUILTIN_RUNNERS: dict[str, StageType] = {
    "diffusion": StageType(
        "omni_runtime.stage.runners.diffusion:DiffusionRunner", DiffusionSamplingParams, needs_model=True
    ),
    "text": StageType("omni_runtime.stage.runners.text:TextRunner", TextSamplingParams, needs_model=True, streams=True),
    "speech": StageType("omni_runtime.stage.runners.speech:SpeechRunner", SpeechSamplingParams, needs_model=True),
    "echo": StageType("omni_runtime.stage.runners.echo:EchoRunner", EchoSamplingParams, needs_model=False),
    # A Qwen-Omni speech pipeline's three parts (omni_runtime/stage/runners/qwen_omni.py).
    "omni_thinker": StageType(
        "omni_runtime.stage.runners.qwen_omni:ThinkerRunner", TextSamplingParams, needs_model=True, streams=True
    ),
    "omni_talker": StageType(
        "omni_runtime.stage.runners.qwen_omni:TalkerRunner", TalkerSamplingParams, needs_model=True, streams=True
    ),
    "omni_code2wav": StageType(
        "omni_runtime.stage.runners.qwen_omni:Code2WavRunner", Code2WavSamplingParams, needs_model=True
    ),
}


def stage_types() -> dict[str, StageType]:
    """Every builtin stage type: the core ones, then those the registered families bring."""
    from omni_runtime.models.families import stage_types as family_stage_types

    return {**BUILTIN_RUNNERS, **family_stage_types()}


def stage_type(name: str) -> StageType | None:
    """The builtin stage type ``name``, or None (a ``module:Class``, or unknown)."""
    return BUILTIN_RUNNERS.get(name) or stage_types().get(name)
