"""The Wan text- and image-to-video family: its tiny builtin, served by DiffusionRunner and end
to end.

The runner makes videos (``frames``) with the family's frame rule (4k + 1) and size step (VAE
spatial factor 8 x patch 2) reported as constraints; a fused batch equals its requests run alone
(within float tolerance); ``Omni("tiny-wan")`` returns videos that save as MP4 files a player
reads back with the frames, size and rate asked for. With an ``image`` the same model makes a
video from that first frame (Wan 2.2 TI2V's way: the image's latent is the first latent frame),
each such request a pipeline call of its own.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import av
import msgspec
import numpy as np
import pytest
from diffusers import WanImageToVideoPipeline
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime import Omni
from omni_runtime.config import StageConfig, load_config
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.media import VideoItem
from omni_runtime.messages import StageConstraints
from omni_runtime.models.builtin import builder
from omni_runtime.models.families import GOLDEN_PARAMS, GOLDEN_PROMPT, family
from omni_runtime.models.families.wan import wan_limits
from omni_runtime.params import check_constraints
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.helpers import diffusion_params

pytestmark = pytest.mark.integration

NOT_ABORTED = ExecuteContext(lambda rid: False)
SPEC = family("wan")


@pytest.fixture(scope="module")
def runner(model_cache: Path) -> DiffusionRunner:
    stage = msgspec.convert({"stage_id": 0, "stage_type": "diffusion", "model": "builtin:tiny-wan"}, StageConfig)
    r = DiffusionRunner(stage)
    r.load()
    return r


def req(rid: str, prompt: str = "a boat", **params: Any) -> RunnerRequest:
    defaults = dict(load_config("tiny-wan").stage_args[0].default_sampling_params)
    return RunnerRequest(request_id=rid, prompt=prompt, params=diffusion_params({**defaults, **params}))


def run(runner: DiffusionRunner, *requests: RunnerRequest) -> list[RunnerOutput]:
    outs = runner.execute(list(requests), NOT_ABORTED)
    assert len(outs) == len(requests) and all(o.error is None for o in outs), [o.error for o in outs]
    return outs


def test_builder_is_offline_deterministic_and_small(tmp_path: Path) -> None:
    build = builder("tiny-wan")
    build(tmp_path / "a")
    build(tmp_path / "b")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert json.loads((tmp_path / "a" / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    assert sum((tmp_path / "a" / n).stat().st_size for n in files) < 5e6


def test_the_model_reports_its_frame_rule_and_size_step(runner: DiffusionRunner) -> None:
    c = runner.constraints()
    assert c.size_multiple == SPEC.size_multiple == 16
    assert c.size_multiple_reason == "the VAE spatial factor 8 x the WanTransformer3DModel patch size 2"
    assert c.frames_step == 4 and "4x" in (c.frames_reason or "")
    assert c.max_frames == (32 - 1) * 4 + 1  # the tiny transformer's 32-entry rotary table
    assert c.image_inputs == ("image",)  # image to video: the first frame


def test_videos_have_the_requested_frames_size_and_rate(runner: DiffusionRunner) -> None:
    (out,) = run(runner, req("a", seed=1, num_frames=5, height=16, width=48, fps=8))
    (video,) = out.media
    assert isinstance(video, VideoItem) and (video.fps, video.seed) == (8, 1)
    assert video.frames.shape == (5, 16, 48, 3) and video.frames.dtype == np.uint8
    assert video.frames.std() > 0
    (plain,) = run(runner, req("b", seed=1)).pop().media
    assert isinstance(plain, VideoItem) and plain.fps == SPEC.fps and plain.frames.shape == (9, 32, 32, 3)


def test_batch_key_holds_frames_and_size_but_not_fps_or_seed(runner: DiffusionRunner) -> None:
    key = runner.batch_key(req("a", seed=1, fps=8))
    assert runner.batch_key(req("b", "a cat", seed=2, fps=24)) == key
    for change in ({"num_frames": 13}, {"height": 48}, {"num_inference_steps": 2}):
        assert runner.batch_key(req("c", **change)) != key, change


@pytest.mark.parametrize("output_type", ["latent", "pil"])
def test_a_fused_batch_equals_each_request_run_alone(runner: DiffusionRunner, output_type: str) -> None:
    batch = [req(f"r{i}", p, seed=10 + i, output_type=output_type) for i, p in enumerate(["a boat", "a red car"])]
    fused = run(runner, *batch)
    for request, out in zip(batch, fused, strict=True):
        (solo,) = run(runner, request)
        assert out.metrics["batch_size"] == 2 and out.metrics["seed"] == solo.metrics["seed"]
        if output_type == "latent":
            np.testing.assert_allclose(out.tensors["latents"], solo.tensors["latents"], rtol=0, atol=1e-4)
        else:
            a, b = (np.asarray(o.media[0].data, dtype=int) for o in (out, solo))
            assert np.abs(a - b).max() <= 2
    first, second = (np.asarray(o.media[0].data if o.media else o.tensors["latents"], float) for o in fused)
    assert np.abs(first - second).max() > 0.05  # split per request, not one video twice


def frame_image(rgb: tuple[int, int, int], height: int = 32, width: int = 48) -> np.ndarray:
    image = np.zeros((height, width, 3), np.uint8)
    image[...] = rgb
    image[: height // 2, : width // 3] = 255 - np.asarray(rgb)  # a corner of another colour
    return image


def test_the_image_form_is_wan_image_to_video_sharing_the_weights(runner: DiffusionRunner) -> None:
    assert runner._forms is not None
    form = runner._forms.forms["image"]
    assert isinstance(form.pipe, WanImageToVideoPipeline) and form.single_image
    assert form.pipe.config.expand_timesteps and form.pipe.image_encoder is None
    assert form.pipe.transformer is runner.pipe.transformer and form.pipe.vae is runner.pipe.vae
    assert not runner.pipe.config.expand_timesteps  # text to video runs as before


def test_image_to_video_starts_from_the_image_and_runs_each_request_alone(runner: DiffusionRunner) -> None:
    red, blue = frame_image((255, 0, 0)), frame_image((0, 0, 255))
    batch = [req(k, seed=1, num_frames=5, image=im, height=32, width=48) for k, im in (("r", red), ("b", blue))]
    assert runner.batch_key(batch[0]) == runner.batch_key(batch[1])  # queued together...
    together = run(runner, *batch)
    assert [o.metrics["batch_size"] for o in together] == [1, 1]  # ...one pipeline call each
    videos = [o.media[0].frames.astype(int) for o in together]
    assert all(v.shape == (5, 32, 48, 3) for v in videos)
    assert np.abs(videos[0][0] - videos[1][0]).mean() > 0.1  # the first frame reflects the image
    (alone,) = run(runner, batch[0])
    np.testing.assert_array_equal(alone.media[0].frames, together[0].media[0].frames)
    (text,) = run(runner, req("t", seed=1, num_frames=5, height=32, width=48))
    assert np.abs(text.media[0].frames.astype(int)[0] - videos[0][0]).mean() > 0.1


def test_a_transformer_no_first_frame_fits_is_refused_when_made(runner: DiffusionRunner) -> None:
    from diffusers import WanTransformer3DModel

    from omni_runtime.models.families.wan.i2v import WanFirstFrameToVideoPipeline
    from omni_runtime.models.families.wan.tiny import TRANSFORMER

    odd = WanTransformer3DModel(**{**TRANSFORMER, "in_channels": 5})
    with pytest.raises(ValueError, match=r"5 input channels: a first frame needs 4 .* or 12"):
        WanFirstFrameToVideoPipeline(**{**runner.pipe.components, "transformer": odd})


def size_constraints(rope: int, max_pixels: int | None) -> StageConstraints:
    """What a Wan model with a ``rope``-position rotary table reports (its limits hook on a stand-in
    pipeline: it reads attributes only)."""
    config = type("Config", (), {"patch_size": (1, 2, 2), "rope_max_seq_len": rope})
    pipe = type("Pipe", (), {"vae_scale_factor_spatial": 8, "vae_scale_factor_temporal": 4})()
    pipe.transformer = type("WanTransformer3DModel", (), {"config": config})()  # type: ignore[attr-defined]
    limits = wan_limits(pipe)
    return StageConstraints(
        size_multiple=limits.multiple, max_side=limits.max_side, max_pixels=max_pixels, frames_step=4
    )


@given(
    h=st.integers(8, 4096),
    w=st.integers(8, 4096),
    rope=st.sampled_from([32, 1024]),
    max_pixels=st.sampled_from([None, 4096, 832 * 480]),
    image=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_an_accepted_size_fits_the_rotary_table_on_each_axis(
    h: int, w: int, rope: int, max_pixels: int | None, image: bool
) -> None:
    """Each axis of 16-pixel patches takes positions from the transformer's rotary table: a side
    past ``rope x 16`` failed inside the model (32 x 1024 with tiny-wan's 32 positions), so it is
    refused before queueing, naming the side (or the input image that sets it)."""
    params: dict[str, Any] = {"height": h, "width": w, "num_frames": 5}
    if image:
        params["image"] = np.zeros((1, 1, 3), np.uint8)  # only its presence matters to this check
    try:
        check_constraints(params, size_constraints(rope, max_pixels))
    except InvalidRequestError as e:
        assert e.param in (("image",) if image else ("height", "width", "size")), e
        return
    assert h % 16 == 0 and w % 16 == 0 and h // 16 <= rope and w // 16 <= rope
    assert max_pixels is None or h * w <= max_pixels


def test_sizes_are_bounded_by_four_times_the_default_area_and_the_rotary_table(runner: DiffusionRunner) -> None:
    c = runner.constraints()
    assert c.max_side == 32 * 16 and "rotary" in (c.max_side_reason or "")
    # Wan's configs state no native size: the stage's default size (32 x 32 in the bundled
    # config) stands for it (a fact of the config, known before any load).
    assert DiffusionRunner(load_config("tiny-wan").stage_args[0]).max_pixels() == 4 * 32 * 32


def test_the_sizes_at_the_edges_of_the_rule_run(runner: DiffusionRunner) -> None:
    """Every accepted size runs: the longest sides the default area allows, and (with the area
    unbounded) the longest the rotary table allows, each as text and as image to video."""
    unbounded = msgspec.structs.replace(runner.constraints(), max_pixels=None)
    for h, w in ((16, 256), (256, 16), (32, 512)):
        if (h, w) != (32, 512):
            check_constraints({"height": h, "width": w}, runner.constraints())
        check_constraints({"height": h, "width": w}, unbounded)
        fast = {"num_frames": 5, "num_inference_steps": 1, "seed": 1, "height": h, "width": w}
        text, first = run(runner, req("t", **fast), req("i", image=frame_image((0, 9, 0), h, w), **fast))
        assert text.media[0].frames.shape == first.media[0].frames.shape == (5, h, w, 3)
    with pytest.raises(InvalidRequestError):  # one patch more than the table fails in the model
        check_constraints({"height": 32, "width": 528}, unbounded)


def test_golden_slice(runner: DiffusionRunner) -> None:
    (out,) = run(runner, req("golden", GOLDEN_PROMPT, **GOLDEN_PARAMS))
    got = [round(float(v), 4) for v in out.tensors["videos"][0, -1, -3:, -3:, -1].flatten()]
    np.testing.assert_allclose(got, SPEC.golden, rtol=0, atol=1e-3, err_msg=f"tiny-wan made {got}")


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def omni(model_cache: Path) -> Any:
    with Omni("tiny-wan", torch_threads=1) as engine:  # one torch thread (see model_cache)
        yield engine


def test_python_api_makes_a_video_that_saves_as_mp4(omni: Any, tmp_path: Path) -> None:
    (out,) = omni.generate("a boat", {"num_frames": 9, "fps": 8, "seed": 1}, use_tqdm=False)
    assert out.error is None and out.images == []
    video = out.videos[0]
    assert video.frames.shape == (9, 32, 32, 3) and video.frames.dtype == np.uint8 and video.fps == 8
    video.save(tmp_path / "boat.mp4")
    with av.open(io.BytesIO((tmp_path / "boat.mp4").read_bytes())) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert stream.average_rate == 8 and stream.codec_context.name == "h264"
    assert len(frames) == 9 and all(f.shape == (32, 32, 3) for f in frames)


@pytest.mark.parametrize(
    ("params", "param", "match"),
    [
        ({"num_frames": 8}, "num_frames", r"8 is not of the form 4k\+1 .*nearest are 5 and 9"),
        ({"num_frames": 129}, "num_frames", "more than the 125"),
        ({"height": 40}, "height", "not a multiple of 16 .*patch size 2"),
        ({"fps": 0}, "fps", ">= 1"),
        # Sizes that passed the checks and failed in the model (issue 35): past the area and the rotary table.
        ({"height": 32, "width": 1024}, "width", "more than the 512 pixels a side may have"),
        ({"height": 1024, "width": 32}, "height", "more than the 512 pixels a side may have"),
        ({"height": 64, "width": 256}, "size", "exceeds this stage's limit of 4096 pixels"),
        ({"height": 16, "width": 4096}, "width", "more than the 512 pixels a side may have .*rotary table"),
        ({"image": frame_image((0, 9, 0), 16, 2048)}, "image", "more than the 512 pixels"),
        ({"image": frame_image((0, 9, 0), 2048, 2048)}, "image", "more than the 512 pixels"),
        ({"image": frame_image((0, 9, 0), 64, 128)}, "image", "more than this stage's limit of 4096 pixels"),
    ],
)
def test_bad_video_params_are_refused_before_queueing(omni: Any, params: dict, param: str, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        omni.generate("a boat", params, use_tqdm=False)
    assert info.value.param == param


def test_batched_videos_equal_their_solo_videos(omni: Any) -> None:
    prompts = ["a boat", "a sailing boat at sea"]
    together = omni.generate(prompts, {"seed": 3}, use_tqdm=False)
    assert [o.metrics["batch_size"] for o in together] == [2, 2]
    for prompt, fused in zip(prompts, together, strict=True):
        (solo,) = omni.generate(prompt, {"seed": 3}, use_tqdm=False)
        diff = np.abs(fused.videos[0].frames.astype(int) - solo.videos[0].frames.astype(int))
        assert diff.max() <= 2


def test_python_api_makes_a_video_from_a_first_frame(omni: Any) -> None:
    image = frame_image((0, 200, 0), height=48, width=32)
    (out,) = omni.generate("a boat", {"image": image, "num_frames": 5, "seed": 2}, use_tqdm=False)
    assert out.error is None and out.videos[0].frames.shape == (5, 48, 32, 3)  # the image's size
    (again,) = omni.generate("a boat", {"image": image, "num_frames": 5, "seed": 2}, use_tqdm=False)
    np.testing.assert_array_equal(again.videos[0].frames, out.videos[0].frames)
    with pytest.raises(InvalidRequestError, match="multiple of 16") as info:
        omni.generate("a boat", {"image": frame_image((0, 200, 0), height=40), "num_frames": 5}, use_tqdm=False)
    assert info.value.param == "image"
