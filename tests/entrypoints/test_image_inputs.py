"""Image inputs through the Python API on real stage processes: PIL images converted in the
caller's thread (raw arrays on the wire), capabilities from the stage's READY message refusing
what a stage cannot take, hostile inputs as InvalidRequestError with the engine still serving,
and a ControlNet directory refused at startup."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from omni_runtime import DiffusionSamplingParams, Omni
from omni_runtime.exceptions import InvalidRequestError, OmniError
from tests.strategies import JSON_VALUES


def picture(seed: int, h: int = 64, w: int = 64) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    r, g, b = np.random.default_rng(seed).integers(0, 255, 3)
    disc = ((y - h / 2) ** 2 + (x - w / 3) ** 2) < (min(h, w) / 4) ** 2
    return np.stack([x * r / w, y * g / h, np.where(disc, b, 255 - b)], axis=-1).astype(np.uint8)


@pytest.fixture(scope="module")
def sd():
    # One torch thread: intra-op threads that wait for each other slow down badly on a busy machine.
    with Omni("tiny-sd", max_num_seqs=4, request_batch_max_wait_ms=10, torch_threads=1) as omni:
        yield omni


def pixels(out) -> np.ndarray:
    assert out.error is None, out.error
    return np.asarray(out.images[0], dtype=np.int16)


def test_pil_and_arrays_give_the_same_image(sd):
    array = picture(1, 48, 32)
    mask = np.zeros((48, 32), np.uint8)
    mask[8:40, 8:24] = 255
    as_array = sd.generate("a fox", {"image": array, "mask_image": mask, "seed": 3}, use_tqdm=False)[0]
    as_pil = sd.generate(
        "a fox",
        DiffusionSamplingParams(image=Image.fromarray(array), mask_image=Image.fromarray(mask), seed=3),
        use_tqdm=False,
    )[0]
    assert as_array.images[0].size == (32, 48)  # the input's size
    assert np.array_equal(pixels(as_array), pixels(as_pil))


def test_one_image_per_prompt_in_one_call(sd):
    """Per-prompt params: each prompt edits its own picture; they batch together."""
    params = [{"image": picture(i), "strength": 0.7, "seed": i} for i in range(3)]
    outs = sd.generate(["a", "b", "c"], params, use_tqdm=False)
    for i, out in enumerate(outs):
        alone = sd.generate(["a", "b", "c"][i], params[i], use_tqdm=False)[0]
        assert np.abs(pixels(out) - pixels(alone)).max() <= 1
    assert np.abs(pixels(outs[0]) - pixels(outs[1])).max() > 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    image=st.one_of(
        JSON_VALUES,
        st.builds(
            np.zeros, st.lists(st.integers(0, 9), max_size=4).map(tuple), st.sampled_from([np.uint8, np.float32])
        ),
        st.just(np.full((64, 64, 3), np.nan, np.float32)),
        st.just(np.zeros((64, 60, 3), np.uint8)),  # not a multiple of 8
        st.just(np.zeros((136, 128, 3), np.uint8)),  # past the stage's max_pixels (4 x 64 x 64)
    ),
    strength=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_hostile_image_params_are_invalid_requests(sd, image, strength):
    try:
        sd.engine.validate("x", {"image": image, "strength": strength, "num_inference_steps": 2})
    except InvalidRequestError as e:
        assert e.param in ("image", "strength", "num_inference_steps"), e


def test_still_serves_after_hostile_input(sd):
    out = sd.generate("a fox", {"image": picture(2), "seed": 1}, use_tqdm=False)[0]
    assert pixels(out).shape == (64, 64, 3)


def test_a_text_only_stage_refuses_an_image_at_validate():
    with Omni("tiny-pixart", torch_threads=1) as omni:
        with pytest.raises(InvalidRequestError, match="does not take `image`") as info:
            omni.generate("a fox", {"image": picture(1)}, use_tqdm=False)
        assert info.value.param == "image"
        assert omni.generate("a fox", {"seed": 1}, use_tqdm=False)[0].error is None


def test_a_controlnet_directory_is_refused_at_startup(tmp_path: Path):
    import diffusers

    from omni_runtime.models.builtin import ensure_builtin

    base = diffusers.StableDiffusionPipeline.from_pretrained(ensure_builtin("tiny-sd"), local_files_only=True)
    controlnet = diffusers.ControlNetModel.from_unet(base.unet)
    diffusers.StableDiffusionControlNetPipeline(**base.components, controlnet=controlnet).save_pretrained(
        tmp_path / "cn"
    )
    with pytest.raises(OmniError, match="needs a per-request conditioning image"):
        Omni(str(tmp_path / "cn"))
