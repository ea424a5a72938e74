"""The checks of a request's params: its input images normalised (:func:`check_image_params`, at
resolve), and what a stage's loaded model allows (:func:`check_constraints` and the ``check_*``
it runs, over what each stage reported in READY as a
:class:`~omni_runtime.messages.StageConstraints`), the stages' defaults within those bounds
(:func:`bounded_defaults`) and the bounds one stage puts on those that feed it
(:func:`link_constraints`). Raised errors are
:class:`~omni_runtime.exceptions.InvalidRequestError` naming the field. The checks read a params
object's fields that are set, or a plain dict of them (:func:`omni_runtime.params.params_to_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from omni_runtime.acceleration import cache_type, parse_cache
from omni_runtime.audio_input import check_input_audio_length
from omni_runtime.bounds import MAX_SIDE, MIN_SIDE
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints, TextBound

if TYPE_CHECKING:
    from omni_runtime.config import StageConfig

#: ``max_tokens`` of a text stage when neither the request nor the stage's defaults say.
DEFAULT_MAX_TOKENS = 32
#: ``max_codes`` of an omni talker when neither the request nor the stage's defaults say.
DEFAULT_MAX_CODES = 64

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


def set_fields(params: Mapping[str, Any] | msgspec.Struct) -> Mapping[str, Any]:
    """The fields of a params object that are set (not None), or a dict of them as it is: what the
    checks read."""
    if isinstance(params, msgspec.Struct):
        return {k: v for k in params.__struct_fields__ if (v := getattr(params, k)) is not None}
    return params


def check_constraints(params: Mapping[str, Any] | msgspec.Struct, constraints: StageConstraints) -> None:
    """Checks that need the loaded model: what a stage reported in its READY message (each field
    is described on :class:`~omni_runtime.messages.StageConstraints`), of a params object or a
    dict of its set fields.

    ``size_multiple``, ``max_side`` and ``max_pixels`` bound height and width; the step range bounds
    ``num_inference_steps``; ``lora`` and ``image_inputs`` say which of those params the stage
    takes at all, and ``requires_image`` that it needs an input image. With an input image the
    size is the image's, and size errors name ``image``. ``text`` bounds ``max_tokens`` (the
    prompt's share is :func:`check_text_length`'s), and ``max_codes`` a talker's ``max_codes``.
    """
    params = set_fields(params)
    if params.get("lora") is not None and not constraints.lora:
        raise InvalidRequestError(
            "invalid sampling param `lora`: this stage's model does not take LoRA adapters", param="lora"
        )
    check_max_tokens(params, constraints)
    check_max_codes(params, constraints)
    has_image = params.get("image") is not None
    check_image_capability(params, constraints)
    check_frames(params, constraints)
    check_audio(params, constraints)
    check_input_audio_length(params, constraints)
    check_voice(params, constraints)
    check_speed(params, constraints)
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
    # After the size rules: a size no frame count makes runnable is the size's error, not the frames'.
    check_video_pixels(params, constraints)


def check_frames(params: Mapping[str, Any], constraints: StageConstraints) -> None:
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


def check_video_pixels(params: Mapping[str, Any], constraints: StageConstraints) -> None:
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


def check_cache(params: Mapping[str, Any], constraints: StageConstraints) -> None:
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


def check_voice(params: Mapping[str, Any], constraints: StageConstraints) -> None:
    """Refuse a voice the speech stage's model does not have (``voices`` lists those it takes)."""
    voice = params.get("voice")
    if voice is not None and constraints.voices and voice not in constraints.voices:
        shown = ", ".join(constraints.voices)
        raise InvalidRequestError(
            f"invalid sampling param `voice`: {voice[:64]!r} is not a voice of this model; expected one of {shown}",
            param="voice",
        )


def check_speed(params: Mapping[str, Any], constraints: StageConstraints) -> None:
    """Refuse a ``speed`` outside the range a speech stage speaks at (``speech.speeds``)."""
    bound, speed = constraints.speech, params.get("speed")
    if bound is None or bound.speeds is None or speed is None:
        return
    low, high = bound.speeds
    if not low <= speed <= high:
        raise InvalidRequestError(
            f"invalid sampling param `speed`: {speed:g} is outside the {low:.3g}..{high:.3g} this stage speaks at",
            param="speed",
        )


def check_speech_length(prompt: str, params: Mapping[str, Any] | msgspec.Struct, constraints: StageConstraints) -> None:
    """Refuse a text that a speech stage could speak for longer than its ``max_seconds`` at the
    request's ``speed`` (before it is queued: a clip's memory grows with its length). Counts
    characters, an upper bound of the tokens the stage's tokenizer makes of them (its case folding
    included); a stage whose tokenizer can make more checks its own tokens."""
    bound = constraints.speech
    if bound is None or bound.tokens_per_char is None:
        return
    speed = float(set_fields(params).get("speed") or 1.0)
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


def bounded_defaults(params_cls: type[Any], defaults: dict[str, Any], constraints: StageConstraints) -> dict[str, Any]:
    """A stage's default params (``default_sampling_params``, resolved) within what its constraints
    allow, so that a request that leaves a length to the stage is never refused for it: a text
    stage's ``max_tokens`` (the stage's default, else :data:`DEFAULT_MAX_TOKENS`) at most its
    ``engine_args.max_output_tokens`` and what its context leaves after the shortest prompt; a
    talker's ``max_codes`` (else :data:`DEFAULT_MAX_CODES`) at most what the decoder it feeds takes.
    A length so bounded is set, so the stage and the request's usage see the one in force."""
    fields = getattr(params_cls, "__struct_fields__", ())
    out = defaults
    text = constraints.text
    if text is not None and "max_tokens" in fields:
        most = [defaults.get("max_tokens", DEFAULT_MAX_TOKENS)]
        if text.max_tokens is not None:
            most.append(text.max_tokens)
        if text.context is not None:
            most.append(text.context - text.shortest_prompt)
        out = {**out, "max_tokens": max(1, min(most))}
    if constraints.max_codes is not None and "max_codes" in fields:
        out = {**out, "max_codes": min(defaults.get("max_codes", DEFAULT_MAX_CODES), constraints.max_codes)}
    return out


