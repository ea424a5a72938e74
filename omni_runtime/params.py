"""Typed sampling parameters, one class per stage type.

A plain ``dict`` of the same fields is accepted wherever a params object is. Unset fields
(``None``) take the stage's ``default_sampling_params`` from the deploy YAML. Validation happens
once, in the caller's thread, before anything is enqueued: errors are
:class:`~omni_runtime.exceptions.InvalidRequestError` naming the field.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

from omni_runtime.acceleration import StepCache, cache_type, parse_cache
from omni_runtime.bounds import LORA_NAME_PATTERN as LORA_NAME_PATTERN
from omni_runtime.bounds import MAX_LORA_SCALE as MAX_LORA_SCALE
from omni_runtime.bounds import MAX_PROMPT_CHARS as MAX_PROMPT_CHARS
from omni_runtime.bounds import MAX_SIDE, MIN_SIDE, meta
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints
from omni_runtime.serialization import check_encodable

Seed = Annotated[int, meta("seed")]
#: A per-request deadline in seconds (see :data:`~omni_runtime.bounds.REQUEST_BOUNDS`).
Timeout = Annotated[float, meta("timeout")]
#: A request's priority: higher is served first (see docs/configuration.md, "Priority").
Priority = Annotated[int, meta("priority")]
#: A request's latency target (ms) at each stage with ``batch_policy: learned``.
SloMs = Annotated[float, meta("slo_ms")]
#: ``max_pixels`` of a stage when neither its config nor its model says: 2048 x 2048.
FALLBACK_MAX_PIXELS = 2048 * 2048


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the typed params, with what every stage type takes: ``timeout`` (seconds), a
    per-request deadline, and ``priority`` (higher first, default 0). Either may be set in any
    stage's params; it applies to the whole request. ``slo_ms`` is a latency target at the stage
    whose params carry it (with ``batch_policy: learned``: see docs/configuration.md)."""

    #: Which ``stage_type`` these params are for.
    stage_type: ClassVar[str] = ""
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


class TextSamplingParams(SamplingParams):
    """Parameters of a text-generation request."""

    stage_type: ClassVar[str] = "text"

    max_tokens: Annotated[int, meta("max_tokens")] | None = None
    temperature: Annotated[float, meta("temperature")] | None = None
    top_p: Annotated[float, meta("top_p")] | None = None
    top_k: Annotated[int, meta("top_k")] | None = None
    seed: Seed | None = None
    stop: list[str] | None = None


class SpeechSamplingParams(SamplingParams):
    """Parameters of a text-to-speech request (the ``speech`` stage)."""

    stage_type: ClassVar[str] = "speech"

    #: A speaker of the model by name, or one of OpenAI's voice names (mapped onto the model's
    #: speakers, see docs/models.md); unset: the model's first speaker.
    voice: Annotated[str, meta("voice")] | None = None
    #: How fast to speak: every duration is divided by it (2.0 is about half as long); unset: 1.0.
    speed: Annotated[float, meta("speed")] | None = None
    #: Seed of the request's noise; a fresh one is drawn (and reported) when unset.
    seed: Seed | None = None


class TalkerSamplingParams(SamplingParams):
    """Parameters of an omni talker (``omni_talker``): codec codes from the thinker's states."""

    stage_type: ClassVar[str] = "omni_talker"

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

    delay_ms: Annotated[float, meta("delay_ms")] | None = None


class GenericSamplingParams(msgspec.Struct, kw_only=True):
    """Params of a custom runner that declares no class of its own: any JSON-like fields."""

    stage_type: ClassVar[str] = "custom"
    timeout: Timeout | None = None
    priority: Priority | None = None
    slo_ms: SloMs | None = None


#: Largest input image accepted anywhere (a stage's own ``max_pixels`` applies on top).
MAX_IMAGE_PIXELS = 4096 * 4096
#: Smallest and largest side of an input image, as of ``height`` / ``width``.
MIN_IMAGE_SIDE, MAX_IMAGE_SIDE = MIN_SIDE, MAX_SIDE


def _is_pil(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "convert")


