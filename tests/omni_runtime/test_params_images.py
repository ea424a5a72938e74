"""Image inputs in the diffusion params: ``image``, ``mask_image`` and ``strength``, validated and
normalised in the caller's thread (PIL converted here, never on the wire), errors naming the param;
and the stage capabilities (READY constraints) that refuse inputs a stage cannot take."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints
from omni_runtime.params import (
    MAX_IMAGE_PIXELS,
    DiffusionSamplingParams,
    check_constraints,
    params_to_dict,
    resolve_params,
)
from tests.strategies import JSON_VALUES

DEFAULTS = {"num_inference_steps": 4, "height": 64, "width": 64}
IMAGE = np.arange(32 * 48 * 3, dtype=np.uint8).reshape(32, 48, 3)


def resolve(**params):
    """The resolved params, as the dict of their set fields."""
    return params_to_dict(resolve_params(DiffusionSamplingParams, DEFAULTS, params))


def test_an_image_sets_the_size_and_is_copied():
    p = resolve(image=IMAGE, strength=0.5)
    assert (p["height"], p["width"]) == (32, 48)  # the input's size wins over the stage default
    assert p["strength"] == 0.5 and p["image"].dtype == np.uint8 and p["image"].flags.c_contiguous
    assert np.array_equal(p["image"], IMAGE) and not np.shares_memory(p["image"], IMAGE)
    # An explicit size equal to the image's is fine; a different one says what to do.
    assert resolve(image=IMAGE, height=32, width=48)["height"] == 32
    with pytest.raises(InvalidRequestError, match="the input image is 48x32") as info:
        resolve(image=IMAGE, height=64)
    assert info.value.param == "height"


def test_pil_images_are_converted_in_the_callers_thread():
    rgba = Image.fromarray(np.dstack([IMAGE, np.full((32, 48), 255, np.uint8)]), "RGBA")
    mask = Image.fromarray(np.full((32, 48), 255, np.uint8), "L")
    p = resolve_params(DiffusionSamplingParams, DEFAULTS, DiffusionSamplingParams(image=rgba, mask_image=mask))
    assert isinstance(p.image, np.ndarray) and p.image.shape == (32, 48, 3)
    assert np.array_equal(p.image, IMAGE)
    assert isinstance(p.mask_image, np.ndarray) and p.mask_image.shape == (32, 48)


def test_masks_become_one_channel():
    for mask in (np.full((32, 48), 255, np.uint8), np.full((32, 48, 1), 255, np.uint8)):
        assert resolve(image=IMAGE, mask_image=mask)["mask_image"].shape == (32, 48)
    rgb = np.zeros((32, 48, 3), np.uint8)
    rgb[:, :24] = 255
    gray = resolve(image=IMAGE, mask_image=rgb)["mask_image"]
    # As PIL's "L" conversion of the same mask.
    assert np.array_equal(gray, np.asarray(Image.fromarray(rgb).convert("L")))


@pytest.mark.parametrize(
    ("params", "param", "text"),
    [
        ({"image": IMAGE.astype(np.float32)}, "image", "uint8"),
        ({"image": IMAGE.tolist()}, "image", "got list"),
        ({"image": "cat.png"}, "image", "got str"),
        ({"image": IMAGE[:, :, :2]}, "image", "(height, width, 3)"),
        ({"image": IMAGE[:, :, 0]}, "image", "(height, width, 3)"),
        ({"image": np.zeros((0, 48, 3), np.uint8)}, "image", "each side"),
        ({"image": np.zeros((4, 48, 3), np.uint8)}, "image", "each side"),
        ({"image": np.zeros((1, 1, 1, 3), np.uint8)}, "image", "(height, width, 3)"),
        ({"image": IMAGE, "mask_image": np.zeros((32, 47), np.uint8)}, "mask_image", "differs"),
        ({"image": IMAGE, "mask_image": np.zeros((32, 48, 2), np.uint8)}, "mask_image", "(height, width)"),
        ({"image": IMAGE, "mask_image": np.zeros((32, 48), np.float64)}, "mask_image", "uint8"),
        ({"mask_image": np.zeros((32, 48), np.uint8)}, "mask_image", "needs an input `image`"),
        ({"strength": 0.5}, "strength", "needs an input `image`"),
        ({"image": IMAGE, "strength": 0}, "strength", "> 0"),
        ({"image": IMAGE, "strength": 1.5}, "strength", "<= 1"),
        ({"image": IMAGE, "strength": float("nan")}, "strength", ""),
    ],
)
def test_bad_image_params_name_the_param(params, param, text):
    with pytest.raises(InvalidRequestError) as info:
        resolve(**params)
    assert info.value.param == param
    assert text in str(info.value)


def test_huge_images_are_refused_without_decoding_anything_else():
    # A view of one row repeated: no memory is spent on the refused image.
    huge = np.broadcast_to(np.zeros((1, 4096, 3), np.uint8), (4097, 4096, 3))
    with pytest.raises(InvalidRequestError, match="each side") as info:
        resolve(image=huge)
    assert info.value.param == "image"
    assert MAX_IMAGE_PIXELS == 4096 * 4096


def test_a_default_strength_needs_no_image():
    """Text requests to a stage whose YAML sets a default strength are not refused."""
    assert resolve_params(DiffusionSamplingParams, {**DEFAULTS, "strength": 0.6}, {"seed": 1}).strength == 0.6


def test_stage_capabilities():
    text_only = StageConstraints(size_multiple=8, image_inputs=(), image_inputs_note="no img2img: PixArt has none")
    with pytest.raises(InvalidRequestError, match="does not take `image` \\(no img2img: PixArt has none\\)") as info:
        check_constraints(resolve(image=IMAGE), text_only)
    assert info.value.param == "image"
    check_constraints(resolve(seed=1), text_only)
    img2img = StageConstraints(image_inputs=("image",))
    check_constraints(resolve(image=IMAGE), img2img)
    with pytest.raises(InvalidRequestError) as info:
        check_constraints(resolve(image=IMAGE, mask_image=np.zeros((32, 48), np.uint8)), img2img)
    assert info.value.param == "mask_image"
    # A stage that only edits images needs one.
    with pytest.raises(InvalidRequestError, match="needs an input image") as info:
        check_constraints(
            resolve(seed=1), StageConstraints(image_inputs=("image",), requires_image="X needs an input image")
        )
    assert info.value.param == "image"
    # At least one denoising step, with the pipeline's default strength where the request has none.
    steps = StageConstraints(image_inputs=("image",), default_strength={"image": 0.8})
    with pytest.raises(InvalidRequestError, match="leaves no denoising step") as info:
        check_constraints(resolve(image=IMAGE, num_inference_steps=1), steps)
    assert info.value.param == "strength"
    check_constraints(resolve(image=IMAGE, num_inference_steps=1, strength=1.0), steps)
    with pytest.raises(InvalidRequestError, match="leaves no denoising step"):
        check_constraints(resolve(image=IMAGE, num_inference_steps=4, strength=0.2), steps)
    # Size errors of an image request name the image.
    odd = np.zeros((36, 48, 3), np.uint8)
    with pytest.raises(InvalidRequestError, match="input image's height 36 is not a multiple of 8") as info:
        check_constraints(resolve(image=odd), StageConstraints(size_multiple=8, image_inputs=("image",)))
    assert info.value.param == "image"
    with pytest.raises(InvalidRequestError, match="limit of 1024 pixels") as info:
        check_constraints(resolve(image=IMAGE), StageConstraints(max_pixels=1024, image_inputs=("image",)))
    assert info.value.param == "image"


def _array(shape: tuple[int, ...], dtype: type, fill: float) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.full(shape, fill).astype(dtype, casting="unsafe")


ARRAYS = st.builds(
    _array,
    st.lists(st.integers(0, 70), min_size=0, max_size=4).map(tuple),
    st.sampled_from([np.uint8, np.int8, np.float16, np.float32, np.float64, np.bool_, np.int64, np.complex64]),
    st.sampled_from([0, 1, 255, -1, float("nan"), float("inf")]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    image=st.one_of(ARRAYS, JSON_VALUES),
    mask=st.one_of(st.none(), ARRAYS, JSON_VALUES),
    strength=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), JSON_VALUES),
)
def test_hostile_image_params_are_clear_errors(image, mask, strength):
    """Whatever arrives, the answer is a valid request or an InvalidRequestError naming a param."""
    try:
        p = resolve(image=image, mask_image=mask, strength=strength)
    except InvalidRequestError as e:
        assert e.param in {"image", "mask_image", "strength"}, e
        return
    if p.get("image") is not None:
        h, w, c = p["image"].shape
        assert p["image"].dtype == np.uint8 and c == 3 and (p["height"], p["width"]) == (h, w)
        if p.get("mask_image") is not None:
            assert p["mask_image"].shape == (h, w)


def test_a_surrogate_key_in_a_nested_param_is_a_clear_error():
    """msgspec fails to quote a lone surrogate in its unknown-field error (UnicodeEncodeError):
    found by the LoRA params' hypothesis test once both branches met."""
    with pytest.raises(InvalidRequestError, match="cannot be encoded as UTF-8") as info:
        resolve_params(DiffusionSamplingParams, {}, {"lora": {"\ud800": None}})
    assert info.value.param == "lora.\\ud800"  # the path to the key, the key escaped


