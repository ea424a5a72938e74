"""The acceleration options' declarations and the combinations refused before any model loads."""

from __future__ import annotations

import copy
import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.acceleration import FirstBlockCache, MagCache, cache_key, parse_cache
from omni_runtime.config import parse_config
from omni_runtime.exceptions import ConfigError, InvalidRequestError
from omni_runtime.messages import StageConstraints
from omni_runtime.params import DiffusionSamplingParams, check_constraints, params_to_dict, resolve_params
from tests.strategies import ANY_TEXT, JSON_VALUES, SURROGATES

pytestmark = pytest.mark.unit

BASE: dict[str, Any] = {
    "stage_args": [
        {"stage_id": 0, "stage_type": "diffusion", "model": "m", "final_output": True, "final_output_type": "image"}
    ]
}


def config(engine_args: dict[str, Any], devices: str = "cpu") -> Any:
    data = copy.deepcopy(BASE)
    data["stage_args"][0]["engine_args"] = engine_args
    data["stage_args"][0]["runtime"] = {"devices": devices}
    return parse_config(data, "accel.yaml")


def test_options_decode() -> None:
    args = (
        config(
            {
                "cache": {"type": "mag", "threshold": 0.1, "max_skip_steps": 2},
                "quantization": {"quant_type": "int8wo", "components": ["text_encoder"]},
                "layerwise_casting": {"storage_dtype": "bfloat16"},
            }
        )
        .stage_args[0]
        .engine_args
    )
    assert args.cache == MagCache(threshold=0.1, max_skip_steps=2)
    assert args.quantization.components == ["text_encoder"]
    assert args.layerwise_casting.compute_dtype == "float32"
    assert config({"offload": "group"}, devices="cuda:0").stage_args[0].engine_args.offload == "group"


@pytest.mark.parametrize(
    ("engine_args", "devices", "path", "words"),
    [
        ({"cache": {"type": "teacache"}}, "cpu", "engine_args.cache.type", "Invalid value"),
        ({"cache": {"type": "faster"}}, "cpu", "engine_args.cache.type", "FasterCache"),
        ({"cache": {"type": "first_block", "threshold": -1}}, "cpu", "engine_args.cache.threshold", ">= 0"),
        ({"cache": {"type": "pab", "radius": 3}}, "cpu", "engine_args.cache.radius", "unknown key"),
        ({"cache": {"type": "taylorseer"}, "step_execution": True}, "cpu", "engine_args.cache.type", "per request"),
        ({"cache": {"type": "pab"}, "step_execution": True}, "cpu", "engine_args.cache.type", "first_block"),
        ({"quantization": {"backend": "bnb"}}, "cpu", "engine_args.quantization.backend", "Invalid enum"),
        ({"quantization": {"quant_type": "float8wo"}}, "cpu", "engine_args.quantization.quant_type", "GPU"),
        ({"quantization": {}, "layerwise_casting": {}}, "cpu", "engine_args.layerwise_casting", "choose one"),
        ({"layerwise_casting": {"storage_dtype": "int4"}}, "cpu", "engine_args.layerwise_casting.storage_dtype", ""),
        ({"offload": "model"}, "cpu", "engine_args.offload", "accelerator"),
        ({"offload": "sequential"}, "cpu:0", "engine_args.offload", "accelerator"),
        ({"offload": "disk"}, "cuda", "engine_args.offload", "Invalid enum"),
        ({"offload": "model", "torch_compile": True}, "cuda", "engine_args.offload", "torch.compile"),
    ],
)
def test_refused_combinations_name_the_yaml_path(
    engine_args: dict[str, Any], devices: str, path: str, words: str
) -> None:
    with pytest.raises(ConfigError, match=words) as e:
        config(engine_args, devices)
    assert e.value.path == f"stage_args[0].{path}"
    assert str(e.value).startswith(f"accel.yaml: stage_args[0].{path}: ")


def test_first_block_cache_runs_in_step_execution() -> None:
    args = config({"cache": {"type": "first_block"}, "step_execution": True}).stage_args[0].engine_args
    assert args.step_execution and args.cache == FirstBlockCache()


def test_quantizing_another_component_leaves_the_denoiser_to_casting() -> None:
    args = config({"quantization": {"components": ["text_encoder"]}, "layerwise_casting": {}}).stage_args[0]
    assert args.engine_args.layerwise_casting is not None


