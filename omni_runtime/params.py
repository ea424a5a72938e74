"""Typed sampling parameters, one class per stage type, and their resolution.

A plain ``dict`` of the same fields is accepted wherever a params object is. Unset fields
(``None``) take the stage's ``default_sampling_params`` from the deploy YAML, then the class's
``fallbacks`` (what its runner takes a field to be when neither says). Validation happens once, in
the caller's thread, before anything is enqueued (:func:`resolve_params`): errors are
:class:`~omni_runtime.exceptions.InvalidRequestError` naming the field. The resolved object is what
travels to the stage's runner, unchanged: every class is tagged (``params_class``, its name), so a
message carries it natively (its arrays as raw buffers, :mod:`omni_runtime.serialization`) and
:data:`StageParams` decodes any builtin one.

The checks against what a stage's model allows are in :mod:`omni_runtime.checks` (their names
are importable from here too).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from omni_runtime.acceleration import StepCache, parse_cache
from omni_runtime.audio_input import check_audio_input
from omni_runtime.bounds import LORA_NAME_PATTERN as LORA_NAME_PATTERN
from omni_runtime.bounds import MAX_LORA_SCALE as MAX_LORA_SCALE
from omni_runtime.bounds import MAX_PROMPT_CHARS as MAX_PROMPT_CHARS
from omni_runtime.bounds import meta
from omni_runtime.checks import AUDIO_PARAMS as AUDIO_PARAMS
from omni_runtime.checks import DEFAULT_MAX_CODES as DEFAULT_MAX_CODES
from omni_runtime.checks import DEFAULT_MAX_TOKENS as DEFAULT_MAX_TOKENS
from omni_runtime.checks import MAX_IMAGE_PIXELS as MAX_IMAGE_PIXELS
from omni_runtime.checks import MAX_IMAGE_SIDE as MAX_IMAGE_SIDE
from omni_runtime.checks import MIN_IMAGE_SIDE as MIN_IMAGE_SIDE
from omni_runtime.checks import bounded_defaults as bounded_defaults
from omni_runtime.checks import check_audio as check_audio
from omni_runtime.checks import check_cache as check_cache
from omni_runtime.checks import check_constraints as check_constraints
from omni_runtime.checks import check_frames as check_frames
from omni_runtime.checks import check_image_capability as check_image_capability
from omni_runtime.checks import check_image_params
from omni_runtime.checks import check_max_codes as check_max_codes
from omni_runtime.checks import check_max_tokens as check_max_tokens
from omni_runtime.checks import check_prompt_tokens as check_prompt_tokens
from omni_runtime.checks import check_speech_length as check_speech_length
from omni_runtime.checks import check_speed as check_speed
from omni_runtime.checks import check_step_range as check_step_range
from omni_runtime.checks import check_text_length as check_text_length
from omni_runtime.checks import check_video_pixels as check_video_pixels
from omni_runtime.checks import check_voice as check_voice
from omni_runtime.checks import link_constraints as link_constraints
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.serialization import check_encodable

Seed = Annotated[int, meta("seed")]
#: A per-request deadline in seconds (see :data:`~omni_runtime.bounds.REQUEST_BOUNDS`).
Timeout = Annotated[float, meta("timeout")]
#: A request's priority: higher is served first (see docs/configuration.md, "Priority").
Priority = Annotated[int, meta("priority")]
#: A request's latency target (ms) at each stage with ``batch_policy: learned`` or ``deadline``.
SloMs = Annotated[float, meta("slo_ms")]
#: ``max_pixels`` of a stage when neither its config nor its model says: 2048 x 2048.
FALLBACK_MAX_PIXELS = 2048 * 2048
#: The tag field of every params class: its class name, on the wire.
TAG_FIELD = "params_class"

_T = TypeVar("_T")
_P = TypeVar("_P", bound=msgspec.Struct)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field=TAG_FIELD, tag=True):
    """Base of the typed params, with what every stage type takes: ``timeout`` (seconds), a
    per-request deadline, and ``priority`` (higher first, default 0). Either may be set in any
    stage's params; it applies to the whole request. ``slo_ms`` is a latency target at the stage
    whose params carry it (with ``batch_policy: learned`` or ``deadline``: see docs/configuration.md)."""

    #: Which ``stage_type`` these params are for.
    stage_type: ClassVar[str] = ""
    #: What a field is when neither the request nor the stage's ``default_sampling_params`` set it:
    #: filled in by :func:`resolve_params`, so that the runner reads the value in force (never None
    #: for these). A field left out here whose value depends on the loaded model (a native size, a
    #: pipeline's own step count, the first speaker) stays None, and the runner reads its model's.
    fallbacks: ClassVar[Mapping[str, Any]] = {}
    timeout: Timeout | None = None
    priority: Priority | None = None
    slo_ms: SloMs | None = None


def check_lora_path(path: str, field: str = "lora.path") -> None:
    """A LoRA path must be an absolute local path: adapters are never fetched from a hub, and a
    relative path would depend on the stage process's working directory. InvalidRequestError
    (a ValueError) otherwise."""
    if "\x00" in path:
        raise InvalidRequestError(f"`{field}` contains a NUL character", param=field)
    if not os.path.isabs(path):
        raise InvalidRequestError(
            f"`{field}` must be an absolute path to a local adapter directory or file, got {path[:80]!r} "
            "(adapters are never downloaded: a hub id such as `user/repo` is not fetched)",
            param=field,
        )


class LoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The LoRA adapter a diffusion request runs with: exactly one of ``name`` (an adapter the
    operator registered, ``engine_args.loras`` or ``collective_rpc("add_lora")``) or ``path`` (a
    local directory or ``.safetensors`` file; Python API only, HTTP takes names), and its ``scale``.
    """

    name: Annotated[str, meta("lora.name")] | None = None
    path: Annotated[str, meta("lora.path")] | None = None
    #: How strongly the adapter applies: 0 = not at all, 1 = as trained, negative = away from it.
    scale: Annotated[float, meta("lora.scale")] = 1.0

    def __post_init__(self) -> None:
        if (self.name is None) == (self.path is None):
            raise InvalidRequestError(
                "give exactly one of `lora.name` (a registered adapter) or `lora.path` (a local directory)",
                param="lora",
            )
        if self.path is not None:
            check_lora_path(self.path)