#: In a fresh interpreter: the peak RSS (ru_maxrss, KiB) before and after a 30000x30000 image is
#: refused. The image is a broadcast view (no memory of its own), so only a copy could raise the peak.
_HUGE_VIEW = """
import resource, sys
import subprocess
import sys
from pathlib import Path

import numpy as np
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.params import DiffusionSamplingParams, resolve_params

huge = np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (30000, 30000, 3))
fine = np.zeros((64, 64, 3), np.uint8)
huge_mask = np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (30000, 30000, 3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for params in ({"image": huge}, {"image": fine, "mask_image": huge_mask}):
    try:
        resolve_params(DiffusionSamplingParams, {}, params)
    except InvalidRequestError as e:
        print(e.param)
    else:
        sys.exit("accepted")
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.integration  # a fresh interpreter, to read its peak memory
def test_a_huge_image_view_is_refused_before_it_is_copied():
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _HUGE_VIEW], cwd=repo, capture_output=True, text=True, timeout=120, check=True
    )
    image_param, mask_param, peaks = out.stdout.split("\n")[:3]
    assert (image_param, mask_param) == ("image", "mask_image")
    before, after = map(int, peaks.split())
    assert after - before < 50 * 1024, f"peak RSS rose by {(after - before) // 1024} MiB"  # a copy: 2.6 GiB
