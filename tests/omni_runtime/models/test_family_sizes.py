"""Every builtin image and video family's size rules, held against its tiny model.

A family reports its sizes at READY (the size step, the longest side, the most pixels), and
``params.check_constraints`` refuses before queueing what they rule out. The rules were found by
running each tiny model at the edges: a side past a positional table fails inside the denoiser
(SD3's ``pos_embed_max_size``: ``Width (128) cannot be greater than `pos_embed_max_size`: 64``;
Wan's rotary table: a reshape error), while every family ran its smallest step and any aspect
ratio within its pixel limit (8 x 2048 on the 64 px models), so neither is bounded further. The
pixel limit is 4 x the native area (the stage's default size where the configs state none).

The property, per family: a size the check accepts runs in the tiny model (text, and each
image-input form the family has, the input image setting the size), and a size it refuses is an
``InvalidRequestError`` naming the size's field, or ``image`` when an input image set it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.bounds import MAX_SIDE, MIN_SIDE
from omni_runtime.config import load_config
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints
from omni_runtime.models.families import families
from omni_runtime.params import DiffusionSamplingParams, check_constraints, resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.helpers import diffusion_params

pytestmark = pytest.mark.integration

NOT_ABORTED = ExecuteContext(lambda rid: False)

#: Every image and video family, by its tiny builtin.
SPECS = {f.tiny: f for f in families() if f.tiny and f.output in ("image", "video")}
FAMILIES = sorted(SPECS)

#: The longest side of the tiny models whose denoiser has a positional table; the others compute
#: their positions for any size.
LONGEST = {
    "tiny-sd3": 64 * 2 * 2,  # pos_embed_max_size 64 x patch 2 x VAE factor 2
    "tiny-wan": 32 * 16,  # rope_max_seq_len 32 x (VAE factor 8 x patch 2)
}

#: Sides that every family meets somewhere: each power of two the bounds allow.
LADDER = tuple(2**k for k in range(3, 13))


@pytest.fixture(scope="module")
def loaded(model_cache: Path) -> dict[str, DiffusionRunner]:
    """Each tiny model, loaded once for the module (on first use) from its bundled config."""
    return {}


def runner_of(loaded: dict[str, DiffusionRunner], name: str) -> DiffusionRunner:
    if name not in loaded:
        runner = DiffusionRunner(load_config(name).stage_args[0])
        runner.load()
        loaded[name] = runner
    return loaded[name]


def forms(c: StageConstraints) -> list[str]:
    """The request forms a stage takes: text, and img2img / image-to-video and inpainting if it has them."""
    return [
        "text",
        *(["image"] if "image" in c.image_inputs else []),
        *(["mask"] if "mask_image" in c.image_inputs else []),
    ]


def request_params(c: StageConstraints, form: str, h: int, w: int) -> dict[str, Any]:
    """A request of ``form`` at ``h`` x ``w`` that runs one denoising step (the input image sets
    the size of an image form)."""
    params: dict[str, Any] = {"num_inference_steps": 1, "seed": 0, "output_type": "np"}
    if c.frames_step is not None:
        params["num_frames"] = c.frames_step + 1
    if form == "text":
        return params | {"height": h, "width": w}
    params["image"] = np.full((h, w, 3), 128, np.uint8)
    if form == "mask":
        params["mask_image"] = np.full((h, w), 255, np.uint8)
    if (c.default_strength or {}).get("inpaint" if form == "mask" else "image") is not None:
        params["strength"] = 1.0  # one step of one
    return params


def run(runner: DiffusionRunner, params: dict[str, Any]) -> RunnerOutput:
    request = RunnerRequest(request_id="r", prompt="a boat", params=diffusion_params(params))
    (out,) = runner.execute([request], NOT_ABORTED)
    return out


def made_size(out: RunnerOutput) -> tuple[int, int]:
    made = out.tensors["videos"] if "videos" in out.tensors else out.tensors["images"]
    return int(made.shape[-3]), int(made.shape[-2])


@st.composite
def sizes(draw: st.DrawFn, c: StageConstraints) -> tuple[int, int]:
    """(height, width): a short side of one to four steps and a long one at the longest the
    reported rules allow with it (the simplest example), a little past it, on the ladder, or anywhere."""
    step = c.size_multiple or 8
    short = draw(st.integers(1, 4)) * step
    cap = min(c.max_side or MAX_SIDE, (c.max_pixels or MAX_SIDE**2) // short, MAX_SIDE)
    cap -= cap % step
    long = draw(
        st.one_of(
            st.sampled_from([cap, cap + step, cap + 1]),
            st.sampled_from(LADDER),
            st.integers(MIN_SIDE, MAX_SIDE),
        )
    )
    long = min(max(long, MIN_SIDE), MAX_SIDE)
    return (long, short) if draw(st.booleans()) else (short, long)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_tiny_model_reports_its_rules(loaded: dict[str, DiffusionRunner], name: str) -> None:
    """The size step and 4 x the native area (for Wan and LTX, whose configs state no size, the
    bundled config's default 32 x 32 that the spec's native size records), and the longest side."""
    spec, c = SPECS[name], runner_of(loaded, name).constraints()
    assert (c.size_multiple, c.max_pixels) == (spec.size_multiple, 4 * spec.native_size**2)
    assert c.max_side == LONGEST.get(name)
    assert (c.max_side is None) == (c.max_side_reason is None)


@pytest.mark.parametrize("name", FAMILIES)
@given(data=st.data())
@settings(max_examples=8, deadline=None)
def test_an_accepted_size_runs_and_a_refused_one_names_its_field(
    loaded: dict[str, DiffusionRunner], name: str, data: st.DataObject
) -> None:
    runner = runner_of(loaded, name)
    c = runner.constraints()
    form = data.draw(st.sampled_from(forms(c)), label="form")
    h, w = data.draw(sizes(c), label="height, width")
    defaults = load_config(name).stage_args[0].default_sampling_params
    try:
        params = resolve_params(DiffusionSamplingParams, defaults, request_params(c, form, h, w))
        check_constraints(params, c)
    except InvalidRequestError as e:
        assert e.param in (("height", "width", "size") if form == "text" else ("image",)), e
        return
    out = run(runner, params)
    assert out.error is None, f"{name} {form} {w}x{h} (WxH) was accepted and failed: {out.error!r}"
    assert made_size(out) == (h, w)


@pytest.mark.parametrize("name", sorted(LONGEST))
def test_one_step_past_the_longest_side_fails_inside_the_model(loaded: dict[str, DiffusionRunner], name: str) -> None:
    """The longest side is the model's own edge: it runs, and a step past it fails in the denoiser
    unless refused first (the pixel limit lifted, so only the side rule stands)."""
    runner = runner_of(loaded, name)
    c = msgspec.structs.replace(runner.constraints(), max_pixels=None)
    step, longest = c.size_multiple or 8, c.max_side or 0
    edge = request_params(c, "text", step, longest)
    check_constraints(edge, c)
    assert run(runner, edge).error is None
    past = request_params(c, "text", step, longest + step)
    with pytest.raises(InvalidRequestError, match=f"more than the {longest} pixels a side may have") as info:
        check_constraints(past, c)
    assert info.value.param == "width"
    with pytest.raises((RuntimeError, ValueError)):  # the positional table, inside the model
        failed = run(runner, past).error
        if failed is not None:
            raise failed
    image = request_params(c, "image", longest + step, step)
    with pytest.raises(InvalidRequestError, match="the input image's height") as info:
        check_constraints(diffusion_params(image), c)
    assert info.value.param == "image"


def test_the_split_denoiser_is_bounded_by_four_times_the_native_area(model_cache: Path) -> None:
    """tiny-sd as three stages bounds its sizes as tiny-sd does (it had a flat 2048 x 2048)."""
    from omni_runtime.models.families.sd.split import SDDenoiseRunner

    stage = load_config("tiny-sd-split").stage_args[1]
    runner = SDDenoiseRunner(stage)
    runner.load()
    c = runner.constraints()
    assert (c.size_multiple, c.max_pixels, c.native_size) == (8, 4 * 64 * 64, (64, 64))
    with pytest.raises(InvalidRequestError, match=r"16384 pixels .*made for 64x64") as info:
        check_constraints({"height": 256, "width": 256}, c)
    assert info.value.param == "size"
