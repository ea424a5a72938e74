"""The bounds of every request field, declared once.

The engine's params classes (:mod:`omni_runtime.params`, msgspec) build their field types with
:meth:`Bounds.meta`, and the HTTP request models (``entrypoints/openai/protocol/``, pydantic)
their ``Field(...)`` constraints with :meth:`Bounds.pydantic`, so a request over HTTP and one from
Python are held to the same limits. ``tests/omni_runtime/test_bounds.py`` walks both families of
models and fails when a field declares a bound of its own. The fields that a deploy YAML and a
control call both set (``engine_args.max_num_seqs``...) are :data:`FIELD_BOUNDS`.

This module imports neither msgspec's params nor pydantic's models: both import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from omni_runtime.exceptions import InvalidRequestError

#: Longest prompt accepted, in characters (a negative prompt too).
MAX_PROMPT_CHARS = 100_000
#: What a LoRA adapter's registered name may look like (``engine_args.loras``, ``add_lora``).
#: ``\Z``, not ``$``: Python's ``$`` also matches before a final newline, so ``"ink\n"`` would pass.
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z"
#: Largest magnitude of a LoRA scale: past a few units an adapter only produces noise.
MAX_LORA_SCALE = 10.0
#: Longest adapter path accepted, in characters (Linux's PATH_MAX).
MAX_LORA_PATH_CHARS = 4096
#: Smallest and largest side of an image, in pixels (requested sizes and input images).
MIN_SIDE, MAX_SIDE = 8, 4096
#: Most frames of a video any request may ask for (a model's own limit applies on top).
MAX_FRAMES = 4097
#: Longest clip any request may ask for, in seconds (a model's own limit applies on top).
MAX_AUDIO_SECONDS = 3600.0

#: Longest text a speech request may speak, in characters (OpenAI's limit for ``input``).
MAX_SPEECH_CHARS = 4096
#: Most tokens any text request may ask for (a stage's ``engine_args.max_output_tokens`` and its
#: model's context apply on top).
MAX_TOKENS = 8192

#: The keyword names of a bound, as both msgspec.Meta and pydantic's Field take them.
BOUND_NAMES = ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern")


@dataclass(frozen=True, slots=True)
class Bounds:
    """The range (numbers) or length and pattern (strings) of one field, and, for the fields a
    control call sets at run time, its type (see :meth:`check`)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    type: type[int] | type[float] | None = None
    doc: str = ""

    def limits(self) -> dict[str, Any]:
        """The bounds that are set, by keyword name (``{"ge": 1, "le": 1000}``)."""
        return {name: value for name in BOUND_NAMES if (value := getattr(self, name)) is not None}

    def meta(self) -> msgspec.Meta:
        """The bounds as a msgspec constraint: ``Annotated[int, bounds.meta()]``."""
        # One call for every combination of bounds, which msgspec's overloads spell one by one.
        return msgspec.Meta(**self.limits(), **({"description": self.doc} if self.doc else {}))  # type: ignore[call-overload]

    def pydantic(self) -> dict[str, Any]:
        """The bounds as keyword arguments of pydantic's ``Field(...)``."""
        return self.limits()

    @property
    def annotated(self) -> Any:
        """The field's type with its bounds, for a msgspec Struct (what ``EngineArgs`` declares)."""
        if self.type is None:
            raise TypeError("these bounds declare no type")
        return Annotated[self.type, self.meta()]

    def check(self, value: Any, param: str) -> int | float:
        """``value`` as the field's type, or InvalidRequestError naming ``param`` and the bound.
        Strict: no bool for a number, no float for an int; NaN is out of every range."""
        try:
            return msgspec.convert(value, self.annotated, strict=True)
        except msgspec.ValidationError as e:
            message = str(e)
            if "got" not in message:  # a range error: say what was given (NaN fails every bound)
                message += f", got {'nan' if isinstance(value, float) and math.isnan(value) else repr(value)}"
            raise InvalidRequestError(f"`{param}`: {message}", param=param) from None


