"""What the request models of every surface share: the strict base model (an unknown field or a
value no engine message can carry is a 400), the number types that refuse booleans, the size and
seconds parsers, the file format and step cache validators, and the LoRA field."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from omni_runtime import encoders
from omni_runtime.acceleration import parse_cache
from omni_runtime.bounds import MAX_SIDE, MIN_SIDE
from omni_runtime.bounds import pydantic as bounds
from omni_runtime.serialization import find_unencodable

#: ``WxH`` in ASCII digits, exactly (no spaces, no other case, no other script's digits).
_SIZE_RE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})", re.ASCII)
#: Seconds of video: ASCII digits, optionally a decimal part (no sign, exponent or underscore).
_SECONDS_RE = re.compile(r"[0-9]{1,6}(?:\.[0-9]{1,6})?", re.ASCII)


def _not_bool(value: Any) -> Any:
    # Lax mode (a form's "9" is 9) would also take JSON's true for 1: a boolean is no number.
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


#: Refuses a boolean for a number field, in lax mode too.
NotBool = BeforeValidator(_not_bool)

Seed = Annotated[int, Field(**bounds("seed")), NotBool]
#: A per-request deadline in seconds (an extension: OpenAI has none in the body).
Timeout = Annotated[float, Field(**bounds("timeout")), NotBool]
#: Higher is served first (an extension); see docs/configuration.md, "Priority".
Priority = Annotated[int, Field(**bounds("priority")), NotBool]
#: A latency target (ms) at stages with ``batch_policy: learned`` or ``deadline`` (an extension).
SloMs = Annotated[float, Field(**bounds("slo_ms")), NotBool]


def _image_format(value: str) -> str:
    if value not in encoders.formats("image"):
        raise ValueError(f"Input should be one of {', '.join(map(repr, encoders.formats('image')))}")
    return value


def _image_formats_schema(schema: dict[str, Any]) -> None:
    schema["enum"] = list(encoders.formats("image"))


#: A file format for generated images: any the encoder registry has (omni_runtime/encoders.py);
#: the OpenAPI schema lists them as an enum, as of when the schema is first built.
ImageFormat = Annotated[str, AfterValidator(_image_format), Field(json_schema_extra=_image_formats_schema)]


def _job_format(value: str) -> str:
    known = (*encoders.formats("image"), *encoders.formats("audio"))
    if value not in known:
        raise ValueError(f"Input should be one of {', '.join(map(repr, known))}")
    return value


def _job_formats_schema(schema: dict[str, Any]) -> None:
    schema["enum"] = [*encoders.formats("image"), *encoders.formats("audio")]


#: A job's file format: an image format (image tasks) or an audio one (audio tasks); which kind
#: the task takes is checked with the task (entrypoints/openai/job_manager.py).
JobFormat = Annotated[str, AfterValidator(_job_format), Field(json_schema_extra=_job_formats_schema)]


def _form_json(value: Any) -> Any:
    """A multipart form carries an object as its JSON text (``cache={"type": ...}``)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError("not valid JSON") from None
    return value


def _step_cache(value: Any) -> dict[str, Any] | Literal["off"]:
    """The ``cache`` extension: checked as the Python param is (types, fields and bounds of
    omni_runtime/acceleration.py), passed on as plain data."""
    if value == "off":
        return "off"
    if not isinstance(value, dict):
        raise ValueError('expected "off" or an object with `type` (first_block, taylorseer, mag, pab)')
    try:
        parsed = parse_cache(value)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"invalid step cache: {e}") from None
    builtins: dict[str, Any] = msgspec.to_builtins(parsed)
    return builtins


#: Step caching for the request (an extension): ``{"type": "first_block", "threshold": 0.1}``, the
#: fields of ``engine_args.cache``, or ``"off"``; unset: the stage's own.
StepCacheField = Annotated[Any, BeforeValidator(_form_json), AfterValidator(_step_cache)]


class UnencodableValue(ValueError):
    """A request value no engine message can carry (a lone surrogate, an integer past 64 bits)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"`{path}`: {why}" if path else why)
        self.path = path or None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        # Before any field is read: whatever the field (prompt, messages, model, user...), a value
        # that no message can carry is this request's 400, not an error deep in the engine.
        found = find_unencodable(data)
        if found is not None:
            raise UnencodableValue(*found)
        return data


def parse_size(value: str) -> tuple[int, int]:
    """``"WxH"`` (ASCII digits, exactly) -> (width, height), each within [MIN_SIDE, MAX_SIDE];
    ValueError otherwise."""
    m = _SIZE_RE.fullmatch(value)
    if not m:
        raise ValueError(f"size must look like '512x512' (WIDTHxHEIGHT), got {value[:40]!r}")
    width, height = int(m.group(1)), int(m.group(2))
    for side in (width, height):
        if not MIN_SIDE <= side <= MAX_SIDE:
            raise ValueError(f"each side of size must be between {MIN_SIDE} and {MAX_SIDE} pixels, got {value!r}")
    return width, height


class LoraSpec(_Request):
    """The ``lora`` extension field: an adapter the operator registered, by name, and its scale.

    Paths are refused: a client must not choose files on the server. The operator offers adapters
    with ``engine_args.loras`` or ``collective_rpc("add_lora")``; the Python API may pass paths.
    """

    # Python's regex engine: the name pattern is shared with msgspec and ends in ``\Z``.
    model_config = ConfigDict(extra="forbid", regex_engine="python-re")

    name: Annotated[str, Field(**bounds("lora.name"))]
    scale: Annotated[float, Field(**bounds("lora.scale"), allow_inf_nan=False)] = 1.0
    #: Declared only to be refused with the reason.
    path: Any = None

    @field_validator("path")
    @classmethod
    def _no_paths(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "adapter paths are not accepted over HTTP; name an adapter the server offers "
                "(engine_args.loras, or collective_rpc add_lora)"
            )
        return value

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "scale": self.scale}


class _SizedRequest(_Request):
    """A request with an optional ``size`` (``WxH``; ``auto`` or unset: the default)."""

    size: str | None = None

    @field_validator("size")
    @classmethod
    def _check_size(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return None
        parse_size(value)
        return value

    def dimensions(self) -> tuple[int, int] | None:
        return None if self.size is None else parse_size(self.size)


#: Longest video ``seconds`` may ask for (the frame bound applies on top).
MAX_SECONDS = 600.0


def seconds_of(value: str) -> float:
    """``"4"`` / ``"2.5"`` (ASCII digits, exactly) -> seconds, positive and at most MAX_SECONDS;
    ValueError otherwise."""
    if not _SECONDS_RE.fullmatch(value):
        raise ValueError(f"seconds must be a number of seconds such as '4' or '2.5', got {value[:16]!r}")
    seconds = float(value)
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds must be more than 0 and at most {MAX_SECONDS:g}, got {value[:16]!r}")
    return seconds