class DiffusionSamplingParams(SamplingParams):
    """Parameters of a diffusion (text-to-image, text-to-video, text-to-audio) request."""

    stage_type: ClassVar[str] = "diffusion"
    fallbacks: ClassVar[Mapping[str, Any]] = {"output_type": "pil"}

    height: Annotated[int, meta("height")] | None = None
    width: Annotated[int, meta("width")] | None = None
    num_inference_steps: Annotated[int, meta("num_inference_steps")] | None = None
    guidance_scale: Annotated[float, meta("guidance_scale")] | None = None
    negative_prompt: Annotated[str, meta("negative_prompt")] | None = None
    num_images_per_prompt: Annotated[int, meta("num_images_per_prompt")] | None = None
    #: Seed of this request's own generator; a fresh one is drawn (and reported) when unset.
    seed: Seed | None = None
    #: ``pil`` images, ``np`` float arrays in [0, 1], or ``latent`` tensors.
    output_type: Literal["pil", "np", "latent"] | None = None
    #: An input image (img2img, edit, inpainting): a uint8 HxWx3 array, or a PIL image in the
    #: Python API (converted in the caller's thread; arrays travel as raw buffers, never PIL).
    #: The output has the image's size; see :func:`check_image_params`.
    image: Any = None
    #: Inpainting mask (needs ``image``): uint8 HxW, HxWx1 or HxWx3 of the image's size, or a PIL
    #: image; white (255) is repainted, black kept.
    mask_image: Any = None
    #: How far the input image is noised before denoising: 1 ignores it, near 0 keeps it; only
    #: with ``image``. Unset: the pipeline's own default.
    strength: Annotated[float, meta("strength")] | None = None
    #: A LoRA adapter to run with (a :class:`LoraRequest` or a dict of its fields); none when unset.
    lora: LoraRequest | None = None
    #: Frames of a video (a video model only; its rule, such as ``4k + 1``, is checked at enqueue).
    num_frames: Annotated[int, meta("num_frames")] | None = None
    #: Frames per second the video plays at (a video model only); unset: the family's default.
    fps: Annotated[int, meta("fps")] | None = None
    #: Where the clip ends, in seconds (an audio model only); unset: the model's longest clip.
    audio_end_in_s: Annotated[float, meta("audio_end_in_s")] | None = None
    #: Where the clip starts, in seconds (an audio model only); unset: 0.
    audio_start_in_s: Annotated[float, meta("audio_start_in_s")] | None = None
    #: Clips per prompt (an audio model only; the audio pipelines' name for ``num_images_per_prompt``).
    num_waveforms_per_prompt: Annotated[int, meta("num_waveforms_per_prompt")] | None = None
    #: Step caching for this request: ``{"type": "first_block", "threshold": 0.1}`` (the fields of
    #: ``engine_args.cache``), or ``"off"``; unset: the stage's ``engine_args.cache``.
    cache: StepCache | Literal["off"] | None = None

    @property
    def per_prompt(self) -> int:
        """Outputs per prompt: ``num_images_per_prompt``, or an audio request's
        ``num_waveforms_per_prompt`` (an audio stage refuses the former, so at most one is set);
        one when neither is."""
        return int(self.num_images_per_prompt or self.num_waveforms_per_prompt or 1)


