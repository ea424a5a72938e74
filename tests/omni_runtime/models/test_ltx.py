"""The LTX-Video family: its tiny builtin, served by DiffusionRunner and end to end, and the
video memory bound (``engine_args.max_video_pixels``) and VAE tiling/slicing options.

The runner makes videos with LTX's frame rule (8k + 1) and size step (32), passes a request's fps
as the pipeline's ``frame_rate``, runs a fused wave past the memory bound in parts that fit, and a
tiled VAE decode stays close to the untiled one; ``Omni("tiny-ltx")`` refuses a video past the
bound before it is queued, naming the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from omni_runtime import Omni
from omni_runtime.config import EngineArgs, StageConfig, load_config
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.media import VideoItem
from omni_runtime.models.builtin import builder, builtin_names
from omni_runtime.models.families import GOLDEN_PARAMS, GOLDEN_PROMPT, family
from omni_runtime.params import check_constraints
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner, apply_engine_options
from tests.helpers import diffusion_params

pytestmark = pytest.mark.integration

NOT_ABORTED = ExecuteContext(lambda rid: False)
SPEC = family("ltx")
#: Two 9-frame 32 x 32 videos: a wave of three runs as two and one.
VIDEO_PIXELS = 2 * 9 * 32 * 32


@pytest.fixture(scope="module")
def runner(model_cache: Path) -> DiffusionRunner:
    stage = msgspec.convert(
        {
            "stage_id": 0,
            "stage_type": "diffusion",
            "model": "builtin:tiny-ltx",
            "engine_args": {"max_video_pixels": VIDEO_PIXELS},
        },
        StageConfig,
    )
    r = DiffusionRunner(stage)
    r.load()
    return r


def req(rid: str, prompt: str = "a boat", **params: Any) -> RunnerRequest:
    defaults = dict(load_config("tiny-ltx").stage_args[0].default_sampling_params)
    return RunnerRequest(request_id=rid, prompt=prompt, params=diffusion_params({**defaults, **params}))


def run(runner: DiffusionRunner, *requests: RunnerRequest) -> list[RunnerOutput]:
    outs = runner.execute(list(requests), NOT_ABORTED)
    assert len(outs) == len(requests) and all(o.error is None for o in outs), [o.error for o in outs]
    return outs


def test_builder_is_offline_deterministic_and_small(tmp_path: Path) -> None:
    build = builder("tiny-ltx")
    build(tmp_path / "a")
    build(tmp_path / "b")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert json.loads((tmp_path / "a" / "model_index.json").read_text())["_class_name"] == "LTXPipeline"
    assert sum((tmp_path / "a" / n).stat().st_size for n in files) < 2e6
    assert "tiny-ltx" in builtin_names()


def test_the_model_reports_its_frame_rule_size_step_and_memory_bound(runner: DiffusionRunner) -> None:
    c = runner.constraints()
    assert c.size_multiple == SPEC.size_multiple == 32
    assert c.size_multiple_reason == (
        "the VAE spatial compression 8 x the LTXVideoTransformer3DModel patch size 1, "
        "and the pipeline takes multiples of 32 only"
    )
    assert c.frames_step == 8 and "8x" in (c.frames_reason or "") and c.max_frames is None
    assert c.max_video_pixels == VIDEO_PIXELS


def test_videos_have_the_requested_frames_size_and_rate(runner: DiffusionRunner) -> None:
    (out,) = run(runner, req("a", seed=1, num_frames=17, height=32, width=64, fps=8))
    (video,) = out.media
    assert isinstance(video, VideoItem) and (video.fps, video.seed) == (8, 1)
    assert video.frames.shape == (17, 32, 64, 3) and video.frames.dtype == np.uint8
    assert video.frames.std() > 0
    (plain,) = run(runner, req("b", seed=1)).pop().media
    assert isinstance(plain, VideoItem) and plain.fps == SPEC.fps and plain.frames.shape == (9, 32, 32, 3)


def test_fps_is_the_pipelines_frame_rate_so_it_is_in_the_batch_key(runner: DiffusionRunner) -> None:
    key = runner.batch_key(req("a", seed=1, fps=24))
    assert runner.batch_key(req("b", "a cat", seed=2, fps=24)) == key
    for change in ({"fps": 8}, {"num_frames": 17}, {"height": 64}, {"num_inference_steps": 2}):
        assert runner.batch_key(req("c", **change)) != key, change
    slow, fast = (run(runner, req(f"f{fps}", seed=1, fps=fps, output_type="np"))[0] for fps in (8, 24))
    assert np.abs(slow.tensors["videos"] - fast.tensors["videos"]).max() > 1e-3  # LTX's positions move


def test_a_wave_past_the_memory_bound_runs_in_parts_that_fit(runner: DiffusionRunner) -> None:
    batch = [req(f"r{i}", p, seed=10 + i, output_type="np") for i, p in enumerate(["a boat", "a red car", "a fox"])]
    assert runner.video_batch_cap(batch[0].params) == 2
    fused = run(runner, *batch)
    assert [o.metrics["batch_size"] for o in fused] == [2, 2, 1]
    for request, out in zip(batch, fused, strict=True):
        (solo,) = run(runner, request)
        np.testing.assert_allclose(out.tensors["videos"], solo.tensors["videos"], rtol=0, atol=1e-4)
    assert np.abs(fused[0].tensors["videos"] - fused[1].tensors["videos"]).max() > 0.05


def test_golden_slice(runner: DiffusionRunner) -> None:
    (out,) = run(runner, req("golden", GOLDEN_PROMPT, **GOLDEN_PARAMS))
    got = [round(float(v), 4) for v in out.tensors["videos"][0, -1, -3:, -3:, -1].flatten()]
    assert SPEC.golden, f"no golden slice stored; this run made {got}"
    np.testing.assert_allclose(got, SPEC.golden, rtol=0, atol=1e-3, err_msg=f"tiny-ltx made {got}")


def test_vae_tiling_and_slicing_are_applied_and_a_tiled_decode_stays_close(runner: DiffusionRunner) -> None:
    vae = runner.pipe.vae
    params = {"seed": 0, "output_type": "np", "height": 128, "width": 128}
    (whole,) = run(runner, req("whole", **params))
    try:
        applied = apply_engine_options(runner.pipe, EngineArgs(vae_tiling=True, vae_slicing=True))
        assert applied == ["VAE tiling", "VAE slicing"] and vae.use_tiling and vae.use_slicing
        # The default tiles (512 px) are larger than this video: the decode is the untiled one.
        (untouched,) = run(runner, req("untouched", **params))
        np.testing.assert_array_equal(untouched.tensors["videos"], whole.tensors["videos"])
        # Tiles smaller than the frame: 2 x 2 tiles of 96 px every 64 px, blended where they overlap.
        tile = {"tile_sample_min_height": 96, "tile_sample_min_width": 96}
        vae.enable_tiling(**tile, tile_sample_stride_height=64, tile_sample_stride_width=64)
        (tiled,) = run(runner, req("tiled", **params))
    finally:
        vae.disable_tiling()
        vae.disable_slicing()
    diff = np.abs(tiled.tensors["videos"] - whole.tensors["videos"])
    assert diff.max() > 0  # the tiled path really ran
    # A random-weight VAE's norms see each tile alone, so tiles differ more than a trained VAE's
    # would; the video still agrees on average to a few percent of its range.
    assert diff.mean() < 0.04, diff.mean()


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def omni(model_cache: Path) -> Any:
    with Omni("tiny-ltx", torch_threads=1) as engine:  # one torch thread (see model_cache)
        yield engine


def test_python_api_makes_batched_videos_equal_to_solo_ones(omni: Any) -> None:
    prompts = ["a boat", "a sailing boat at sea"]
    together = omni.generate(prompts, {"seed": 3, "fps": 8}, use_tqdm=False)
    assert [o.metrics["batch_size"] for o in together] == [2, 2]
    for prompt, fused in zip(prompts, together, strict=True):
        video = fused.videos[0]
        assert video.frames.shape == (9, 32, 32, 3) and video.fps == 8
        (solo,) = omni.generate(prompt, {"seed": 3, "fps": 8}, use_tqdm=False)
        assert np.abs(video.frames.astype(int) - solo.videos[0].frames.astype(int)).max() <= 2


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"num_frames": 13}, r"13 is not of the form 8k\+1 .*8x.*nearest are 9 and 17"),
        ({"height": 48}, r"48 is not a multiple of 32 .*takes multiples of 32 only"),
        (
            {"num_frames": 41, "height": 64, "width": 64},
            r"num_frames x height x width = 41 x 64 x 64 = 167936 exceeds this stage's limit of 135168 "
            r"\(engine_args.max_video_pixels\)",
        ),
        (
            {"num_frames": 33, "height": 64, "width": 64, "num_images_per_prompt": 2},
            r"x num_images_per_prompt = 33 x 64 x 64 x 2 = 270336 exceeds",
        ),
    ],
)
def test_bad_video_params_are_refused_before_queueing(omni: Any, params: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        omni.generate("a boat", params, use_tqdm=False)
    assert info.value.param == ("height" if "height" in params and len(params) == 1 else "num_frames")


def test_the_memory_bound_checks_each_request_on_its_own(runner: DiffusionRunner) -> None:
    c = runner.constraints()
    check_constraints({"num_frames": 17, "height": 32, "width": 32}, c)  # exactly the bound
    with pytest.raises(InvalidRequestError, match="max_video_pixels"):
        check_constraints({"num_frames": 25, "height": 32, "width": 32}, c)
    check_constraints({"num_frames": 9}, c)  # size unknown here: left to the defaults' check
