"""One declaration of each request field's bounds: the engine's params classes (msgspec) and the HTTP
request models (pydantic) both take them from omni_runtime.bounds. Walks the JSON schema of every
params class and every HTTP request model: a field of the table's whose bounds differ from the
table's (a copy that drifted) fails here, and so does a params field bounded outside the table."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from omni_runtime.entrypoints.openai import protocol
from pydantic import BaseModel

from omni_runtime import params
from omni_runtime.bounds import FIELD_BOUNDS, REQUEST_BOUNDS, Bounds
from omni_runtime.config import EngineArgs
from omni_runtime.exceptions import InvalidRequestError

pytestmark = pytest.mark.unit

#: JSON-schema keywords -> the table's bound names.
_SCHEMA_BOUNDS = {
    "minimum": "ge",
    "exclusiveMinimum": "gt",
    "maximum": "le",
    "exclusiveMaximum": "lt",
    "minLength": "min_length",
    "maxLength": "max_length",
    "pattern": "pattern",
}
#: Where a field's name in a model differs from its name in the table.
_ALIASES = {"max_completion_tokens": "max_tokens", "max_response_output_tokens": "max_tokens"}
#: Nested models whose fields the table names with a prefix.
_CACHE_MODELS = ("FirstBlockCache", "TaylorSeerCache", "MagCache", "PyramidAttentionBroadcast", "FasterCache")
_PREFIXES = {"LoraSpec": "lora.", "LoraRequest": "lora."} | dict.fromkeys(_CACHE_MODELS, "cache.")


def _bounds_of(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The bounds a property's schema declares; None for an untyped (``Any``) one."""
    options = schema.get("anyOf", [schema])
    typed = [o for o in options if o.get("type") != "null" and ({"type", "$ref", "enum", "const"} & o.keys())]
    if not typed:
        return None
    found: dict[str, Any] = {}
    for option in typed:
        found |= {_SCHEMA_BOUNDS[k]: v for k, v in option.items() if k in _SCHEMA_BOUNDS}
    return found


def _fields(components: dict[str, dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(model, table name, declared bounds) of every typed property of every model."""
    out = []
    for model, schema in components.items():
        for name, prop in schema.get("properties", {}).items():
            bounds = _bounds_of(prop)
            if bounds is not None:
                out.append((model, _PREFIXES.get(model, "") + _ALIASES.get(name, name), bounds))
    return out


def _params_fields() -> list[tuple[str, str, dict[str, Any]]]:
    classes = [
        params.DiffusionSamplingParams,
        params.TextSamplingParams,
        params.EchoSamplingParams,
        params.SpeechSamplingParams,
        params.TranscriptionSamplingParams,
        params.TalkerSamplingParams,
        params.Code2WavSamplingParams,
        params.GenericSamplingParams,
        params.LoraRequest,
    ]
    _, components = msgspec.json.schema_components(classes)
    return _fields(components)


def _http_fields() -> list[tuple[str, str, dict[str, Any]]]:
    requests = [
        m
        for m in vars(protocol).values()
        if isinstance(m, type) and issubclass(m, protocol._Request) and not m.__name__.startswith("_")
    ]
    components: dict[str, dict[str, Any]] = {}
    for model in requests:
        schema = model.model_json_schema()
        components |= schema.pop("$defs", {})
        components[model.__name__] = schema
    return _fields(components)


def test_the_http_request_models_are_walked() -> None:
    models = {m for m, _, _ in _http_fields()}
    assert {"ImageGenerationRequest", "ImageEditForm", "ChatCompletionRequest", "GenerateInputs", "LoraSpec"} <= models
    assert all(issubclass(getattr(protocol, m), BaseModel) for m in models)


def test_every_params_field_with_a_bound_takes_it_from_the_table() -> None:
    checked = set()
    for model, name, declared in _params_fields():
        if declared:
            assert name in REQUEST_BOUNDS, f"{model}.{name} declares {declared} outside omni_runtime.bounds"
        if name in REQUEST_BOUNDS:
            assert declared == REQUEST_BOUNDS[name].limits(), f"{model}.{name}"
            checked.add(name)
    # Every entry of the table bounds a params field.
    assert checked == set(REQUEST_BOUNDS)


def test_every_http_field_of_the_table_has_the_tables_bounds() -> None:
    checked = set()
    for model, name, declared in _http_fields():
        if name in REQUEST_BOUNDS:
            assert declared == REQUEST_BOUNDS[name].limits(), f"{model}.{name}: {declared}"
            checked.add(name)
    # The fields both surfaces take (the rest are engine-only: echo's delay_ms, top_k...).
    assert {"seed", "timeout", "priority", "num_inference_steps", "guidance_scale", "strength"} <= checked
    assert {"height", "width", "negative_prompt", "max_tokens", "temperature", "top_p", "lora.scale"} <= checked


def test_a_drifted_copy_would_be_caught() -> None:
    class Drifted(protocol._Request):
        timeout: protocol.Timeout | None = None
        steps: int | None = None

    schema = Drifted.model_json_schema()
    assert _fields({"Drifted": schema})[0][2] == REQUEST_BOUNDS["timeout"].limits()

    class Copied(msgspec.Struct):
        timeout: float = msgspec.field(default=1.0)

    _, components = msgspec.json.schema_components([Copied])
    assert _fields(components)[0][2] != REQUEST_BOUNDS["timeout"].limits()


def test_the_same_timeout_over_http_and_from_python() -> None:
    week = 7 * 86_400
    assert protocol.GenerateConfig(timeout=week).timeout == week
    assert params.resolve_params(params.EchoSamplingParams, {}, {"timeout": week}).timeout == week
    with pytest.raises(ValueError):
        protocol.GenerateConfig(timeout=week + 1)
    with pytest.raises(InvalidRequestError):
        params.resolve_params(params.EchoSamplingParams, {}, {"timeout": week + 1})


def test_control_call_bounds_are_the_yamls() -> None:
    fields = EngineArgs.__struct_fields__
    for name, bounds in FIELD_BOUNDS.items():
        assert name in fields
        assert bounds.check(bounds.le, name) == bounds.le
        with pytest.raises(InvalidRequestError, match=name):
            bounds.check(math.nan, name)
    with pytest.raises(TypeError):
        Bounds(ge=0).annotated  # noqa: B018 - a request bound has no type of its own