class TextSamplingParams(SamplingParams):
    """Parameters of a text-generation request."""

    stage_type: ClassVar[str] = "text"
    fallbacks: ClassVar[Mapping[str, Any]] = {
        "max_tokens": DEFAULT_MAX_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "stop": [],
    }

    max_tokens: Annotated[int, meta("max_tokens")] | None = None
    temperature: Annotated[float, meta("temperature")] | None = None
    top_p: Annotated[float, meta("top_p")] | None = None
    top_k: Annotated[int, meta("top_k")] | None = None
    seed: Seed | None = None
    stop: list[str] | None = None


class SpeechSamplingParams(SamplingParams):
    """Parameters of a text-to-speech request (the ``speech`` stage)."""

    stage_type: ClassVar[str] = "speech"
    fallbacks: ClassVar[Mapping[str, Any]] = {"speed": 1.0}

    #: A speaker of the model by name, or one of OpenAI's voice names (mapped onto the model's
    #: speakers, see docs/models.md); unset: the model's first speaker.
    voice: Annotated[str, meta("voice")] | None = None
    #: How fast to speak: every duration is divided by it (2.0 is about half as long); unset: 1.0.
    speed: Annotated[float, meta("speed")] | None = None
    #: Seed of the request's noise; a fresh one is drawn (and reported) when unset.
    seed: Seed | None = None


class TranscriptionSamplingParams(SamplingParams):
    """Parameters of a speech-recognition request (the ``transcribe`` stage): the audio it hears.

    Without ``audio`` the stage hears nothing and its transcript is empty: a pipeline that starts
    with it answers text prompts as before (see :func:`omni_runtime.input_funcs.prompt_then_transcript`).
    """

    stage_type: ClassVar[str] = "transcribe"
    fallbacks: ClassVar[Mapping[str, Any]] = {"max_transcript_tokens": 32}

    #: Mono samples as a numpy array (float in [-1, 1], or int16), at ``sample_rate``: normalised
    #: to float32 and bounded in the caller's thread (:mod:`omni_runtime.audio_input`), then sent
    #: to the stage as a raw buffer.
    audio: Any = None
    #: Their rate in Hz (8000 to 48000); unset: 16000. The stage resamples to its model's rate.
    sample_rate: Annotated[int, meta("sample_rate")] | None = None
    #: Most tokens of transcript (the stage also stops at its model's end of text).
    max_transcript_tokens: Annotated[int, meta("max_transcript_tokens")] | None = None