def _as_uint8(value: Any, name: str, what: str) -> np.ndarray:
    """``value`` (a numpy array or a PIL image) as a uint8 numpy array, not yet copied: a view of
    the caller's array, so that no check before the copy reads a pixel. A PIL image's size is
    checked before it is converted (which copies)."""
    if _is_pil(value):
        _check_sides(name, *value.size)
        value = np.asarray(value.convert("L" if name == "mask_image" else "RGB"))
    if not isinstance(value, np.ndarray):
        raise InvalidRequestError(
            f"invalid sampling param `{name}`: expected {what} (a numpy array) or a PIL image, "
            f"got {type(value).__name__}",
            param=name,
        )
    if value.dtype != np.uint8:
        raise InvalidRequestError(
            f"invalid sampling param `{name}`: expected a uint8 array ({what}), got dtype {value.dtype}", param=name
        )
    return value


def _check_sides(name: str, w: int, h: int) -> None:
    if not (MIN_IMAGE_SIDE <= h <= MAX_IMAGE_SIDE and MIN_IMAGE_SIDE <= w <= MAX_IMAGE_SIDE):
        raise InvalidRequestError(
            f"invalid sampling param `{name}`: each side must be {MIN_IMAGE_SIDE}..{MAX_IMAGE_SIDE} pixels, "
            f"got {w}x{h}",
            param=name,
        )
    if h * w > MAX_IMAGE_PIXELS:
        raise InvalidRequestError(
            f"invalid sampling param `{name}`: {w}x{h} exceeds {MAX_IMAGE_PIXELS} pixels", param=name
        )


