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

from omni_runtime.exceptions import InvalidRequestError

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
#: A per-request deadline in seconds; at most a week (a larger one is a mistake, not a deadline).
Timeout = Annotated[float, msgspec.Meta(gt=0, le=7 * 86400)]
#: A request's priority: higher is served first (see docs/configuration.md, "Priority").
Priority = Annotated[int, msgspec.Meta(ge=-1_000_000, le=1_000_000)]
#: ``max_pixels`` of a stage when neither its config nor its model says: 2048 x 2048.
FALLBACK_MAX_PIXELS = 2048 * 2048
#: Longest prompt accepted, in characters.
MAX_PROMPT_CHARS = 100_000
#: What a LoRA adapter's registered name may look like (``engine_args.loras``, ``add_lora``).
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: Largest magnitude of a LoRA scale: past a few units an adapter only produces noise.
MAX_LORA_SCALE = 10.0
#: Longest adapter path accepted, in characters (Linux's PATH_MAX).
MAX_LORA_PATH_CHARS = 4096


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the typed params, with what every stage type takes: ``timeout`` (seconds), a
    per-request deadline, and ``priority`` (higher first, default 0). Either may be set in any
    stage's params; it applies to the whole request."""

    #: Which ``stage_type`` these params are for.
    stage_type: ClassVar[str] = ""
    timeout: Timeout | None = None
    priority: Priority | None = None


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

    name: Annotated[str, msgspec.Meta(pattern=LORA_NAME_PATTERN)] | None = None
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LORA_PATH_CHARS)] | None = None
    #: How strongly the adapter applies: 0 = not at all, 1 = as trained, negative = away from it.
    scale: Annotated[float, msgspec.Meta(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)] = 1.0

    def __post_init__(self) -> None:
        if (self.name is None) == (self.path is None):
            raise InvalidRequestError(
                "give exactly one of `lora.name` (a registered adapter) or `lora.path` (a local directory)",
                param="lora",
            )
        if self.path is not None:
            check_lora_path(self.path)


class DiffusionSamplingParams(SamplingParams):
    """Parameters of a diffusion (text-to-image) request."""

    stage_type: ClassVar[str] = "diffusion"

    height: Annotated[int, msgspec.Meta(ge=8, le=4096)] | None = None
    width: Annotated[int, msgspec.Meta(ge=8, le=4096)] | None = None
    num_inference_steps: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    guidance_scale: Annotated[float, msgspec.Meta(ge=0, le=100)] | None = None
    negative_prompt: str | None = None
    num_images_per_prompt: Annotated[int, msgspec.Meta(ge=1, le=16)] | None = None
    #: Seed of this request's own generator; a fresh one is drawn (and reported) when unset.
    seed: Seed | None = None
    #: ``pil`` images, ``np`` float arrays in [0, 1], or ``latent`` tensors.
    output_type: Literal["pil", "np", "latent"] | None = None
    #: A LoRA adapter to run with (a :class:`LoraRequest` or a dict of its fields); none when unset.
    lora: LoraRequest | None = None


class TextSamplingParams(SamplingParams):
    """Parameters of a text-generation request."""

    stage_type: ClassVar[str] = "text"

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=8192)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=10)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    seed: Seed | None = None
    stop: list[str] | None = None


class EchoSamplingParams(SamplingParams):
    """Parameters of the ``echo`` stage: it returns its input after ``delay_ms``."""

    stage_type: ClassVar[str] = "echo"

    delay_ms: Annotated[float, msgspec.Meta(ge=0, le=600_000)] | None = None


class GenericSamplingParams(msgspec.Struct, kw_only=True):
    """Params of a custom runner that declares no class of its own: any JSON-like fields."""

    stage_type: ClassVar[str] = "custom"
    timeout: Timeout | None = None
    priority: Priority | None = None


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

    Raises InvalidRequestError naming the field (unknown key, wrong type, out of range).
    """
    if isinstance(params, msgspec.Struct) and not isinstance(params, params_cls):
        raise InvalidRequestError(
            f"{type(params).__name__} given to a stage that takes {params_cls.__name__}",
            param="sampling_params",
        )
    merged = {**defaults, **params_to_dict(params)}
    try:
        typed = msgspec.convert(merged, params_cls, strict=False)
    except msgspec.ValidationError as e:
        message, field = _field_of(e)
        name = f"`{field}`: " if field else ""
        raise InvalidRequestError(f"invalid sampling param {name}{message}", param=field) from None
    # ``lora`` travels as a plain dict of its set fields, like the rest of the params.
    fields = {
        k: {f: x for f, x in msgspec.structs.asdict(v).items() if x is not None} if isinstance(v, LoraRequest) else v
        for k, v in msgspec.structs.asdict(typed).items()
        if v is not None
    }
    if not params_cls.__struct_config__.forbid_unknown_fields:
        extra = {k: v for k, v in merged.items() if k not in params_cls.__struct_fields__ and v is not None}
        fields = {**extra, **fields}
    return fields


def check_constraints(params: dict[str, Any], constraints: dict[str, Any]) -> None:
    """Checks that need the loaded model: what a stage reported in its READY message.

    ``size_multiple``: height and width must be multiples of it; ``size_multiple_reason`` says why
    in the model's terms (VAE scale factor, latent packing, patch size).
    ``max_pixels``: height * width may not exceed it (``native_size``, when known, is named).
    ``lora``: whether the stage's model takes LoRA adapters; a stage that does not say so refuses them.
    """
    if params.get("lora") is not None and not constraints.get("lora"):
        raise InvalidRequestError(
            "invalid sampling param `lora`: this stage's model does not take LoRA adapters", param="lora"
        )
    h = params.get("height")
    w = params.get("width")
    multiple = constraints.get("size_multiple")
    if multiple:
        for name, value in (("height", h), ("width", w)):
            if value is not None and value % multiple:
                why = constraints.get("size_multiple_reason") or "the model's VAE scale factor"
                raise InvalidRequestError(
                    f"invalid sampling param `{name}`: {value} is not a multiple of {multiple} ({why})",
                    param=name,
                )
    max_pixels = constraints.get("max_pixels")
    if max_pixels and h is not None and w is not None and h * w > max_pixels:
        native = constraints.get("native_size")
        made_for = f"; the model was made for {native[1]}x{native[0]}" if native else ""
        raise InvalidRequestError(
            f"invalid sampling param `height`/`width`: {w}x{h} exceeds this stage's limit of {max_pixels} "
            f"pixels (engine_args.max_pixels{made_for})",
            param="size",
        )
