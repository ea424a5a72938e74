"""What a builtin stage type is (:class:`StageType`), and the core ones.

Below both the stage-type registry (:mod:`omni_runtime.stage.runners.stage_types`, which adds the
types the model families bring) and the family specs (:mod:`omni_runtime.models.families`, whose
stage types are :class:`StageType` too and must not take a core name). Imports no runner: a
process that only routes must not load torch and diffusers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from omni_runtime.external import configure_program, configure_worker
from omni_runtime.params import (
    Code2WavSamplingParams,
    DiffusionSamplingParams,
    EchoSamplingParams,
    GenericSamplingParams,
    SpeechSamplingParams,
    TalkerSamplingParams,
    TextSamplingParams,
    TranscriptionSamplingParams,
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
    #: Checks a stage's ``runner_args`` (a ConfigError whose path is under ``runner_args``) and
    #: returns the params class its requests take; None: ``params_cls``, whatever its runner_args.
    configure: Callable[[Mapping[str, Any]], type[msgspec.Struct]] | None = None

    def params_for(self, runner_args: Mapping[str, Any]) -> type[msgspec.Struct]:
        """The params class of a stage of this type with these ``runner_args`` (checked)."""
        return self.params_cls if self.configure is None else self.configure(runner_args)


#: The core stage types; the families' own come from their specs.
BUILTIN_RUNNERS: dict[str, StageType] = {
    "diffusion": StageType(
        "omni_runtime.stage.runners.diffusion:DiffusionRunner", DiffusionSamplingParams, needs_model=True
    ),
    "text": StageType("omni_runtime.stage.runners.text:TextRunner", TextSamplingParams, needs_model=True, streams=True),
    "speech": StageType("omni_runtime.stage.runners.speech:SpeechRunner", SpeechSamplingParams, needs_model=True),
    # Speech recognition (audio in, its transcript out): a transformers Whisper checkpoint.
    "transcribe": StageType(
        "omni_runtime.stage.runners.transcribe:TranscribeRunner", TranscriptionSamplingParams, needs_model=True
    ),
    "echo": StageType("omni_runtime.stage.runners.echo:EchoRunner", EchoSamplingParams, needs_model=False),
    # An external program run per request (omni_runtime/external.py: its runner_args).
    "subprocess": StageType(
        "omni_runtime.stage.runners.program:ProgramRunner",
        GenericSamplingParams,
        needs_model=False,
        configure=configure_program,
    ),
    # An external program started once per replica, answering JSON lines.
    "worker": StageType(
        "omni_runtime.stage.runners.resident:ResidentRunner",
        GenericSamplingParams,
        needs_model=False,
        configure=configure_worker,
    ),
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