class TalkerSamplingParams(SamplingParams):
    """Parameters of an omni talker (``omni_talker``): codec codes from the thinker's states."""

    stage_type: ClassVar[str] = "omni_talker"
    #: ``max_codes``: a request validated against a decoder's bound gets the default within it
    #: (:func:`~omni_runtime.checks.bounded_defaults`) as the stage's, over this one.
    fallbacks: ClassVar[Mapping[str, Any]] = {
        "max_codes": DEFAULT_MAX_CODES,
        "temperature": 0.9,
        "top_p": 1.0,
        "top_k": 40,
    }

    #: Most codes to generate (the talker also stops at its end-of-codec token).
    max_codes: Annotated[int, meta("max_codes")] | None = None
    temperature: Annotated[float, meta("temperature")] | None = None
    top_p: Annotated[float, meta("top_p")] | None = None
    top_k: Annotated[int, meta("top_k")] | None = None
    seed: Seed | None = None


class Code2WavSamplingParams(SpeechSamplingParams):
    """Parameters of an omni audio decoder (``omni_code2wav``): codes to a waveform, in a voice,
    at a speaking rate, from a seeded noise (the same fields as a speech stage's)."""

    stage_type: ClassVar[str] = "omni_code2wav"


class EchoSamplingParams(SamplingParams):
    """Parameters of the ``echo`` stage: it returns its input after ``delay_ms``."""

    stage_type: ClassVar[str] = "echo"
    fallbacks: ClassVar[Mapping[str, Any]] = {"delay_ms": 0.0}

    delay_ms: Annotated[float, meta("delay_ms")] | None = None


class GenericSamplingParams(msgspec.Struct, kw_only=True, tag_field=TAG_FIELD, tag=True):
    """Params of a custom runner that declares no class of its own: any JSON-like fields. Those it
    does not declare travel in ``extra`` (by name; a field named ``extra`` too); :meth:`get` reads
    either."""

    stage_type: ClassVar[str] = "custom"
    fallbacks: ClassVar[Mapping[str, Any]] = {}
    timeout: Timeout | None = None
    priority: Priority | None = None
    slo_ms: SloMs | None = None
    #: The fields this class does not declare, as given (those that are set).
    extra: dict[str, Any] = {}

    def get(self, name: str, default: Any = None) -> Any:
        """A field by name, declared or extra; ``default`` when it is unset."""
        value = getattr(self, name) if name in self.__struct_fields__ and name != "extra" else self.extra.get(name)
        return default if value is None else value


#: Every builtin params class, as the tagged union a message decodes them with (a custom runner's
#: own class is tagged by its name too, and its stage decodes it as that class).
StageParams = (
    DiffusionSamplingParams
    | TextSamplingParams
    | SpeechSamplingParams
    | TranscriptionSamplingParams
    | TalkerSamplingParams
    | Code2WavSamplingParams
    | EchoSamplingParams
    | GenericSamplingParams
)


def in_force(value: _T | None) -> _T:
    """A field of resolved params that has a fallback (``fallbacks``), typed as set: never None once
    :func:`resolve_params` made the params. ValueError for params that did not come from it."""
    if value is None:
        raise ValueError("a params field with a fallback is unset: these params were not made by resolve_params")
    return value