def test_request_cache_param_and_key() -> None:
    given_ = resolve_params(DiffusionSamplingParams, {}, {"cache": {"type": "first_block", "threshold": 0.2}})
    assert given_.cache == FirstBlockCache(threshold=0.2)  # the struct travels; its dict view as given
    assert params_to_dict(given_)["cache"] == {"type": "first_block", "threshold": 0.2}
    assert parse_cache(given_.cache) == FirstBlockCache(threshold=0.2)
    assert resolve_params(DiffusionSamplingParams, {}, {"cache": "off"}).cache == "off"
    # Equal settings batch together however they were spelt; different ones apart.
    assert cache_key({"type": "first_block", "threshold": 0.05}) == cache_key({"type": "first_block"})
    keys = {cache_key(v) for v in (None, "off", {"type": "first_block"}, {"type": "mag"}, {"type": "pab"})}
    assert len(keys) == 5
    with pytest.raises(InvalidRequestError, match=r"`cache\.threshold`"):
        resolve_params(DiffusionSamplingParams, {}, {"cache": {"type": "first_block", "threshold": 11}})


@settings(max_examples=150, deadline=None)
@given(
    st.none()
    | st.text(max_size=8)
    | st.integers()
    | st.dictionaries(
        st.sampled_from(["type", "threshold", "cache_interval", "mag_ratios", "x"]),
        st.none() | st.text(max_size=8) | st.floats(allow_nan=True) | st.integers() | st.lists(st.floats(), max_size=3),
        max_size=4,
    )
)
def test_hostile_cache_params_are_400s_or_valid(value: Any) -> None:
    try:
        resolved = resolve_params(DiffusionSamplingParams, {}, {"cache": value})
    except InvalidRequestError as e:
        assert e.param is not None and e.param.startswith("cache")
        return
    cache = resolved.cache
    assert cache is None or cache == "off" or isinstance(cache_key(cache), str)


@pytest.mark.parametrize(
    "cache",
    [
        FirstBlockCache(threshold=math.nan),
        FirstBlockCache(threshold="0.1"),  # type: ignore[arg-type]
        MagCache(threshold=math.inf),
        MagCache(mag_ratios=[1.0, math.nan]),
        {"type": "mag", "mag_ratios": [1e308]},
        {"type": "mag", "mag_ratios": [math.nan]},
        {"type": "first_block", "threshold": "0.1"},
        {"type": "first_block", "threshold": True},
        {"type": "taylorseer", "cache_interval": 5.0},
    ],
)
def test_bad_cache_values_are_one_typed_error_whatever_their_form(cache: Any) -> None:
    """A struct's fields are checked like a mapping's (its constructor checks nothing), strictly
    (no string or bool for a number), and no NaN or huge ratio is served."""
    for params in ({"cache": cache}, DiffusionSamplingParams(cache=cache)):
        with pytest.raises(InvalidRequestError) as info:
            resolve_params(DiffusionSamplingParams, {}, params)
        assert info.value.param is not None and info.value.param.startswith("cache."), info.value


#: Text with at least one lone surrogate, where a cache value can hold text.
UNENCODABLE = st.builds(lambda a, c, b: a + c + b, ANY_TEXT, SURROGATES, ANY_TEXT)


@settings(max_examples=150, deadline=None)
@given(
    value=st.one_of(
        UNENCODABLE,
        st.fixed_dictionaries({"type": UNENCODABLE}),
        st.fixed_dictionaries({"type": st.sampled_from(["first_block", "mag"]), "threshold": UNENCODABLE}),
        st.dictionaries(UNENCODABLE, JSON_VALUES, min_size=1, max_size=2).map(lambda d: {"type": "mag", **d}),
    )
)
def test_parse_cache_refuses_unencodable_text_with_its_typed_error(value: Any) -> None:
    """The lax parse reads strings as UTF-8: a lone surrogate raised UnicodeEncodeError from
    parse_cache, which every caller (the HTTP field, the params) catches only as ValidationError."""
    with pytest.raises(msgspec.ValidationError, match="cannot be encoded as UTF-8"):
        parse_cache(value)


def test_a_stage_names_the_cache_types_it_runs() -> None:
    step = StageConstraints(cache_types=("first_block",), cache_note="step execution caches with first_block")
    check_constraints({"cache": {"type": "first_block", "threshold": 0.2}}, step)
    check_constraints({"cache": "off"}, StageConstraints(cache_types=(), cache_note="no hooks"))
    with pytest.raises(InvalidRequestError, match="step execution caches") as e:
        check_constraints({"cache": MagCache()}, step)
    assert e.value.param == "cache"
    check_constraints({"cache": {"type": "mag"}}, StageConstraints())  # unreported: the stage checks