#: Every request field with a bound, by its name in the params classes (and in the HTTP models,
#: which spell them the same; ``max_completion_tokens`` is ``max_tokens``, ``lora.*`` the adapter's).
REQUEST_BOUNDS: dict[str, Bounds] = {
    # Every stage type.
    #: A per-request deadline in seconds; at most a week (a larger one is a mistake, not a deadline).
    "timeout": Bounds(gt=0, le=7 * 86_400),
    #: Higher is served first (see docs/configuration.md, "Priority").
    "priority": Bounds(ge=-1_000_000, le=1_000_000),
    "seed": Bounds(ge=0, le=2**63 - 1),
    #: A per-request latency target (ms) for learned batching; at most an hour, as ``engine_args.slo_ms``.
    "slo_ms": Bounds(gt=0, le=3_600_000),
    # Diffusion.
    "height": Bounds(ge=MIN_SIDE, le=MAX_SIDE),
    "width": Bounds(ge=MIN_SIDE, le=MAX_SIDE),
    "num_inference_steps": Bounds(ge=1, le=1000),
    "guidance_scale": Bounds(ge=0, le=100),
    "num_images_per_prompt": Bounds(ge=1, le=16),
    "negative_prompt": Bounds(max_length=MAX_PROMPT_CHARS),
    "strength": Bounds(gt=0, le=1),
    #: Frames of a video (a model's own rule, such as 4k + 1, and maximum are checked at enqueue).
    "num_frames": Bounds(ge=1, le=MAX_FRAMES),
    #: Frames per second of a video: what it plays at, not what the model makes.
    "fps": Bounds(ge=1, le=240),
    #: Where a clip ends and starts, in seconds (the model's window is checked at enqueue).
    "audio_end_in_s": Bounds(gt=0, le=MAX_AUDIO_SECONDS),
    "audio_start_in_s": Bounds(ge=0, lt=MAX_AUDIO_SECONDS),
    "num_waveforms_per_prompt": Bounds(ge=1, le=16),
    "lora.name": Bounds(pattern=LORA_NAME_PATTERN),
    "lora.scale": Bounds(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE),
    "lora.path": Bounds(min_length=1, max_length=MAX_LORA_PATH_CHARS),
    # Step caching (``cache`` and ``engine_args.cache``; omni_runtime/acceleration.py).
    "cache.threshold": Bounds(ge=0, le=10),
    "cache.cache_interval": Bounds(ge=1, le=100),
    "cache.disable_cache_before_step": Bounds(ge=0, le=1000),
    "cache.disable_cache_after_step": Bounds(ge=0, le=1000),
    "cache.max_order": Bounds(ge=0, le=4),
    "cache.max_skip_steps": Bounds(ge=1, le=1000),
    "cache.retention_ratio": Bounds(ge=0, le=1),
    "cache.spatial_attention_block_skip_range": Bounds(ge=2, le=100),
    # Text.
    "max_tokens": Bounds(ge=1, le=MAX_TOKENS),
    #: OpenAI's range; past 2 sampling is noise.
    "temperature": Bounds(ge=0, le=2),
    "top_p": Bounds(gt=0, le=1),
    "top_k": Bounds(ge=0),
    # Speech.
    #: A speaker's name (the model's own, or one of OpenAI's voice names).
    "voice": Bounds(min_length=1, max_length=64),
    #: OpenAI's range; the speech stage divides every duration by it.
    "speed": Bounds(ge=0.25, le=4.0),
    # Speech recognition (the ``transcribe`` stage's audio input; omni_runtime/audio_input.py).
    #: The rate of a request's input samples (the stage resamples them to its model's rate).
    "sample_rate": Bounds(ge=8000, le=48000),
    #: Most tokens of transcript one request makes.
    "max_transcript_tokens": Bounds(ge=1, le=448),
    # Omni talker (codec codes).
    "max_codes": Bounds(ge=1, le=4096),
    # Echo.
    "delay_ms": Bounds(ge=0, le=600_000),
}

#: Bounds of the fields that both a deploy YAML (``engine_args``) and a control call may set; one
#: declaration for both paths. A field that gains a run-time setter is declared here, and
#: :data:`omni_runtime.config.CONTROL_CALL_FIELDS` names it.
FIELD_BOUNDS: dict[str, Bounds] = {
    "max_num_seqs": Bounds(type=int, ge=1, le=1024, doc="Most requests fused into one forward()."),
    "request_batch_max_wait_ms": Bounds(
        type=float, ge=0, le=60_000, doc="Extra admission wait (ms) before a new wave; 0 dispatches at once."
    ),
    "batch_quiet_window_ms": Bounds(
        type=float, ge=0, le=60_000, doc="Quiet time (ms) after the latest arrival that ends an admission hold."
    ),
}


def meta(field: str) -> msgspec.Meta:
    """The msgspec constraint of request field ``field`` (a key of :data:`REQUEST_BOUNDS`)."""
    return REQUEST_BOUNDS[field].meta()


def pydantic(field: str) -> dict[str, Any]:
    """The pydantic ``Field`` keywords of request field ``field`` (a key of :data:`REQUEST_BOUNDS`)."""
    return REQUEST_BOUNDS[field].pydantic()
