"""The builtin tiny models of the major diffusers families, built offline and served by DiffusionRunner.

Per family: the builder is offline and byte-stable, the model loads through the runner with its
own native size and size step, a fused batch equals its requests run alone (within float
tolerance: batched kernels are never bitwise equal to batch-1 ones), seeds belong to requests,
and an abort of the whole wave leaves the denoising loop. Then two families end to end on real
stage processes, by their bundled config names.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime import Omni
from omni_runtime.config import StageConfig, load_config
from omni_runtime.exceptions import RequestAbortedError
from omni_runtime.models import families as registry
from omni_runtime.models.builtin import CACHE_VERSION, builder, builtin_names
from omni_runtime.models.families import GOLDEN_PARAMS, GOLDEN_PROMPT, FamilySpec, families, register
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.helpers import diffusion_params

NOT_ABORTED = ExecuteContext(lambda rid: False)
PROMPTS = ["a cup of coffee", "a toy dinosaur", "a fox yawning", "the running river"]


#: The family registry by tiny builtin name; SD's tiny model is tested in test_tiny_sd.py and
#: step by step in test_diffusion_steps.py (its golden slice too); video families in test_wan.py.
FAMILIES: dict[str, FamilySpec] = {f.tiny: f for f in families() if f.tiny and f.name != "sd" and f.output == "image"}


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def runner(cache: Path, name: str) -> DiffusionRunner:
    stage = msgspec.convert({"stage_id": 0, "stage_type": "diffusion", "model": f"builtin:{name}"}, StageConfig)
    r = DiffusionRunner(stage)
    r.load()
    return r


def defaults(name: str) -> dict[str, Any]:
    """What the caller merges in from the bundled config's default_sampling_params."""
    return dict(load_config(name).stage_args[0].default_sampling_params)


def req(name: str, rid: str, prompt: str = PROMPTS[0], **params: Any) -> RunnerRequest:
    params = diffusion_params({**defaults(name), "output_type": "np", **params})
    return RunnerRequest(request_id=rid, prompt=prompt, params=params)


def run(runner: DiffusionRunner, *requests: RunnerRequest, ctx: ExecuteContext = NOT_ABORTED) -> list[RunnerOutput]:
    outs = runner.execute(list(requests), ctx)
    assert len(outs) == len(requests)
    return outs


def floats(out: RunnerOutput) -> np.ndarray:
    assert out.error is None, out.error
    return out.tensors["images"]


def denoiser(runner: DiffusionRunner) -> torch.nn.Module:
    return runner.pipe.unet if hasattr(runner.pipe, "unet") else runner.pipe.transformer


