"""Image inputs in the diffusion runner: img2img and inpainting for every builtin family that has
those pipelines in diffusers, served from the text-to-image model directory (forms made with
``from_pipe``) and from an img2img model directory; pipelines with inputs the runtime cannot
supply are refused at load.

Per family: the result equals diffusers' own pipeline loaded from the same directory and called
with the same seed (within float tolerance), strength and the input image change the output, a
fused batch equals its requests run alone, and image j of a request uses seed + j.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from omni_runtime.config import StageConfig, load_config
from omni_runtime.exceptions import ConfigError, InvalidRequestError
from omni_runtime.models.builtin import ensure_builtin
from omni_runtime.models.families import families
from omni_runtime.params import DiffusionSamplingParams, check_constraints, resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner

NOT_ABORTED = ExecuteContext(lambda rid: False)
#: Builtin family -> (its img2img pipeline, its inpainting pipeline or None: SD3's takes 16-channel
#: transformers only, and the tiny one has 4), from the family registry. Image families only: a
#: video family's image form (image to video) is tested with the family (test_wan.py).
FAMILIES = {
    f.tiny: (
        f.image_forms["image"],
        None if f.image_forms.get("mask") in f.form_channels else f.image_forms.get("mask"),
    )
    for f in families()
    if f.tiny and f.image_forms.get("image") and f.output == "image"
}
SIZE = 64


def picture(seed: int, size: tuple[int, int] = (SIZE, SIZE)) -> np.ndarray:
    """A smooth image (a gradient plus a disc) so a VAE sees structure, not only noise."""
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    r, g, b = rng.integers(0, 255, 3)
    disc = ((y - h / 2) ** 2 + (x - w / 3) ** 2) < (min(h, w) / 4) ** 2
    img = np.stack([(x * r / w), (y * g / h), np.where(disc, b, 255 - b)], axis=-1)
    return img.astype(np.uint8)


MASK = np.zeros((SIZE, SIZE), np.uint8)
MASK[16:48, 8:40] = 255


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def name(request: pytest.FixtureRequest) -> str:
    return request.param


def make_runner(model: str) -> DiffusionRunner:
    stage = msgspec.convert({"stage_id": 0, "stage_type": "diffusion", "model": model}, StageConfig)
    runner = DiffusionRunner(stage)
    runner.load()
    return runner


@pytest.fixture(scope="module")
def runner(cache: Path, name: str) -> DiffusionRunner:
    return make_runner(f"builtin:{name}")


def defaults(name: str) -> dict[str, Any]:
    return dict(load_config(name).stage_args[0].default_sampling_params)


def req(name: str, rid: str, prompt: str = "a red fox", **params: Any) -> RunnerRequest:
    """A request as the caller makes it: params resolved over the bundled defaults (the image's
    size becomes height/width)."""
    resolved = resolve_params(DiffusionSamplingParams, defaults(name), {"output_type": "np", **params})
    return RunnerRequest(request_id=rid, prompt=prompt, params=resolved)


def run(runner: DiffusionRunner, *requests: RunnerRequest) -> list[RunnerOutput]:
    outs = runner.execute(list(requests), NOT_ABORTED)
    assert len(outs) == len(requests)
    return outs


def floats(out: RunnerOutput) -> np.ndarray:
    assert out.error is None, out.error
    return out.tensors["images"]


def direct(pipe_cls: str, model_dir: str, name: str, seed: int, **call: Any) -> np.ndarray:
    """diffusers' own pipeline, loaded from the same directory, called as a user would."""
    import diffusers

    pipe = getattr(diffusers, pipe_cls).from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    params = defaults(name)
    args = {
        "prompt": "a red fox",
        "num_inference_steps": params["num_inference_steps"],
        "guidance_scale": params["guidance_scale"],
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "np",
        **call,
    }
    if "height" in inspect.signature(type(pipe).__call__).parameters:  # Flux and SD3 img2img resize to it
        args["height"], args["width"] = call["image"].height, call["image"].width
    with torch.inference_mode():
        return pipe(**args).images


# ---------------------------------------------------------------------------- forms


def test_forms_and_capabilities(runner: DiffusionRunner, name: str) -> None:
    img2img, inpaint = FAMILIES[name]
    forms = runner._forms.forms
    assert type(forms["text"].pipe).__name__ == type(runner.pipe).__name__
    assert type(forms["image"].pipe).__name__ == img2img
    # Shared components: no second copy of the weights.
    assert forms["image"].pipe.vae is runner.pipe.vae
    c = runner.constraints()
    assert c.requires_image is None
    if inpaint:
        assert type(forms["inpaint"].pipe).__name__ == inpaint and c.image_inputs == ("image", "mask_image")
    else:
        assert "inpaint" not in forms and c.image_inputs == ("image",)
        assert "16 or 33 input channels" in (c.image_inputs_note or "")