def check_image_params(merged: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """Validate and normalise the image inputs of a diffusion request (caller's thread).

    ``merged`` is the request's params over the stage defaults, ``given`` the request's own.
    Returns what replaces them in ``merged``: ``image`` as a uint8 HxWx3 array, ``mask_image`` as
    uint8 HxW, and ``height`` / ``width`` set to the image's size (the output has the size of its
    input, so a default size never conflicts; an explicit different size is an error). Raises
    InvalidRequestError naming the param.
    """
    image, mask = merged.get("image"), merged.get("mask_image")
    if image is None:
        for name in ("mask_image", "strength"):
            if given.get(name) is not None:
                raise InvalidRequestError(f"invalid sampling param `{name}`: it needs an input `image`", param=name)
        return {}
    image = _as_uint8(image, "image", "uint8 HxWx3")
    if image.ndim != 3 or image.shape[2] != 3:
        raise InvalidRequestError(
            f"invalid sampling param `image`: expected shape (height, width, 3) (RGB), got {image.shape}",
            param="image",
        )
    h, w = image.shape[:2]
    _check_sides("image", w, h)
    for name, side in (("height", h), ("width", w)):
        asked = given.get(name)
        if asked is not None and asked != side:
            raise InvalidRequestError(
                f"invalid sampling param `{name}`: {asked}, but the input image is {w}x{h} (WxH); the output has "
                "the input's size: resize the image, or leave height and width out",
                param=name,
            )
    # Every size is checked before the copy: a huge view (np.broadcast_to costs no memory) is
    # refused without reading it. A copy, as the caller may reuse its array while the request waits.
    out: dict[str, Any] = {"image": np.array(image, dtype=np.uint8, order="C", copy=True), "height": h, "width": w}
    if mask is not None:
        mask = _as_uint8(mask, "mask_image", "uint8 HxW, HxWx1 or HxWx3")
        if mask.ndim not in (2, 3) or (mask.ndim == 3 and mask.shape[2] not in (1, 3)):
            raise InvalidRequestError(
                f"invalid sampling param `mask_image`: expected shape (height, width), (height, width, 1) or "
                f"(height, width, 3), got {mask.shape}",
                param="mask_image",
            )
        if mask.shape[:2] != (h, w):
            raise InvalidRequestError(
                f"invalid sampling param `mask_image`: its size {mask.shape[1]}x{mask.shape[0]} differs from "
                f"the image's {w}x{h}",
                param="mask_image",
            )
        if mask.ndim == 3 and mask.shape[2] == 1:
            mask = mask[:, :, 0]
        elif mask.ndim == 3:
            # Luminance, as PIL's "L" conversion (ITU-R 601-2) that pipelines apply to masks.
            weights = np.array([299, 587, 114], dtype=np.uint32)
            mask = ((mask.astype(np.uint32) @ weights + 500) // 1000).astype(np.uint8)
        out["mask_image"] = np.array(mask, dtype=np.uint8, order="C", copy=True)
    return out


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
    """Fields of a params object or dict that are set (not ``None``)."""
    if params is None:
        return {}
    if isinstance(params, msgspec.Struct):
        return {k: v for k, v in msgspec.structs.asdict(params).items() if v is not None}
    if isinstance(params, dict):
        return {k: v for k, v in params.items() if v is not None}
    raise InvalidRequestError(
        f"sampling params must be a params object or a dict, got {type(params).__name__}",
        param="sampling_params",
    )


def resolve_params(params_cls: type[msgspec.Struct], defaults: dict[str, Any], params: Any) -> dict[str, Any]:
    """Merge ``params`` over the stage ``defaults``, validate them with ``params_cls`` and return
    the fields that are set. A params class that does not forbid unknown fields (the generic
    params of a custom runner) keeps them: that runner reads them.

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
    merged = {**defaults, **given}
    images = check_image_params(merged, given) if issubclass(params_cls, DiffusionSamplingParams) else {}
    merged.update(images)
    if merged.get("cache") is not None and "cache" in params_cls.__struct_fields__:
        merged["cache"] = _cache_param(merged["cache"])
    typed: msgspec.Struct | None = None
    try:
        typed = msgspec.convert(merged, params_cls, strict=False)
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
    # ``lora`` travels as a plain dict of its set fields, ``cache`` as its dict with ``type``, like
    # the rest of the params.
    fields = {
        k: {f: x for f, x in msgspec.structs.asdict(v).items() if x is not None}
        if isinstance(v, LoraRequest)
        else msgspec.to_builtins(v)
        if k == "cache"
        else v
        for k, v in msgspec.structs.asdict(typed).items()
        if v is not None
    }
    if not params_cls.__struct_config__.forbid_unknown_fields:
        extra = {k: v for k, v in merged.items() if k not in params_cls.__struct_fields__ and v is not None}
        fields = {**extra, **fields}
    return fields


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


def check_constraints(params: dict[str, Any], constraints: StageConstraints) -> None:
    """Checks that need the loaded model: what a stage reported in its READY message (each field
    is described on :class:`~omni_runtime.messages.StageConstraints`).

    ``size_multiple``, ``max_side`` and ``max_pixels`` bound height and width; the step range bounds
    ``num_inference_steps``; ``lora`` and ``image_inputs`` say which of those params the stage
    takes at all, and ``requires_image`` that it needs an input image. With an input image the
    size is the image's, and size errors name ``image``.
    """
    if params.get("lora") is not None and not constraints.lora:
        raise InvalidRequestError(
            "invalid sampling param `lora`: this stage's model does not take LoRA adapters", param="lora"
        )
    has_image = params.get("image") is not None
    check_image_capability(params, constraints)
    check_frames(params, constraints)
    check_audio(params, constraints)
    check_voice(params, constraints)
    check_cache(params, constraints)
    check_step_range(params.get("num_inference_steps"), constraints)
    h = params.get("height")
    w = params.get("width")
    multiple = constraints.size_multiple
    if multiple:
        for name, value in (("height", h), ("width", w)):
            if value is not None and value % multiple:
                why = constraints.size_multiple_reason or "the model's VAE scale factor"
                param, shown = ("image", f"the input image's {name} {value}") if has_image else (name, str(value))
                raise InvalidRequestError(
                    f"invalid sampling param `{param}`: {shown} is not a multiple of {multiple} ({why})",
                    param=param,
                )
    longest = constraints.max_side
    for name, value in (("height", h), ("width", w)):
        if longest and value is not None and value > longest:
            why = constraints.max_side_reason or "the model's positional table"
            param, shown = ("image", f"the input image's {name} {value}") if has_image else (name, str(value))
            raise InvalidRequestError(
                f"invalid sampling param `{param}`: {shown} is more than the {longest} pixels a side may have ({why})",
                param=param,
            )
    max_pixels = constraints.max_pixels
    if max_pixels and h is not None and w is not None and h * w > max_pixels:
        native = constraints.native_size
        made_for = f"; the model was made for {native[1]}x{native[0]}" if native else ""
        if has_image:
            raise InvalidRequestError(
                f"invalid sampling param `image`: the input image is {w}x{h}, more than this stage's limit of "
                f"{max_pixels} pixels (engine_args.max_pixels{made_for})",
                param="image",
            )
        raise InvalidRequestError(
            f"invalid sampling param `height`/`width`: {w}x{h} exceeds this stage's limit of {max_pixels} "
            f"pixels (engine_args.max_pixels{made_for})",
            param="size",
        )


def check_frames(params: dict[str, Any], constraints: StageConstraints) -> None:
    """Refuse video params on an image stage, and a frame count the video model cannot make."""
    step = constraints.frames_step
    for name in ("num_frames", "fps"):
        if params.get(name) is not None and step is None:
            raise InvalidRequestError(
                f"invalid sampling param `{name}`: this stage's model makes images, not videos", param=name
            )
    frames = params.get("num_frames")
    if frames is None or step is None:
        return
    why = constraints.frames_reason or "the model's VAE temporal compression"
    if (frames - 1) % step:
        below = (frames - 1) // step * step + 1
        raise InvalidRequestError(
            f"invalid sampling param `num_frames`: {frames} is not of the form {step}k+1 ({why}); "
            f"the nearest are {below} and {below + step}",
            param="num_frames",
        )
    most = constraints.max_frames
    if most is not None and frames > most:
        raise InvalidRequestError(
            f"invalid sampling param `num_frames`: {frames} is more than the {most} this stage's model can make",
            param="num_frames",
        )
    check_video_pixels(params, constraints)


def check_video_pixels(params: dict[str, Any], constraints: StageConstraints) -> None:
    """Refuse a video whose frames x pixels exceed the stage's ``max_video_pixels``: what its
    latents, activations and decode take grows with both, so this is its memory bound."""
    limit, frames = constraints.max_video_pixels, params.get("num_frames")
    h, w = params.get("height"), params.get("width")
    if limit is None or frames is None or h is None or w is None:
        return
    count = int(params.get("num_images_per_prompt") or 1)
    total = frames * h * w * count
    if total <= limit:
        return
    terms = f"num_frames x height x width{' x num_images_per_prompt' if count > 1 else ''}"
    values = f"{frames} x {h} x {w}{f' x {count}' if count > 1 else ''}"
    raise InvalidRequestError(
        f"invalid sampling param `num_frames`: {terms} = {values} = {total} exceeds this stage's limit of "
        f"{limit} (engine_args.max_video_pixels); ask for fewer frames or a smaller size",
        param="num_frames",
    )


#: The params only an audio model takes.
AUDIO_PARAMS = ("audio_end_in_s", "audio_start_in_s", "num_waveforms_per_prompt")


def check_cache(params: dict[str, Any], constraints: StageConstraints) -> None:
    """A request's ``cache`` names a type the stage runs (``cache_types``)."""
    value = params.get("cache")
    if value is None or value == "off" or constraints.cache_types is None:
        return
    name = cache_type(parse_cache(value))  # type: ignore[arg-type]  # neither None nor "off" here
    if name not in constraints.cache_types:
        raise InvalidRequestError(
            f"invalid sampling param `cache`: {constraints.cache_note or f'this stage runs no {name} cache'}",
            param="cache",
        )


def check_voice(params: dict[str, Any], constraints: StageConstraints) -> None:
    """Refuse a voice the speech stage's model does not have (``voices`` lists those it takes)."""
    voice = params.get("voice")
    if voice is not None and constraints.voices and voice not in constraints.voices:
        shown = ", ".join(constraints.voices)
        raise InvalidRequestError(
            f"invalid sampling param `voice`: {voice[:64]!r} is not a voice of this model; expected one of {shown}",
            param="voice",
        )


def check_speech_length(prompt: str, params: dict[str, Any], constraints: StageConstraints) -> None:
    """Refuse a text that a speech stage could speak for longer than its ``max_seconds`` at the
    request's ``speed`` (before it is queued: a clip's memory grows with its length). Counts
    characters, an upper bound of the tokens the stage's tokenizer makes of them (its case folding
    included); a stage whose tokenizer can make more checks its own tokens."""
    bound = constraints.speech
    if bound is None or bound.tokens_per_char is None:
        return
    speed = float(params.get("speed") or 1.0)
    tokens = bound.tokens_per_char * len(prompt.lower()) + bound.extra_tokens
    longest = bound.longest_s(tokens, speed)
    if longest <= bound.max_seconds:
        return
    per_char = bound.longest_s(bound.tokens_per_char, speed)
    most = max(int((bound.max_seconds - bound.longest_s(bound.extra_tokens, speed)) / per_char), 0)
    # ``speed`` is named when the text fits at speed 1, so that speaking slower is what passes the limit.
    fits = bound.longest_s(tokens, 1.0) <= bound.max_seconds
    param = "speed" if fits and speed < 1.0 else "prompt"
    raise InvalidRequestError(
        f"invalid sampling param `{param}`: {len(prompt)} characters at speed {speed:g} could make up to "
        f"{longest:.0f} s of audio, more than the {bound.max_seconds:g} s one request may make "
        f"(engine_args.max_speech_seconds); at this speed a request may speak {most} characters: split the text"
        + (" or speak faster" if param == "speed" else ""),
        param=param,
    )


def check_audio(params: dict[str, Any], constraints: StageConstraints) -> None:
    """Refuse audio params on a stage that makes no audio, and a clip the audio model cannot make:
    it ends past the model's window, or before it starts."""
    most = constraints.max_audio_s
    for name in AUDIO_PARAMS:
        if params.get(name) is not None and most is None:
            raise InvalidRequestError(f"invalid sampling param `{name}`: this stage's model makes no audio", param=name)
    if most is None:
        return
    if params.get("num_images_per_prompt") is not None:
        raise InvalidRequestError(
            "invalid sampling param `num_images_per_prompt`: this stage's model makes audio; "
            "use `num_waveforms_per_prompt`",
            param="num_images_per_prompt",
        )
    end = params.get("audio_end_in_s")
    start = params.get("audio_start_in_s") or 0.0
    why = constraints.audio_reason or "the model's window"
    if end is not None and end > most:
        raise InvalidRequestError(
            f"invalid sampling param `audio_end_in_s`: {end} s is past the {most:g} s this stage's model can make "
            f"({why})",
            param="audio_end_in_s",
        )
    if start >= (most if end is None else end):
        raise InvalidRequestError(
            f"invalid sampling param `audio_start_in_s`: {start} s is not before the clip's end "
            f"({most if end is None else end:g} s)",
            param="audio_start_in_s",
        )


def check_step_range(steps: int | None, constraints: StageConstraints) -> None:
    """Refuse a step count the stage's scheduler cannot run (it would fail mid-denoise)."""
    fewest, most = constraints.min_inference_steps, constraints.max_inference_steps
    if steps is None or fewest is None or most is None or fewest <= steps <= most:
        return
    scheduler = constraints.inference_steps_reason or "the model's scheduler"
    raise InvalidRequestError(
        f"invalid sampling param `num_inference_steps`: {steps} is outside {fewest}..{most}, the step counts "
        f"this stage's {scheduler} can run",
        param="num_inference_steps",
    )


def check_image_capability(params: dict[str, Any], constraints: StageConstraints) -> None:
    """Refuse image inputs a stage cannot use, and text-only requests to a stage that needs an image."""
    accepted = constraints.image_inputs
    note = constraints.image_inputs_note
    for name in ("image", "mask_image"):
        if params.get(name) is not None and name not in accepted:
            why = f" ({note})" if note else ""
            raise InvalidRequestError(
                f"invalid sampling param `{name}`: this stage does not take `{name}`{why}", param=name
            )
    if params.get("image") is not None and params.get("num_inference_steps"):
        form = "inpaint" if params.get("mask_image") is not None else "image"
        strength = params.get("strength") or constraints.default_strength.get(form)
        steps = params["num_inference_steps"]
        if strength is not None and int(steps * strength) < 1:
            raise InvalidRequestError(
                f"invalid sampling param `strength`: {strength} x num_inference_steps {steps} leaves no denoising "
                "step (an image request runs int(num_inference_steps x strength) steps); raise either",
                param="strength",
            )
    if params.get("image") is None and constraints.requires_image:
        raise InvalidRequestError(f"invalid sampling param `image`: {constraints.requires_image}", param="image")