# ---------------------------------------------------------------------------- builders


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_builder_is_offline_deterministic_and_small(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"the {family} builder tried to open a connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    build = builder(family)
    build(tmp_path / "a")
    start = time.perf_counter()
    build(tmp_path / "b")
    elapsed = time.perf_counter() - start
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys() and a == b  # byte-identical: same weights, configs and vocabularies
    assert json.loads(a["model_index.json"])["_class_name"] == FAMILIES[family].pipelines[0]
    assert sum(map(len, a.values())) < 20e6
    assert elapsed < 5.0  # typically 0.1-0.3 s once the libraries are imported
    for key, text in a.items():
        if key.endswith("tokenizer_config.json"):
            assert "local_files_only" not in json.loads(text)


def test_every_family_is_a_builtin_with_a_bundled_config() -> None:
    for family, facts in FAMILIES.items():
        assert family in builtin_names() and family in facts.builders
        (stage,) = load_config(family).stage_args
        assert stage.model == f"builtin:{family}" and stage.engine_args.max_num_seqs == 4
        params = stage.default_sampling_params
        assert params["height"] == params["width"] == facts.native_size
        assert 2 <= params["num_inference_steps"] <= 4
    (stage,) = load_config("small-sd").stage_args
    assert stage.model == "builtin:small-sd" and stage.default_sampling_params["height"] == 256


# ---------------------------------------------------------------------------- runner


def test_loads_with_its_own_native_size_and_size_step(runner: DiffusionRunner, name: str) -> None:
    facts = FAMILIES[name]
    assert type(runner.pipe).__name__ in facts.pipelines
    assert type(denoiser(runner)).__name__ == facts.denoiser
    assert runner.max_batch_size is None  # every family takes prompt and generator lists
    constraints = runner.constraints()
    assert constraints.size_multiple == facts.size_multiple
    # The size limit follows the model (4 x its native area), and a wrong size is explained in its
    # terms: the patch size of a DiT, Flux's latent packing, Sana's 32x autoencoder.
    assert constraints.native_size == (facts.native_size, facts.native_size)
    assert constraints.max_pixels == 4 * facts.native_size**2
    reason = constraints.size_multiple_reason or ""
    assert reason.startswith("the VAE scale factor ")
    assert ("patch size 2" in reason) == (name in ("tiny-sd3", "tiny-pixart"))
    assert ("latent packing x2" in reason) == (name == "tiny-flux")
    # Absent sizes resolve to the model's own, read from its configs (not Sana's 1024 default).
    bare = RunnerRequest("a", "a fox", diffusion_params({"num_inference_steps": 2, "output_type": "np", "seed": 3}))
    assert floats(run(runner, bare)[0]).shape == (1, facts.native_size, facts.native_size, 3)
    assert runner.batch_key(bare)[:2] == (facts.native_size, facts.native_size)


def test_generates_the_requested_size(runner: DiffusionRunner, name: str) -> None:
    facts = FAMILIES[name]
    height, width = facts.native_size - facts.size_multiple, facts.native_size + facts.size_multiple
    out = run(runner, req(name, "a", seed=1, height=height, width=width, output_type="pil"))[0]
    assert out.error is None and len(out.media) == 1
    image = out.media[0].data
    assert image.shape == (height, width, 3) and image.dtype == np.uint8
    assert image.std() > 0  # not a blank image


@pytest.mark.parametrize("output_type", ["np", "pil"])
def test_a_fused_batch_equals_each_request_run_alone(runner: DiffusionRunner, name: str, output_type: str) -> None:
    batch = [req(name, f"r{i}", p, seed=100 + i, output_type=output_type) for i, p in enumerate(PROMPTS)]
    assert len({runner.batch_key(r) for r in batch}) == 1
    fused = run(runner, *batch)
    for request, out in zip(batch, fused, strict=True):
        solo = run(runner, request)[0]
        assert out.metrics["batch_size"] == 4 and solo.metrics["batch_size"] == 1
        assert out.metrics["seed"] == solo.metrics["seed"] == request.params.seed
        if output_type == "np":
            np.testing.assert_allclose(floats(out), floats(solo), rtol=0, atol=1e-3)
        else:
            assert np.abs(out.media[0].data.astype(int) - solo.media[0].data.astype(int)).max() <= 1
    # Distinct prompts and seeds: the outputs really were split per request.
    first, second = (o.media[0].data if output_type == "pil" else floats(o) for o in fused[:2])
    assert np.abs(first.astype(float) - second.astype(float)).max() > 0.05


def test_seeds_belong_to_requests(runner: DiffusionRunner, name: str) -> None:
    first = floats(run(runner, req(name, "a", seed=7))[0])
    again = floats(run(runner, req(name, "b", seed=7))[0])
    other = floats(run(runner, req(name, "c", seed=8))[0])
    assert np.array_equal(first, again)
    assert np.abs(first - other).max() > 0.05
    # Whatever its batch-mates and its place among them, a request's seed makes its image.
    a, b = req(name, "a", seed=7), req(name, "b", PROMPTS[1], seed=8)
    for pair, index in (([a, b], 0), ([b, a], 1)):
        np.testing.assert_allclose(floats(run(runner, *pair)[index]), first, rtol=0, atol=1e-3)


def test_negative_prompts(runner: DiffusionRunner, name: str) -> None:
    plain = floats(run(runner, req(name, "a", seed=3))[0])
    # An empty negative prompt is no negative prompt: same batch key, same image.
    empty = req(name, "e", seed=3, negative_prompt="")
    assert runner.batch_key(empty) == runner.batch_key(req(name, "a", seed=3))
    assert np.array_equal(floats(run(runner, empty)[0]), plain)
    batch = [
        req(name, "n1", seed=3, negative_prompt="blurry"),
        req(name, "n2", "a fox", seed=4, negative_prompt="dark"),
    ]
    fused = run(runner, *batch)
    for request, out in zip(batch, fused, strict=True):
        np.testing.assert_allclose(floats(out), floats(run(runner, request)[0]), rtol=0, atol=1e-3)


def test_batch_key_separates_what_changes_the_forward(runner: DiffusionRunner, name: str) -> None:
    key = runner.batch_key(req(name, "a", seed=1))
    assert runner.batch_key(req(name, "b", "something else", seed=2)) == key
    multiple = FAMILIES[name].size_multiple
    for change in (
        {"height": 2 * multiple},
        {"num_inference_steps": 8},
        {"guidance_scale": 1.0},
        {"output_type": "pil"},
    ):
        assert runner.batch_key(req(name, "c", **change)) != key, change


def test_golden_slice(runner: DiffusionRunner, name: str) -> None:
    """The tiny model with a fixed prompt and seed makes the spec's stored numbers, request by
    request (test_diffusion_steps.py checks the step loop against the same numbers, for the
    families that have one): a family without a step loop is checked here too."""
    spec = FAMILIES[name]
    out = run(runner, req(name, "golden", GOLDEN_PROMPT, **GOLDEN_PARAMS))[0]
    got = [round(float(v), 4) for v in floats(out)[0, -3:, -3:, -1].flatten()]
    assert spec.golden, f"{spec.name}: no golden slice stored; this run made {got}"
    np.testing.assert_allclose(got, spec.golden, rtol=0, atol=1e-3, err_msg=f"{spec.name} made {got}")


def test_abort_of_the_whole_wave_stops_denoising(runner: DiffusionRunner, name: str) -> None:
    calls: list[int] = []
    hook = denoiser(runner).register_forward_hook(lambda *args: calls.append(1))
    try:
        # Every caller leaves after the first step has run: is_aborted flips at the 2nd check.
        ctx = ExecuteContext(lambda rid: len(calls) >= 2)
        outs = run(
            runner,
            req(name, "a", seed=1, num_inference_steps=20),
            req(name, "b", seed=2, num_inference_steps=20),
            ctx=ctx,
        )
        assert len(calls) == 2  # one denoiser call per step (guidance halves share it)
        assert all(isinstance(o.error, RequestAbortedError) for o in outs)
        assert [o.metrics["seed"] for o in outs] == [1, 2]

        # One of two aborted: the wave finishes for the other one.
        calls.clear()
        outs = run(runner, req(name, "c", seed=1), req(name, "d", seed=2), ctx=ExecuteContext(lambda rid: rid == "c"))
        assert len(calls) == defaults(name)["num_inference_steps"]
        assert all(o.error is None for o in outs)
    finally:
        hook.remove()


# ---------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("family", ["tiny-sd3", "tiny-sana"])
def test_bundled_config_serves_on_real_stage_processes(cache: Path, family: str) -> None:
    native = FAMILIES[family].native_size
    with Omni(family) as omni:
        outs = omni.generate(PROMPTS[:2], {"seed": 5}, use_tqdm=False)
        assert [o.error for o in outs] == [None, None]
        for out in outs:
            assert out.images[0].size == (native, native) and out.metrics["seed"] == 5
        assert not np.array_equal(np.asarray(outs[0].images[0]), np.asarray(outs[1].images[0]))
    assert (cache / f"{family}-{CACHE_VERSION}" / "model_index.json").is_file()  # built where the engine was told


# ---------------------------------------------------------------------------- registry


def test_the_registry_is_lazy_and_refuses_a_second_family_for_a_pipeline() -> None:
    # Reading every spec imports no diffusers, transformers or torch: a routing process stays light.
    code = (
        "import sys; from omni_runtime.models.builtin import builtin_names; "
        "from omni_runtime.models.families import families; families(); builtin_names(); "
        "from omni_runtime.stage.runners.stage_types import stage_types; stage_types(); "
        "print(sorted(m for m in ('diffusers', 'transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert [f.name for f in families()][:6] == ["sd", "sdxl", "sd3", "flux", "pixart", "sana"]
    for clash in (
        FamilySpec("other", ("StableDiffusionPipeline",), "UNet2DConditionModel"),
        FamilySpec("other", ("OtherPipeline",), "UNet2DConditionModel", builders={"tiny-sd": "x:y"}),
        FamilySpec("sd", ("OtherPipeline",), "UNet2DConditionModel"),
    ):
        with pytest.raises(ValueError, match="already"):
            register(clash)
    assert registry.family("sd").step_class().__name__ == "StableDiffusionFamily"


def test_a_family_brings_its_stage_types() -> None:
    from omni_runtime.stage.runners.base import runner_class
    from omni_runtime.stage.runners.stage_types import BUILTIN_RUNNERS, StageType, stage_type, stage_types

    # The SD family's split stages are builtin names, beside the core ones, read from its spec.
    names = list(stage_types())
    assert names[: len(BUILTIN_RUNNERS)] == list(BUILTIN_RUNNERS)
    assert {"sd_text_encoder", "sd_denoise", "sd_vae_decode"} <= set(names)
    assert stage_type("sd_denoise") == registry.family("sd").stage_types["sd_denoise"]
    assert runner_class("sd_denoise").__name__ == "SDDenoiseRunner"
    # The former module:Class path loads the same class.
    assert runner_class("omni_runtime.stage.runners.sd_split:SDDenoiseRunner") is runner_class("sd_denoise")
    assert load_config("tiny-sd-split").stage_args[1].stage_type == "sd_denoise"
    # A stage type name means one runner: a family may not take a core name or another family's.
    some = StageType("x:Y", registry.family("sd").stage_types["sd_denoise"].params_cls, needs_model=True)
    for clash in ({"diffusion": some}, {"sd_denoise": some}):
        with pytest.raises(ValueError, match="already"):
            register(FamilySpec("other", ("OtherPipeline",), "UNet2DConditionModel", stage_types=clash))


def test_each_builtin_family_declares_the_callback_style_of_its_pipelines() -> None:
    """The runner calls a family's pipelines in its spec's style, without reading their signatures:
    a wrong declaration would lose the abort checks (PixArt's is the legacy one)."""
    import inspect

    from omni_runtime.stage.runners.diffusion import callback_style

    for spec in map(registry.family, registry.BUILTIN_FAMILIES):
        for kind in ("text", "image", "inpaint"):
            cls = spec.load_form_class(kind)
            if cls is not None:
                assert callback_style(dict(inspect.signature(cls.__call__).parameters)) == spec.callback, (spec, kind)