_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`")


def _field_of(err: msgspec.ValidationError) -> tuple[str, str | None]:
    """Split msgspec's ``"Expected ... - at `$.field`"`` into (message, field)."""
    text = str(err)
    m = _PATH_RE.search(text)
    if m:
        return text[: m.start()], m.group(1) or None
    m = re.search(r"unknown field `([^`]*)`", text)
    return text, m.group(1) if m else None


def params_to_dict(params: Any) -> dict[str, Any]:
    """Fields of a params object or dict that are set (not ``None``). Of a params object, as plain
    values: ``lora`` the dict of its set fields, ``cache`` its mapping with ``type`` (or ``"off"``),
    and a generic class's ``extra`` fields beside the declared ones. The dict view of resolved
    params (what a caller reads of a validated request: ``ValidRequest.params``)."""
    if params is None:
        return {}
    if isinstance(params, msgspec.Struct):
        out: dict[str, Any] = {}
        for name in params.__struct_fields__:
            value = getattr(params, name)
            if value is None:
                continue
            if name == "extra" and not params.__struct_config__.forbid_unknown_fields and isinstance(value, dict):
                out = {**{k: v for k, v in value.items() if v is not None}, **out}
            elif isinstance(value, LoraRequest):
                out[name] = {f: x for f, x in msgspec.structs.asdict(value).items() if x is not None}
            elif name == "cache":
                out[name] = msgspec.to_builtins(value)
            else:
                out[name] = value
        return out
    if isinstance(params, dict):
        return {k: v for k, v in params.items() if v is not None}
    raise InvalidRequestError(
        f"sampling params must be a params object or a dict, got {type(params).__name__}",
        param="sampling_params",
    )


def resolve_params(params_cls: type[_P], defaults: Mapping[str, Any], params: Any, *, fill: bool = True) -> _P:
    """``params`` over the stage ``defaults`` over the class's ``fallbacks`` (with ``fill``; without,
    as a stage's own defaults are checked), validated: the ``params_cls`` object the stage's runner
    gets as it is. A params class that does not forbid unknown fields (the generic params of a
    custom runner) keeps them in its ``extra`` mapping: that runner reads them.

    Raises InvalidRequestError naming the field (unknown key, wrong type, out of range, or a value
    no message can carry: a lone surrogate, an integer past 64 bits; the one encodability check
    of a request's params).
    """
    if isinstance(params, msgspec.Struct) and not isinstance(params, params_cls):
        raise InvalidRequestError(
            f"{type(params).__name__} given to a stage that takes {params_cls.__name__}",
            param="sampling_params",
        )
    given = params_to_dict(params)
    fallbacks: Mapping[str, Any] = getattr(params_cls, "fallbacks", {}) if fill else {}
    merged = {**fallbacks, **defaults, **given}
    images = check_image_params(merged, given) if issubclass(params_cls, DiffusionSamplingParams) else {}
    merged.update(images)
    if issubclass(params_cls, TranscriptionSamplingParams):
        merged.update(check_audio_input(merged, given))
    declared = params_cls.__struct_fields__
    if merged.get("cache") is not None and "cache" in declared:
        merged["cache"] = _cache_param(merged["cache"])
    generic = not params_cls.__struct_config__.forbid_unknown_fields
    # A generic class's undeclared fields (and one named ``extra``) go to its ``extra`` mapping.
    extra = {k: v for k, v in merged.items() if k not in declared or k == "extra"} if generic else {}
    typed: _P | None = None
    try:
        typed = msgspec.convert({k: v for k, v in merged.items() if k not in extra}, params_cls, strict=False)
    except msgspec.ValidationError as e:
        message, field = _field_of(e)
        name = f"`{field}`: " if field else ""
        raise InvalidRequestError(f"invalid sampling param {name}{message}", param=field) from None
    except UnicodeEncodeError:
        pass  # msgspec failed to quote a key in its error (a lone surrogate): the check names it
    # Everything the stage will be sent (defaults, the request's own fields, a custom runner's
    # extra ones) can travel; the error names the path of what cannot.
    check_encodable(merged, "")
    assert typed is not None  # only an unencodable key fails the conversion without a ValidationError
    if extra:
        if "extra" not in declared:
            unknown = next(iter(extra))
            raise InvalidRequestError(f"invalid sampling param `{unknown}`: unknown field", param=unknown)
        typed = msgspec.structs.replace(typed, extra=extra)
    return typed


def _cache_param(value: Any) -> Any:
    """``cache`` checked strictly in whatever form it came (a mapping, or a struct that its
    constructor did not check), while the other params convert laxly; InvalidRequestError naming
    the field."""
    try:
        return parse_cache(value)
    except msgspec.ValidationError as e:
        message, field = _field_of(e)
        path = f"cache.{field}" if field else "cache"
        raise InvalidRequestError(f"invalid sampling param `{path}`: {message}", param=path) from None