def check_prompt_tokens(tokens: int, max_tokens: int, bound: TextBound, prompt: str) -> None:
    """Refuse a request to a text stage whose prompt of ``tokens`` tokens and ``max_tokens`` cannot
    both fit: ``max_tokens`` past ``engine_args.max_output_tokens``, or the two together past the
    model's context. The one rule of the caller's checks (with the fewest tokens the prompt can
    make) and of the stage's (with the tokens it made); ``prompt`` describes the prompt and its
    count, for the error. InvalidRequestError naming ``max_tokens``, or ``prompt`` when the prompt
    leaves no room for any answer."""
    most = bound.max_tokens
    if most is not None and max_tokens > most:
        raise InvalidRequestError(
            f"invalid sampling param `max_tokens`: {max_tokens} is more than the {most} tokens one request to "
            f"this stage may generate (engine_args.max_output_tokens); ask for at most {most}",
            param="max_tokens",
        )
    context = bound.context
    if context is None or tokens + max_tokens <= context:
        return
    room = context - tokens
    if room >= 1:
        shorten = ", or shorten the prompt" if tokens > bound.shortest_prompt else ""
        raise InvalidRequestError(
            f"invalid sampling param `max_tokens`: {prompt} and max_tokens {max_tokens} pass the model's context "
            f"of {context} tokens (prompt and answer together); ask for at most {room} tokens{shorten}",
            param="max_tokens",
        )
    raise InvalidRequestError(
        f"invalid sampling param `prompt`: {prompt} leaves no room for an answer in the model's context of "
        f"{context} tokens; shorten it",
        param="prompt",
    )


def check_max_tokens(params: Mapping[str, Any], constraints: StageConstraints) -> None:
    """Refuse a ``max_tokens`` a text stage cannot generate whatever the prompt: past its
    ``engine_args.max_output_tokens``, or more than its model's context leaves after the shortest
    prompt."""
    bound, asked = constraints.text, params.get("max_tokens")
    if bound is None or asked is None:
        return
    fewest = bound.shortest_prompt
    check_prompt_tokens(fewest, asked, bound, f"even the shortest prompt ({fewest} token{'s' * (fewest > 1)})")


def check_text_length(prompt: Any, params: Mapping[str, Any] | msgspec.Struct, constraints: StageConstraints) -> None:
    """Refuse a prompt that, with the request's ``max_tokens``, cannot fit a text stage's context
    however its tokenizer splits it (before it is queued): counts the fewest tokens the prompt can
    make (:meth:`~omni_runtime.messages.TextBound.fewest_tokens`); a prompt that may fit is the
    stage's to check, with the tokens it made. Nothing that could fit is refused."""
    bound = constraints.text
    if bound is None or not isinstance(prompt, str):
        return
    fewest = bound.fewest_tokens(prompt)
    if fewest is None:
        return
    asked = set_fields(params).get("max_tokens") or DEFAULT_MAX_TOKENS
    check_prompt_tokens(fewest, asked, bound, f"the prompt ({len(prompt)} characters: at least {fewest} tokens)")


def check_max_codes(params: Mapping[str, Any], constraints: StageConstraints) -> None:
    """Refuse a talker's ``max_codes`` past what the decoder it feeds takes (``max_codes`` of the
    talker's constraints, set by :func:`link_constraints`): those codes would be made, then refused."""
    most, asked = constraints.max_codes, params.get("max_codes")
    if most is None or asked is None or asked <= most:
        return
    why = constraints.max_codes_reason or "the stage it feeds takes at once"
    raise InvalidRequestError(
        f"invalid sampling param `max_codes`: {asked} is more than the {most} codes {why}; ask for at most {most}",
        param="max_codes",
    )


def link_constraints(
    stages: Sequence[StageConfig], constraints: dict[int, StageConstraints]
) -> dict[int, StageConstraints]:
    """The stages' READY constraints with what a stage takes applied to the stages that feed it: a
    stage reporting ``max_input_codes`` (a Qwen-Omni decoder) bounds the ``max_codes`` of each of
    its upstream stages, the smallest bound winning, where it takes their codes whole through the
    default mapping (a ``custom_process_input_func`` may make anything of them, and the stage
    checks), or in ``items`` chunks that may be larger than it takes."""
    out = dict(constraints)
    for stage in stages:
        own = constraints.get(stage.stage_id)
        limit = own.max_input_codes if own is not None else None
        if limit is None or stage.custom_process_input_func:
            continue
        chunks = stage.input_chunking
        if chunks is not None and chunks.policy == "items" and max(chunks.size, chunks.first_size or 0) <= limit:
            continue  # every chunk fits, however many codes the upstream makes
        why = (
            f"stage {stage.stage_id} decodes at once (its model's positions; that stage's `input_chunking: "
            f"{{policy: items, size: N}}` with N at most {limit} decodes them in chunks, with no such bound)"
        )
        for source in stage.engine_input_source:
            current = out.get(source, StageConstraints())
            if current.max_codes is None or limit < current.max_codes:
                out[source] = msgspec.structs.replace(current, max_codes=limit, max_codes_reason=why)
    return out


def check_audio(params: Mapping[str, Any], constraints: StageConstraints) -> None:
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


def check_image_capability(params: Mapping[str, Any], constraints: StageConstraints) -> None:
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