def test_img2img_equals_diffusers_own_pipeline(runner: DiffusionRunner, name: str, cache: Path) -> None:
    image = picture(1)
    ours = floats(run(runner, req(name, "a", image=image, strength=0.7, seed=11))[0])
    theirs = direct(FAMILIES[name][0], runner._model_dir, name, 11, image=Image.fromarray(image), strength=0.7)
    assert ours.shape == theirs.shape == (1, SIZE, SIZE, 3)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)


def test_inpainting_equals_diffusers_own_pipeline(runner: DiffusionRunner, name: str) -> None:
    pipe_cls = FAMILIES[name][1]
    image = picture(2)
    if pipe_cls is None:  # tiny-sd3: refused before the queue, naming the mask
        with pytest.raises(InvalidRequestError, match="16 or 33 input channels") as info:
            check_constraints(req(name, "a", image=image, mask_image=MASK).params, runner.constraints())
        assert info.value.param == "mask_image"
        return
    ours = floats(run(runner, req(name, "a", image=image, mask_image=MASK, seed=5))[0])
    theirs = direct(
        pipe_cls, runner._model_dir, name, 5, image=Image.fromarray(image), mask_image=Image.fromarray(MASK)
    )
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)
    # Only the masked region may change much: outside it, the input shows through.
    text = floats(run(runner, req(name, "b", seed=5))[0])
    assert np.abs(ours - text).max() > 0.05


def test_strength_and_the_image_change_the_output(runner: DiffusionRunner, name: str) -> None:
    image = picture(3)
    base = floats(run(runner, req(name, "a", image=image, strength=0.5, seed=1))[0])
    stronger = floats(run(runner, req(name, "b", image=image, strength=1.0, seed=1))[0])
    other = floats(run(runner, req(name, "c", image=picture(4), strength=0.5, seed=1))[0])
    text = floats(run(runner, req(name, "d", seed=1))[0])
    assert np.abs(base - stronger).max() > 0.02
    assert np.abs(base - other).max() > 0.02
    assert np.abs(base - text).max() > 0.02
    # Same everything: same image (seeds belong to requests).
    assert np.array_equal(base, floats(run(runner, req(name, "e", image=image, strength=0.5, seed=1))[0]))


def test_a_fused_batch_equals_each_request_run_alone(runner: DiffusionRunner, name: str) -> None:
    batch = [req(name, f"r{i}", f"prompt {i}", image=picture(10 + i), strength=0.8, seed=20 + i) for i in range(4)]
    assert len({runner.batch_key(r) for r in batch}) == 1
    fused = run(runner, *batch)
    for request, out in zip(batch, fused, strict=True):
        solo = run(runner, request)[0]
        assert out.metrics["batch_size"] == 4 and solo.metrics["batch_size"] == 1
        np.testing.assert_allclose(floats(out), floats(solo), rtol=0, atol=1e-3)
    assert np.abs(floats(fused[0]) - floats(fused[1])).max() > 0.02
    # In uint8, within one level.
    pil = [req(name, f"p{i}", image=picture(30 + i), strength=0.8, seed=i, output_type="pil") for i in range(2)]
    for request, out in zip(pil, run(runner, *pil), strict=True):
        solo = run(runner, request)[0]
        assert np.abs(out.media[0].data.astype(int) - solo.media[0].data.astype(int)).max() <= 1


def test_image_j_of_a_request_uses_seed_plus_j(runner: DiffusionRunner, name: str) -> None:
    image = picture(5)
    two = floats(run(runner, req(name, "a", image=image, strength=0.9, seed=40, num_images_per_prompt=2))[0])
    assert two.shape[0] == 2
    for j in range(2):
        alone = floats(run(runner, req(name, "b", image=image, strength=0.9, seed=40 + j))[0])
        np.testing.assert_allclose(two[j : j + 1], alone, rtol=0, atol=1e-3)


def test_batch_key_separates_image_forms(runner: DiffusionRunner, name: str) -> None:
    image = picture(6)
    key = runner.batch_key(req(name, "a", image=image, strength=0.5, seed=1))
    assert runner.batch_key(req(name, "b", "other", image=picture(7), strength=0.5, seed=2)) == key
    changes = [
        {"image": picture(6, (48, 64)), "strength": 0.5},
        {"image": image, "strength": 0.6},
        {"image": image},  # the pipeline's default strength
        {},
    ]
    if FAMILIES[name][1]:
        changes.append({"image": image, "strength": 0.5, "mask_image": MASK})
    for change in changes:
        assert runner.batch_key(req(name, "c", **change)) != key, change


