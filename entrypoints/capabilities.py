"""What a served model can do, worked out once: from its resolved config when it is configured
(which of the task registry's tasks it serves, its output kinds and which stage serves each
task), then from what its stages reported in READY once its engine has loaded (limits, voices,
cache types, LoRA). The HTTP routes, the jobs, ``/v1/models`` and the CLI read this instead of
looking at stages themselves.

Pure data; no engine is called after the load."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from omni_runtime.messages import StageConstraints
from omni_runtime.params import SpeechSamplingParams, TranscriptionSamplingParams
from omni_runtime.resolve import ResolvedConfig

from .tasks.registry import JOB_TASKS, TASKS, TaskName

__all__ = ["ModelCapabilities", "UnsupportedTaskError"]


class UnsupportedTaskError(ValueError):
    """A task the model does not serve; the message names the model and what it serves."""

    def __init__(self, model: str, task: str, serves: tuple[str, ...]) -> None:
        shown = ", ".join(f"`{t}`" for t in serves) or "nothing"
        super().__init__(f"the model `{model}` cannot do `{task}`; it serves {shown}")
        self.model, self.task = model, task
        #: The short code of the refusal: ``no_`` and the capability the task needs (``no_image``,
        #: ``no_video``, ``no_audio``, ``no_speech``).
        known = TASKS.get(task)
        needs = known.capability if known else None
        self.code = f"no_{needs}" if needs else "unsupported_task"


class ModelCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    """A model's tasks, output kinds and limits (see the module docstring)."""

    #: The tasks it serves, in the registry's order (entrypoints/tasks/registry.py).
    tasks: tuple[TaskName, ...]
    #: What its final stages make (image, video, audio, text), sorted.
    kinds: tuple[str, ...]
    #: The final stage that serves each task (chat has none: every final stage answers).
    stages: dict[str, int]
    #: Whether some stage takes an input image (edits, variations, image to video, chat images).
    image_input: bool
    #: Whether its speech stage speaks its upstream's answer chunk by chunk (``input_chunking``).
    chunked_speech: bool = False
    #: The first stage that recognises speech (``transcribe``, its ``audio`` param), if any: a
    #: request may carry audio, so a realtime session's audio turns are answered.
    audio_input_stage: int | None = None
    #: Known once loaded (None or empty before): the most pixels of an input image, a video
    #: model's frame step and most frames, an audio model's longest clip (seconds).
    max_input_pixels: int | None = None
    frames_step: int | None = None
    max_frames: int | None = None
    max_audio_s: float | None = None
    #: Known once loaded: the most seconds of audio the speech-recognition stage hears in one
    #: request (its model's window).
    max_input_audio_s: float | None = None
    #: The voices its speech stage takes (empty: any, or no speech stage).
    voices: tuple[str, ...] = ()
    #: The step-cache types a request's ``cache`` may name.
    cache_types: tuple[str, ...] = ()
    #: Whether it takes LoRA adapters.
    lora: bool = False

    @classmethod
    def of(cls, resolved: ResolvedConfig) -> ModelCapabilities:
        """What the config says, before any stage has loaded."""
        finals = [s for s in resolved.stages if s.config.final_output]
        by_kind: dict[str, int] = {}
        for stage in finals:
            kind = stage.config.final_output_type
            if kind and kind not in by_kind:
                by_kind[kind] = stage.stage_id
        image_input = any(s.takes_image_params for s in resolved.stages)
        hears = next(
            (
                s.stage_id
                for s in resolved.stages
                if not s.config.engine_input_source and issubclass(s.params_cls, TranscriptionSamplingParams)
            ),
            None,
        )
        speech = next((s for s in finals if issubclass(s.params_cls, SpeechSamplingParams)), None)
        audio = by_kind.get("audio")
        # The final stage of each capability a task may need (registry.Capability).
        serving = {
            "image": by_kind.get("image"),
            "video": by_kind.get("video"),
            # A diffusion audio model (Stable Audio): clips, not speech.
            "audio": audio if audio is not None and resolved.stage(audio).takes_image_params else None,
            "speech": speech.stage_id if speech is not None else None,
        }
        stages: dict[str, int] = {}
        for task in TASKS.values():
            sid = serving[task.capability] if task.capability is not None else None
            if sid is not None and (image_input or not task.needs_image):
                stages[task.name] = sid
        tasks = tuple(t.name for t in TASKS.values() if t.name in stages or (t.capability is None and finals))
        return cls(
            tasks=tasks,
            kinds=tuple(sorted(by_kind)),
            stages=stages,
            image_input=image_input,
            chunked_speech=speech is not None and speech.config.input_chunking is not None,
            audio_input_stage=hears,
        )

    @property
    def audio_input(self) -> bool:
        """Whether a request may carry audio (some first stage recognises speech)."""
        return self.audio_input_stage is not None

    def loaded(self, constraints: Mapping[int, StageConstraints], max_input_pixels: int) -> ModelCapabilities:
        """These capabilities with what the loaded stages reported (their READY constraints)."""
        reported = list(constraints.values())
        steps = [c.frames_step for c in reported if c.frames_step is not None]
        frames = [c.max_frames for c in reported if c.max_frames is not None]
        audio = [c.max_audio_s for c in reported if c.max_audio_s is not None]
        heard = constraints.get(self.audio_input_stage) if self.audio_input_stage is not None else None
        return msgspec.structs.replace(
            self,
            max_input_pixels=max_input_pixels,
            frames_step=max(steps) if steps else None,
            max_frames=min(frames) if frames else None,
            max_audio_s=min(audio) if audio else None,
            max_input_audio_s=heard.max_input_audio_s if heard is not None else None,
            voices=tuple(sorted({v for c in reported for v in c.voices})),
            cache_types=tuple(sorted({t for c in reported for t in c.cache_types or ()})),
            lora=any(c.lora for c in reported),
        )

    def serves(self, task: str) -> bool:
        return task in self.tasks

    def stage(self, task: str) -> int | None:
        """The final stage that serves ``task``, or None."""
        return self.stages.get(task)

    def require(self, model: str, task: str) -> int | None:
        """The stage serving ``task`` (None for chat), or UnsupportedTaskError."""
        if task not in self.tasks:
            raise UnsupportedTaskError(model, task, self.tasks)
        return self.stages.get(task)

    def generate_tasks(self) -> list[str]:
        """The ``/v1/generate`` tasks it serves (``/v1/models`` lists them)."""
        return [t for t in self.tasks if t in JOB_TASKS]
