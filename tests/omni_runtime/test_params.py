"""Sampling params: typed classes and plain dicts, validated before enqueue, errors naming the field."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_runtime.config import EngineArgs
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints
from omni_runtime.params import (
    DiffusionSamplingParams,
    GenericSamplingParams,
    TextSamplingParams,
    check_constraints,
    params_to_dict,
    resolve_params,
)

#: What a diffusion request's params are when nothing sets them (the class's fallbacks).
FALLBACKS = {"output_type": "pil"}


def test_defaults_then_request_values_win():
    p = resolve_params(
        DiffusionSamplingParams,
        {"num_inference_steps": 4, "height": 64},
        DiffusionSamplingParams(num_inference_steps=2, seed=3),
    )
    assert params_to_dict(p) == {"num_inference_steps": 2, "height": 64, "seed": 3, **FALLBACKS}
    assert params_to_dict(resolve_params(DiffusionSamplingParams, {}, {"seed": 5})) == {"seed": 5, **FALLBACKS}
    # A stage default wins over a fallback, the request's over both.
    assert resolve_params(DiffusionSamplingParams, {"output_type": "np"}, {}).output_type == "np"
    assert resolve_params(DiffusionSamplingParams, {"output_type": "np"}, {"output_type": "latent"}).output_type == (
        "latent"
    )


def test_a_runner_without_a_params_class_gets_every_field():
    """Generic params were converted into a struct without the fields, so the runner got none."""
    p = resolve_params(GenericSamplingParams, {"strength": 0.5}, {"style": "ink", "timeout": 3, "unset": None})
    assert params_to_dict(p) == {"strength": 0.5, "style": "ink", "timeout": 3.0}
    assert p.extra == {"strength": 0.5, "style": "ink"} and p.timeout == 3.0
    assert p.get("style") == "ink" and p.get("timeout") == 3.0 and p.get("unset", 1) == 1
    with pytest.raises(InvalidRequestError, match="timeout"):
        resolve_params(GenericSamplingParams, {}, {"timeout": -1})


@pytest.mark.parametrize(
    ("params", "field", "text"),
    [
        ({"foo": 1}, "foo", "unknown field"),
        ({"num_inference_steps": 0}, "num_inference_steps", ">= 1"),
        ({"num_inference_steps": -3}, "num_inference_steps", ">= 1"),
        ({"height": "big"}, "height", "got `str`"),
        ({"height": 100000}, "height", "<= 4096"),
        ({"guidance_scale": "x"}, "guidance_scale", "got `str`"),
        ({"seed": -1}, "seed", ">= 0"),
        ({"output_type": "gif"}, "output_type", "Invalid enum value 'gif'"),
        ({"timeout": 0}, "timeout", "> 0"),
    ],
)
def test_invalid_params_name_the_field(params, field, text):
    with pytest.raises(InvalidRequestError) as info:
        resolve_params(DiffusionSamplingParams, {}, params)
    assert info.value.param == field
    assert field in str(info.value) and text in str(info.value)


def test_wrong_params_class_and_type():
    with pytest.raises(InvalidRequestError, match="TextSamplingParams given to a stage that takes"):
        resolve_params(DiffusionSamplingParams, {}, TextSamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError, match="must be a params object or a dict"):
        resolve_params(DiffusionSamplingParams, {}, [1, 2])


def test_model_constraints():
    check_constraints({"height": 64, "width": 48}, StageConstraints(size_multiple=8, max_pixels=64 * 64))
    with pytest.raises(InvalidRequestError, match="`width`: 60 is not a multiple of 8") as info:
        check_constraints({"height": 64, "width": 60}, StageConstraints(size_multiple=8))
    assert info.value.param == "width"
    with pytest.raises(InvalidRequestError, match="exceeds"):
        check_constraints({"height": 128, "width": 128}, StageConstraints(max_pixels=64 * 64))
    why = "the VAE scale factor 2 x the SD3Transformer2DModel patch size 2"
    with pytest.raises(InvalidRequestError, match=r"60 is not a multiple of 8 \(the VAE scale factor 2 x the SD3"):
        check_constraints({"height": 60}, StageConstraints(size_multiple=8, size_multiple_reason=why))
    with pytest.raises(
        InvalidRequestError, match=r"16384 pixels \(engine_args.max_pixels; the model was made for 64x64\)"
    ):
        check_constraints({"height": 1024, "width": 1024}, StageConstraints(max_pixels=16384, native_size=(64, 64)))


def test_video_frames_follow_the_models_rule_and_images_take_none():
    video = StageConstraints(frames_step=4, frames_reason="the VAE compresses time 4x", max_frames=125)
    for frames in (1, 5, 9, 125):
        check_constraints({"num_frames": frames, "fps": 8}, video)
    with pytest.raises(
        InvalidRequestError, match=r"`num_frames`: 8 is not of the form 4k\+1 \(the VAE compresses"
    ) as info:
        check_constraints({"num_frames": 8}, video)
    assert info.value.param == "num_frames" and "nearest are 5 and 9" in str(info.value)
    with pytest.raises(InvalidRequestError, match="129 is more than the 125"):
        check_constraints({"num_frames": 129}, video)
    for name in ("num_frames", "fps"):  # an image stage says so rather than ignoring them
        with pytest.raises(InvalidRequestError, match=f"`{name}`: this stage's model makes images") as info:
            check_constraints({name: 9}, StageConstraints(size_multiple=8))
        assert info.value.param == name
    with pytest.raises(InvalidRequestError, match="`num_frames`"):
        resolve_params(DiffusionSamplingParams, {}, {"num_frames": 0})
    video = resolve_params(DiffusionSamplingParams, {"num_frames": 9}, {"fps": 24})
    assert (video.num_frames, video.fps) == (9, 24)


@given(
    frames=st.integers(1, 1_000),
    height=st.integers(1, 4_096),
    width=st.integers(1, 4_096),
    per_prompt=st.integers(1, 8),
    limit=st.integers(64, 2**40),
)
def test_the_video_memory_bound_refuses_exactly_what_exceeds_it(
    frames: int, height: int, width: int, per_prompt: int, limit: int
) -> None:
    video = StageConstraints(frames_step=1, max_video_pixels=limit)
    params = {"num_frames": frames, "height": height, "width": width, "num_images_per_prompt": per_prompt}
    total = frames * height * width * per_prompt
    if total <= limit:
        check_constraints(params, video)
        return
    with pytest.raises(InvalidRequestError, match=rf"= {total} exceeds this stage's limit of {limit} ") as info:
        check_constraints(params, video)
    assert info.value.param == "num_frames" and "engine_args.max_video_pixels" in str(info.value)


@pytest.mark.parametrize("bad", [0, 63, -1, 1.5, "big", True])
def test_max_video_pixels_config_refuses_what_is_no_bound(bad: object) -> None:
    with pytest.raises(msgspec.ValidationError, match="max_video_pixels"):
        msgspec.convert({"max_video_pixels": bad}, EngineArgs)
