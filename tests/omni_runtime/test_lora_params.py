"""The ``lora`` sampling param and ``engine_args.loras``: validated before anything is queued, errors
naming the field; hostile values never get through."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.config import parse_config
from omni_runtime.exceptions import ConfigError, InvalidRequestError
from omni_runtime.messages import StageConstraints
from omni_runtime.params import DiffusionSamplingParams, LoraRequest, check_constraints, params_to_dict, resolve_params
from tests.strategies import ANY_FLOAT, ANY_TEXT, JSON_VALUES


def resolve(lora: Any) -> dict[str, Any]:
    """The resolved ``lora`` as the dict view shows it (None: none)."""
    return params_to_dict(resolve_params(DiffusionSamplingParams, {}, {"lora": lora})).get("lora")


def test_a_name_or_a_path_travels_as_a_request_and_reads_as_a_plain_dict() -> None:
    assert resolve({"name": "ink"}) == {"name": "ink", "scale": 1.0}
    assert resolve({"path": "/srv/loras/ink", "scale": -0.5}) == {"path": "/srv/loras/ink", "scale": -0.5}
    typed = DiffusionSamplingParams(lora=LoraRequest(name="ink", scale=0.8))
    assert resolve_params(DiffusionSamplingParams, {}, typed).lora == LoraRequest(name="ink", scale=0.8)
    # A default adapter in the YAML's default_sampling_params; the request's own wins.
    defaults = {"lora": {"name": "house-style"}}
    assert resolve_params(DiffusionSamplingParams, defaults, {}).lora == LoraRequest(name="house-style")
    resolved = resolve_params(DiffusionSamplingParams, defaults, {"lora": {"name": "ink"}})
    assert resolved.lora is not None and resolved.lora.name == "ink"


@pytest.mark.parametrize(
    ("lora", "param", "text"),
    [
        ({}, "lora", "exactly one of"),
        ({"name": "a", "path": "/a"}, "lora", "exactly one of"),
        ({"path": "user/repo"}, "lora", "never downloaded"),
        ({"path": "relative/dir"}, "lora", "absolute path"),
        ({"path": "/a\x00b"}, "lora", "NUL"),
        ({"path": "/" + "x" * 5000}, "lora.path", "length"),
        ({"name": "two words"}, "lora.name", "regex"),
        ({"name": ""}, "lora.name", "regex"),
        ({"name": "a", "scale": 11}, "lora.scale", "<= 10"),
        ({"name": "a", "scale": math.nan}, "lora.scale", ""),
        ({"name": "a", "scale": math.inf}, "lora.scale", "<= 10"),
        ({"name": "a", "scale": "x"}, "lora.scale", "float"),
        ({"name": "a", "weight": 1}, "lora", "unknown field `weight`"),
        ("ink", "lora", "object"),
    ],
)
def test_bad_values_name_the_field(lora: Any, param: str, text: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        resolve(lora)
    assert info.value.param == param and text in str(info.value)


def test_the_typed_class_checks_itself() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        LoraRequest(name="a", path="/a")
    with pytest.raises(InvalidRequestError, match="absolute"):
        LoraRequest(path="loras/ink")


@settings(max_examples=300, deadline=None)
@given(
    lora=st.one_of(
        JSON_VALUES,
        st.fixed_dictionaries(
            {},
            optional={
                "name": st.one_of(ANY_TEXT, JSON_VALUES),
                "path": st.one_of(ANY_TEXT, JSON_VALUES),
                "scale": st.one_of(ANY_FLOAT, JSON_VALUES),
            },
        ),
    )
)
def test_hostile_values_are_refused_or_well_formed(lora: Any) -> None:
    try:
        value = resolve(lora)
    except InvalidRequestError as e:
        assert e.param is not None and e.param.startswith("lora")
        return
    if lora is None:
        assert value is None
        return
    assert ("name" in value) != ("path" in value) and math.isfinite(value["scale"]) and abs(value["scale"]) <= 10
    assert value.get("path", "/").startswith("/")


def test_a_stage_must_say_it_takes_adapters() -> None:
    check_constraints({"lora": {"name": "ink"}}, StageConstraints(lora=True))
    check_constraints({}, StageConstraints())
    for constraints in (StageConstraints(), StageConstraints(lora=False)):
        with pytest.raises(InvalidRequestError, match="does not take LoRA") as info:
            check_constraints({"lora": {"name": "ink"}}, constraints)
        assert info.value.param == "lora"


def sd(engine_args: dict[str, Any]) -> dict[str, Any]:
    stage = {"stage_id": 0, "stage_type": "diffusion", "model": "builtin:tiny-sd", "engine_args": engine_args}
    return {"stage_args": [{**stage, "final_output": True, "final_output_type": "image"}]}


def test_engine_args_loras_and_max_loras() -> None:
    args = parse_config(sd({"loras": {"ink": "/srv/loras/ink"}, "max_loras": 2})).stage_args[0].engine_args
    assert args.loras == {"ink": "/srv/loras/ink"} and args.max_loras == 2
    assert parse_config(sd({})).stage_args[0].engine_args.max_loras == 4
    for engine_args, where in (
        ({"loras": {"ink": "loras/ink"}}, "loras.ink"),
        ({"loras": {"ink": "user/repo"}}, "never downloaded"),
        ({"loras": {"two words": "/a"}}, "engine_args.loras"),
        ({"loras": {"ink": 3}}, "engine_args.loras"),
        ({"max_loras": 0}, "engine_args.max_loras"),
    ):
        with pytest.raises(ConfigError, match=where):
            parse_config(sd(engine_args))