def test_the_output_has_the_input_size(runner: DiffusionRunner, name: str) -> None:
    image = picture(8, (48, 32))
    request = req(name, "a", image=image, strength=0.8, seed=1, output_type="pil")
    check_constraints(request.params, runner.constraints())
    out = run(runner, request)[0]
    assert out.error is None and out.media[0].data.shape == (48, 32, 3)


# ---------------------------------------------------------------------------- model directories


def test_an_img2img_model_directory_serves_images_and_text(cache: Path, tmp_path: Path) -> None:
    """Way (a): the model's own model_index.json names an img2img pipeline."""
    source = ensure_builtin("tiny-sd")
    target = tmp_path / "sd-img2img"
    shutil.copytree(source, target)
    index = json.loads((target / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionImg2ImgPipeline"
    (target / "model_index.json").write_text(json.dumps(index))
    runner = make_runner(str(target))
    assert type(runner._forms.forms["image"].pipe).__name__ == "StableDiffusionImg2ImgPipeline"
    assert type(runner.pipe).__name__ == "StableDiffusionPipeline"  # the text form, made with from_pipe
    image = picture(9)
    out = run(runner, req("tiny-sd", "a", image=image, strength=0.6, seed=3))[0]
    theirs = direct(
        "StableDiffusionImg2ImgPipeline", str(target), "tiny-sd", 3, image=Image.fromarray(image), strength=0.6
    )
    np.testing.assert_allclose(floats(out), theirs, rtol=0, atol=1e-3)
    assert floats(run(runner, req("tiny-sd", "b", seed=3))[0]).shape == (1, SIZE, SIZE, 3)


def test_text_only_families_refuse_images_before_the_queue(cache: Path) -> None:
    runner = make_runner("builtin:tiny-pixart")
    c = runner.constraints()
    assert c.image_inputs == () and "PixArtSigmaPipeline" in (c.image_inputs_note or "")
    with pytest.raises(InvalidRequestError, match="does not take `image`") as info:
        check_constraints(req("tiny-pixart", "a", image=picture(1)).params, c)
    assert info.value.param == "image"


def test_a_controlnet_pipeline_is_refused_at_load(cache: Path, tmp_path: Path) -> None:
    import diffusers

    base = diffusers.StableDiffusionPipeline.from_pretrained(ensure_builtin("tiny-sd"), local_files_only=True)
    controlnet = diffusers.ControlNetModel.from_unet(base.unet)
    components = {k: v for k, v in base.components.items() if k != "image_encoder"}
    pipe = diffusers.StableDiffusionControlNetPipeline(**components, controlnet=controlnet)
    pipe.save_pretrained(tmp_path / "controlnet")
    with pytest.raises(ConfigError, match="StableDiffusionControlNetPipeline needs a per-request conditioning image"):
        make_runner(str(tmp_path / "controlnet"))


def test_step_execution_runs_sd_img2img_and_refuses_inpainting(cache: Path) -> None:
    """With engine_args.step_execution, SD img2img runs in the step loop (the encoded image noised
    to the strength's first timestep, the schedule's tail), joining and sharing steps with text
    requests, and equals the request-level result; inpainting is refused before the queue."""
    stage = msgspec.convert(
        {"stage_id": 0, "stage_type": "diffusion", "model": "builtin:tiny-sd", "engine_args": {"step_execution": True}},
        StageConfig,
    )
    runner = DiffusionRunner(stage)
    runner.load()
    c = runner.constraints()
    assert runner.step_support() is None and c.image_inputs == ("image",)
    with pytest.raises(InvalidRequestError, match="step_execution") as info:
        check_constraints(req("tiny-sd", "m", image=picture(1), mask_image=MASK).params, c)
    assert info.value.param == "mask_image"

    a = req("tiny-sd", "a", "a red fox", image=picture(1), strength=0.5, seed=1, num_inference_steps=4)
    b = req("tiny-sd", "b", "a boat", seed=2, num_inference_steps=3)
    d = req("tiny-sd", "d", "a cat", image=picture(2), seed=3, num_images_per_prompt=2)  # default strength 0.8
    assert len({runner.step_key(r) for r in (a, b, d)}) == 1  # one denoiser call for all three
    outputs: dict[str, RunnerOutput] = {}
    steps: dict[str, int] = {}
    running: list[str] = []

    def admit(*requests: RunnerRequest) -> None:
        assert not runner.step_admit(list(requests), NOT_ABORTED)
        running.extend(r.request_id for r in requests)

    def step() -> None:
        for rid, result in runner.step_run(list(running), NOT_ABORTED).items():
            steps[rid] = result.steps
            if result.output is not None:
                outputs[rid] = result.output
                running.remove(rid)

    admit(a)
    step()
    admit(b, d)  # join a running batch
    while running:
        step()
    assert steps == {"a": 2, "b": 3, "d": 3}  # int(4 x 0.5) and int(4 x 0.8) steps of the tail
    for request in (a, b, d):
        (alone,) = runner.execute([request], NOT_ABORTED)
        np.testing.assert_allclose(floats(outputs[request.request_id]), floats(alone), rtol=0, atol=1e-3)
    assert floats(outputs["d"]).shape == (2, SIZE, SIZE, 3)
    # A direct inpainting request in step mode fails alone, with a reason.
    failed = runner.step_admit([req("tiny-sd", "m", image=picture(1), mask_image=MASK)], NOT_ABORTED)
    assert "does not run step by step" in str(failed["m"].error)
    runner.step_drop(["m"])


def test_step_execution_refuses_images_where_the_loop_has_no_img2img(cache: Path) -> None:
    stage = msgspec.convert(
        {
            "stage_id": 0,
            "stage_type": "diffusion",
            "model": "builtin:tiny-flux",
            "engine_args": {"step_execution": True},
        },
        StageConfig,
    )
    runner = DiffusionRunner(stage)
    runner.load()
    c = runner.constraints()
    assert runner.step_support() is None and c.image_inputs == ()
    with pytest.raises(InvalidRequestError, match="step_execution") as info:
        check_constraints(req("tiny-flux", "a", image=picture(1)).params, c)
    assert info.value.param == "image"


def test_a_flux_kontext_directory_edits_and_draws(cache: Path, tmp_path: Path) -> None:
    """An edit pipeline that takes an image optionally (Flux Kontext, made from tiny-flux's
    components): it serves both forms itself, at the input's size (its scaling to the real
    model's ~1 MP sizes off), equal to diffusers' own call."""
    import diffusers

    flux = diffusers.FluxPipeline.from_pretrained(ensure_builtin("tiny-flux"), local_files_only=True)
    diffusers.FluxKontextPipeline(**flux.components).save_pretrained(tmp_path / "kontext")
    runner = make_runner(str(tmp_path / "kontext"))
    forms = runner._forms.forms
    assert type(forms["text"].pipe).__name__ == type(forms["image"].pipe).__name__ == "FluxKontextPipeline"
    assert runner.constraints().image_inputs == ("image",)
    image = picture(12)
    out = floats(run(runner, req("tiny-flux", "a", image=image, seed=4))[0])
    theirs = direct(
        "FluxKontextPipeline",
        str(tmp_path / "kontext"),
        "tiny-flux",
        4,
        image=Image.fromarray(image),
        _auto_resize=False,
        max_area=SIZE * SIZE,
    )
    assert out.shape == theirs.shape == (1, SIZE, SIZE, 3)
    np.testing.assert_allclose(out, theirs, rtol=0, atol=1e-3)
    # The input's tokens join the sequence: a small but real change on random tiny weights
    # (about 0.01, where float noise between batched and solo runs is about 1e-6).
    text = floats(run(runner, req("tiny-flux", "b", seed=4))[0])
    assert np.abs(out - text).max() > 5e-3


def test_img2img_with_a_lora_adapter(cache: Path, tmp_path: Path) -> None:
    """An adapter bound to the text form's modules applies to the img2img and inpainting forms too
    (they share the modules); requests without it are the base model's, bit for bit."""
    from omni_runtime.models.tiny_lora import build_tiny_sd_lora

    adapter = build_tiny_sd_lora(tmp_path / "lora", seed=1)
    stage = msgspec.convert(
        {
            "stage_id": 0,
            "stage_type": "diffusion",
            "model": "builtin:tiny-sd",
            "engine_args": {"loras": {"ink": str(adapter)}},
        },
        StageConfig,
    )
    runner = DiffusionRunner(stage)
    runner.load()
    image = picture(13)
    base = floats(run(runner, req("tiny-sd", "a", image=image, strength=0.8, seed=2))[0])
    lora = req("tiny-sd", "b", image=image, strength=0.8, seed=2, lora={"name": "ink", "scale": 1.0})
    assert runner.batch_key(lora) != runner.batch_key(req("tiny-sd", "a", image=image, strength=0.8, seed=2))
    with_lora = floats(run(runner, lora)[0])
    assert np.abs(with_lora - base).max() > 0.02
    inpaint = req("tiny-sd", "c", image=image, mask_image=MASK, seed=2, lora={"name": "ink", "scale": 1.0})
    assert floats(run(runner, inpaint)[0]).shape == (1, SIZE, SIZE, 3)
    again = floats(run(runner, req("tiny-sd", "d", image=image, strength=0.8, seed=2))[0])
    assert np.array_equal(again, base)
