"""LoRA adapters in the diffusion runner, on the builtin tiny-sd with tiny random adapters built
offline: the image changes with an adapter and equals the merged-weights result, scale 0 and
requests without an adapter are the base model's bit for bit, the LRU bound unloads and reloads,
failures fail only their requests, the control calls, and adapters in step execution."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pydantic
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_runtime.config import EngineArgs, StageConfig
from omni_runtime.exceptions import ConfigError, InvalidRequestError, LoraFormatError, LoraLoadError
from omni_runtime.models.builtin import resolve_model
from omni_runtime.models.tiny_lora import build_tiny_sd_lora
from omni_runtime.params import LoraRequest
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from omni_runtime.stage.runners.lora import LoraAdapters, supports_lora
from tests.helpers import diffusion_params
from tests.hostile_loras import bin_adapter, nan_adapter
from tests.strategies import JSON_VALUES

CTX = ExecuteContext(lambda rid: False)
#: Small and short: every test here runs several forwards.
DEFAULTS = {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 7.5, "output_type": "np"}
#: Merged weights (W + s * B @ A) and a LoRA layer (W x + s * B A x) round differently.
MERGED_ATOL = 2e-4


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": build_tiny_sd_lora(root / "a", seed=1),
        "b": build_tiny_sd_lora(root / "b", seed=2),
        "c": build_tiny_sd_lora(root / "c", seed=3, text_encoder=False),
    }


def make_runner(adapters: dict[str, Path], **engine_args: Any) -> DiffusionRunner:
    args = {"loras": {name: str(path) for name, path in adapters.items()}, "max_loras": 2, **engine_args}
    stage = {"stage_id": 0, "stage_type": "diffusion", "model": "builtin:tiny-sd", "engine_args": args}
    runner = DiffusionRunner(msgspec.convert(stage, StageConfig))
    runner.load()
    return runner


@pytest.fixture(scope="module")
def runner(cache: Path, adapters: dict[str, Path]) -> DiffusionRunner:
    return make_runner(adapters)


@pytest.fixture(scope="module")
def base(runner: DiffusionRunner) -> np.ndarray:
    """The base model's image for the default request, taken before any adapter is loaded."""
    assert runner.loras.describe()["loaded"] == []
    return images(run(runner, req("base"))[0])


def req(rid: str, prompt: str = "a cup of coffee", **params: Any) -> RunnerRequest:
    return RunnerRequest(request_id=rid, prompt=prompt, params=diffusion_params({**DEFAULTS, "seed": 3, **params}))


def run(runner: DiffusionRunner, *requests: RunnerRequest) -> list[RunnerOutput]:
    outs = runner.execute(list(requests), CTX)
    assert len(outs) == len(requests)
    return outs


def images(out: RunnerOutput) -> np.ndarray:
    assert out.error is None, out.error
    return out.tensors["images"]


def merged(cache: Path, adapter: Path, scale: float, request: RunnerRequest) -> np.ndarray:
    """The request's image from a separate pipeline whose weights have the adapter fused in."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(resolve_model("builtin:tiny-sd"), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(adapter), adapter_name="fused")
    pipe.fuse_lora(components=["unet", "text_encoder"], lora_scale=scale)
    pipe.unload_lora_weights()  # only the merged weights are left
    p = request.params
    generator = torch.Generator().manual_seed(p.seed)
    with torch.inference_mode():
        out = pipe(
            [request.prompt],
            generator=[generator],
            height=p.height,
            width=p.width,
            num_inference_steps=p.num_inference_steps,
            guidance_scale=p.guidance_scale,
            output_type="np",
        )
    return np.asarray(out.images, dtype=np.float32)


# ---------------------------------------------------------------------------- the adapter itself


def test_builder_is_seeded_and_writes_diffusers_lora_weights(tmp_path: Path, adapters: dict[str, Path]) -> None:
    from safetensors import safe_open

    def contents(directory: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        with safe_open(str(directory / "pytorch_lora_weights.safetensors"), "np") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 - not a dict

    tensors, metadata = contents(adapters["a"])
    again, again_metadata = contents(build_tiny_sd_lora(tmp_path / "a", seed=1))
    assert again.keys() == tensors.keys() and again_metadata == metadata
    assert all(np.array_equal(again[k], tensors[k]) for k in tensors)
    other, _ = contents(adapters["b"])
    assert not np.array_equal(other[next(iter(tensors))], tensors[next(iter(tensors))])
    assert any(k.startswith("unet.") for k in tensors) and any(k.startswith("text_encoder.") for k in tensors)
    assert all("lora" in k for k in tensors)
    assert not any(k.startswith("text_encoder.") for k in contents(adapters["c"])[0])


# ---------------------------------------------------------------------------- results


def test_the_adapter_changes_the_image_and_equals_the_merged_weights(
    runner: DiffusionRunner, base: np.ndarray, cache: Path, adapters: dict[str, Path]
) -> None:
    request = req("a", lora={"name": "a", "scale": 0.7})
    with_a = images(run(runner, request)[0])
    assert np.abs(with_a - base).max() > 0.02
    np.testing.assert_allclose(with_a, merged(cache, adapters["a"], 0.7, request), rtol=0, atol=MERGED_ATOL)
    # A second adapter loaded beside the first is just as right (its own weights, not the first's).
    request = req("b", lora={"name": "b", "scale": 1.0})
    with_b = images(run(runner, request)[0])
    assert np.abs(with_b - with_a).max() > 0.02
    np.testing.assert_allclose(with_b, merged(cache, adapters["b"], 1.0, request), rtol=0, atol=MERGED_ATOL)


def test_without_an_adapter_and_at_scale_zero_the_base_model_is_untouched(
    runner: DiffusionRunner, base: np.ndarray
) -> None:
    images(run(runner, req("load", lora={"name": "a"}))[0])  # adapters are loaded, one was active
    assert runner.loras.describe()["loaded"]
    assert np.array_equal(images(run(runner, req("plain"))[0]), base)
    assert np.array_equal(images(run(runner, req("zero", lora={"name": "a", "scale": 0.0}))[0]), base)
    # The scale is per request: a larger one moves further from the base.
    half = images(run(runner, req("half", lora={"name": "a", "scale": 0.5}))[0])
    full = images(run(runner, req("full", lora={"name": "a", "scale": 1.0}))[0])
    assert 0 < np.abs(half - base).mean() < np.abs(full - base).mean()


def test_a_path_works_like_a_name(runner: DiffusionRunner, adapters: dict[str, Path]) -> None:
    by_name = images(run(runner, req("n", lora={"name": "c", "scale": 0.8}))[0])
    by_path = images(run(runner, req("p", lora={"path": str(adapters["c"]), "scale": 0.8}))[0])
    weights = adapters["c"] / "pytorch_lora_weights.safetensors"
    by_file = run(runner, req("f", lora={"path": str(weights), "scale": 0.8}))
    assert np.array_equal(by_name, by_path)
    assert np.array_equal(by_name, images(by_file[0]))


def test_a_batch_with_an_adapter_equals_each_request_alone(runner: DiffusionRunner) -> None:
    batch = [req(f"r{i}", p, seed=10 + i, lora={"name": "a", "scale": 0.9}) for i, p in enumerate(["a fox", "a cat"])]
    fused = run(runner, *batch)
    for request, out in zip(batch, fused, strict=True):
        np.testing.assert_allclose(images(out), images(run(runner, request)[0]), rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------- keys


def test_adapter_and_scale_are_in_the_batch_and_step_keys(runner: DiffusionRunner) -> None:
    for key in (runner.batch_key, runner.step_key):
        plain = key(req("x"))
        a = key(req("a", lora={"name": "a", "scale": 1.0}))
        assert len({plain, a, key(req("b", lora={"name": "b", "scale": 1.0}))}) == 3
        assert key(req("a2", "another prompt", seed=9, lora={"name": "a", "scale": 1.0})) == a
        assert key(req("a3", lora={"name": "a", "scale": 0.5})) != a
        assert key(req("p", lora={"path": "/x/../y", "scale": 1.0})) == key(req("q", lora={"path": "/y"}))
    assert LoraAdapters.key(None) is None


# ---------------------------------------------------------------------------- the cache


def test_past_max_loras_the_least_recently_used_is_unloaded_and_reloaded_on_demand(
    cache: Path, adapters: dict[str, Path], base: np.ndarray
) -> None:
    lru = make_runner(adapters, max_loras=2)
    first_a = images(run(lru, req("a", lora={"name": "a"}))[0])
    images(run(lru, req("b", lora={"name": "b"}))[0])
    images(run(lru, req("a2", lora={"name": "a"}))[0])  # a is now the most recent
    images(run(lru, req("c", lora={"name": "c"}))[0])  # b goes
    state = lru.loras.describe()
    assert [e["names"] for e in state["loaded"]] == [["a"], ["c"]]
    assert (state["loads"], state["evictions"]) == (3, 1)
    images(run(lru, req("b2", lora={"name": "b"}))[0])  # reloaded; a, the least recent, goes
    state = lru.loras.describe()
    assert [e["names"] for e in state["loaded"]] == [["c"], ["b"]]
    assert (state["loads"], state["evictions"]) == (4, 2)
    again_a = images(run(lru, req("a3", lora={"name": "a"}))[0])
    assert np.array_equal(first_a, again_a)  # reloaded from disk: the same adapter
    assert len(lru.loras.describe()["loaded"]) == 2
    assert np.array_equal(images(run(lru, req("plain"))[0]), base)


# ---------------------------------------------------------------------------- failures


def test_a_bad_adapter_fails_its_requests_and_the_runner_serves_on(
    runner: DiffusionRunner, base: np.ndarray, tmp_path: Path
) -> None:
    outs = run(runner, req("u1", lora={"name": "nope"}), req("u2", lora={"name": "nope"}))
    assert all(isinstance(o.error, InvalidRequestError) and o.error.param == "lora.name" for o in outs)
    assert "nope" in str(outs[0].error) and "a, b, c" in str(outs[0].error)
    (out,) = run(runner, req("m", lora={"path": str(tmp_path / "missing")}))
    assert isinstance(out.error, InvalidRequestError) and out.error.param == "lora.path"
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "weights.safetensors").write_bytes(b"not safetensors")
    (out,) = run(runner, req("j", lora={"path": str(tmp_path / "junk")}))
    assert isinstance(out.error, LoraFormatError) and out.error.param == "lora.path"
    # Weights that are not LoRA weights (the model's own VAE) are refused, not half-loaded.
    vae = Path(resolve_model("builtin:tiny-sd")) / "vae"
    (out,) = run(runner, req("v", lora={"path": str(vae / "diffusion_pytorch_model.safetensors")}))
    assert isinstance(out.error, LoraLoadError)
    hub = req("h", lora={"path": "/set/below"})
    assert hub.params.lora is not None
    msgspec.structs.force_setattr(hub.params.lora, "path", "user/repo")  # past the caller's check
    (out,) = run(runner, hub)  # a hub id never reaches a download
    assert isinstance(out.error, InvalidRequestError)
    assert np.array_equal(images(run(runner, req("after"))[0]), base)
    assert np.abs(images(run(runner, req("ok", lora={"name": "a"}))[0]) - base).max() > 0.02


def test_registered_paths_are_checked_at_load(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="does not exist"):
        make_runner({"gone": tmp_path / "gone"})


# ---------------------------------------------------------------------------- control calls


def test_add_list_and_remove(cache: Path, adapters: dict[str, Path], base: np.ndarray, tmp_path: Path) -> None:
    r = make_runner({})
    assert r.rpc_list_loras()["registered"] == {} and r.rpc_list_loras()["supported"] is True
    (out,) = run(r, req("x", lora={"name": "late"}))
    assert isinstance(out.error, InvalidRequestError)
    assert r.rpc_add_lora("late", str(adapters["a"]), load=True) == {
        "name": "late",
        "path": str(adapters["a"]),
        "loaded": True,
    }
    listed = r.rpc_list_loras()
    assert listed["registered"] == {"late": str(adapters["a"])}
    assert [e["names"] for e in listed["loaded"]] == [["late"]] and listed["loads"] == 1
    with_late = images(run(r, req("y", lora={"name": "late", "scale": 0.6}))[0])
    assert r.rpc_list_loras()["active"]["scale"] == 0.6
    assert r.rpc_remove_lora("late") == {"name": "late", "removed": True, "unloaded": True}
    assert r.rpc_list_loras()["loaded"] == []
    assert np.array_equal(images(run(r, req("z"))[0]), base)
    (out,) = run(r, req("w", lora={"name": "late"}))
    assert isinstance(out.error, InvalidRequestError)
    with pytest.raises(InvalidRequestError):
        r.rpc_remove_lora("late")
    # Sleep drops the loaded adapters with the model; the names stay and load again on demand.
    r.rpc_add_lora("late", str(adapters["a"]))
    r.sleep()
    assert r.rpc_list_loras()["loaded"] == [] and r.rpc_list_loras()["registered"]
    r.wake_up()
    again = images(run(r, req("y2", lora={"name": "late", "scale": 0.6}))[0])
    assert np.array_equal(with_late, again)
    # A registered folder deleted meanwhile: wake_up still works, and only its requests fail.
    gone = tmp_path / "gone"
    shutil.copytree(adapters["b"], gone)
    r.rpc_add_lora("gone", str(gone))
    shutil.rmtree(gone)
    r.sleep()
    assert r.wake_up() == {"reloaded": True}
    (out,) = run(r, req("g", lora={"name": "gone"}))
    assert isinstance(out.error, LoraLoadError) and "no longer exists" in str(out.error)
    assert np.array_equal(images(run(r, req("z2"))[0]), base)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=JSON_VALUES, path=JSON_VALUES, load=JSON_VALUES)
def test_hostile_control_call_arguments_are_typed_errors(
    runner: DiffusionRunner, adapters: dict[str, Path], name: Any, path: Any, load: Any
) -> None:
    before = runner.rpc_list_loras()["registered"]
    if isinstance(path, str) and path.startswith("/") and isinstance(name, str) and load in (True, False):
        path = "/nonexistent" + path  # never a real file: a hostile path must not register
    with pytest.raises(InvalidRequestError):
        runner.rpc_add_lora(name, path, load)
    registered = isinstance(name, str) and name in before
    with pytest.raises(InvalidRequestError):
        runner.rpc_remove_lora("not-registered" if registered else name)
    assert runner.rpc_list_loras()["registered"] == before


def test_hostile_control_calls_leave_the_runner_serving(runner: DiffusionRunner, base: np.ndarray) -> None:
    assert np.array_equal(images(run(runner, req("after-fuzz"))[0]), base)


def test_pipelines_without_a_lora_loader_are_told_apart(runner: DiffusionRunner) -> None:
    assert supports_lora(runner.pipe) and runner.constraints().lora is True
    assert not supports_lora(object())


# ---------------------------------------------------------------------------- step execution


def test_step_execution_with_adapters_equals_request_level(runner: DiffusionRunner, base: np.ndarray) -> None:
    """Two adapters and none, admitted and stepped the way the worker does (one key per step):
    each request's image equals its request-level one."""
    requests = [
        req("s-a", "a fox", seed=21, lora={"name": "a", "scale": 0.8}),
        req("s-b", "a cat", seed=22, lora={"name": "b", "scale": 1.0}),
        req("s-0", seed=3),
    ]
    by_key: dict[Any, list[RunnerRequest]] = {}
    for r in requests:
        by_key.setdefault(runner.step_key(r), []).append(r)
    assert len(by_key) == 3
    assert not runner.step_admit(requests[:2], CTX)  # one call for two adapters: grouped inside
    assert not runner.step_admit(requests[2:], CTX)
    outputs: dict[str, RunnerOutput] = {}
    while len(outputs) < len(requests):
        # Interleaved, as keys take turns: the adapter changes at every step.
        for group in by_key.values():
            ids = [r.request_id for r in group if r.request_id not in outputs]
            if ids:
                for rid, result in runner.step_run(ids, CTX).items():
                    if result.output is not None:
                        outputs[rid] = result.output
    for r in requests:
        expected = images(run(runner, r)[0])
        np.testing.assert_allclose(images(outputs[r.request_id]), expected, rtol=0, atol=1e-4)
    np.testing.assert_allclose(images(outputs["s-0"]), base, rtol=0, atol=1e-4)


def test_step_execution_fails_only_the_requests_of_a_bad_adapter(runner: DiffusionRunner) -> None:
    good, bad = req("g", lora={"name": "a"}), req("x", lora={"name": "missing"})
    failed = runner.step_admit([good, bad], CTX)
    assert set(failed) == {"x"} and isinstance(failed["x"].error, InvalidRequestError)
    runner.step_drop(["g"])


# ---------------------------------------------------------------------------- hostile adapter files


def header_file(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> str:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return str(path)


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
BAD_HEADERS = {
    "empty": (b"", b"", 0),
    "length past the end": (b"{}", b"", 2**40),
    "not json": (b"\xff\xfe not json", b"", None),
    "a list": (b"[1, 2]", b"", None),
    "no tensors": (json.dumps({"__metadata__": {"a": "b"}}).encode(), b"", None),
    "metadata not strings": (json.dumps({"__metadata__": {"a": 1}, "w": F32_2}).encode(), b"\0" * 8, None),
    "offsets past the data": (json.dumps({"w": {**F32_2, "data_offsets": [0, 80]}}).encode(), b"\0" * 8, None),
    "bytes not the shape": (json.dumps({"w": {**F32_2, "shape": [3]}}).encode(), b"\0" * 8, None),
    "unknown dtype": (json.dumps({"w": {**F32_2, "dtype": "PICKLE"}}).encode(), b"\0" * 8, None),
    "negative shape": (json.dumps({"w": {**F32_2, "shape": [-2]}}).encode(), b"\0" * 8, None),
}


@pytest.mark.parametrize("why", sorted(BAD_HEADERS))
def test_malformed_safetensors_headers_are_refused_before_a_loader_reads_them(
    runner: DiffusionRunner, tmp_path: Path, why: str
) -> None:
    header, data, length = BAD_HEADERS[why]
    path = header_file(tmp_path / "bad.safetensors", header, data, length)
    (out,) = run(runner, req("h", lora={"path": path}))
    assert isinstance(out.error, LoraFormatError) and out.error.param == "lora.path", out.error
    assert path in str(out.error)
    with pytest.raises(LoraFormatError):
        runner.rpc_add_lora("hostile", path)
    assert "hostile" not in runner.rpc_list_loras()["registered"]


def test_only_safetensors_load_never_a_pickle(
    runner: DiffusionRunner, adapters: dict[str, Path], base: np.ndarray, tmp_path: Path
) -> None:
    folder = bin_adapter(adapters["a"], tmp_path / "bin")
    loads = runner.rpc_list_loras()["loads"]
    for path in (folder, folder / "pytorch_lora_weights.bin"):
        (out,) = run(runner, req("bin", lora={"path": str(path)}))
        assert isinstance(out.error, LoraFormatError) and out.error.param == "lora.path", out.error
        assert "safetensors only" in str(out.error)
        with pytest.raises(LoraFormatError):
            runner.rpc_add_lora("pickled", str(path), load=True)
    # A real safetensors adapter under another name is refused too: the loader would torch.load it.
    renamed = tmp_path / "adapter.bin"
    shutil.copy(adapters["a"] / "pytorch_lora_weights.safetensors", renamed)
    (out,) = run(runner, req("renamed", lora={"path": str(renamed)}))
    assert isinstance(out.error, LoraFormatError)
    assert runner.rpc_list_loras()["loads"] == loads  # nothing reached the loader
    assert np.array_equal(images(run(runner, req("after-bin"))[0]), base)


def test_a_file_over_the_size_limit_is_refused_from_its_size_alone(
    runner: DiffusionRunner, base: np.ndarray, tmp_path: Path
) -> None:
    huge = tmp_path / "huge.safetensors"
    with huge.open("wb") as f:
        f.truncate(3 * 2**30)  # sparse: no disk, and reading it would take seconds and gigabytes
    start = time.monotonic()
    (out,) = run(runner, req("huge", lora={"path": str(huge)}))
    assert isinstance(out.error, LoraFormatError) and "max_lora_file_mb" in str(out.error)
    with pytest.raises(LoraFormatError, match="over the 2048 MiB limit"):
        runner.rpc_add_lora("huge", str(huge), load=True)
    # Under a lower limit, a sparse file of zeros is refused by its header (8 bytes read).
    with huge.open("r+b") as f:
        f.truncate(2**30)
    (out,) = run(runner, req("zeros", lora={"path": str(huge)}))
    assert isinstance(out.error, LoraFormatError) and "header length of 0" in str(out.error)
    assert time.monotonic() - start < 5  # a forward of tiny-sd dominates; reading the file would not fit
    assert np.array_equal(images(run(runner, req("after-huge"))[0]), base)


def test_the_size_limit_is_configurable_and_checked_at_start_up(cache: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.safetensors"
    with big.open("wb") as f:
        f.truncate(3 * 2**20)
    with pytest.raises(ConfigError, match=r"engine_args\.loras\.big.*over the 1 MiB limit"):
        make_runner({"big": big}, max_lora_file_mb=1)


def test_non_finite_weights_are_refused_at_load(
    runner: DiffusionRunner, adapters: dict[str, Path], base: np.ndarray, tmp_path: Path
) -> None:
    nan = nan_adapter(adapters["a"], tmp_path / "nan")
    (out,) = run(runner, req("nan", lora={"path": str(nan)}))
    assert isinstance(out.error, LoraFormatError) and "NaN or infinite" in str(out.error)
    with pytest.raises(LoraFormatError, match="NaN or infinite"):
        runner.rpc_add_lora("nan", str(nan), load=True)
    assert "nan" not in runner.rpc_list_loras()["registered"]
    assert np.array_equal(images(run(runner, req("after-nan"))[0]), base)


# ---------------------------------------------------------------------------- add_lora is all or nothing


def test_a_failed_add_or_re_point_changes_nothing(cache: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    r = make_runner({"a": adapters["a"]})
    with_a = images(run(r, req("a", lora={"name": "a"}))[0])
    before = r.rpc_list_loras()
    # Safetensors that are not LoRA weights (the model's own VAE): they pass the file checks and
    # fail in the loader, after which nothing may have changed.
    vae = str(Path(resolve_model("builtin:tiny-sd")) / "vae" / "diffusion_pytorch_model.safetensors")
    nan = str(nan_adapter(adapters["b"], tmp_path / "nan"))
    for bad, error in ((vae, LoraLoadError), (nan, LoraFormatError), (str(tmp_path / "gone"), InvalidRequestError)):
        with pytest.raises(error):
            r.rpc_add_lora("a", bad, load=True)  # re-point a working name
        with pytest.raises(error):
            r.rpc_add_lora("fresh", bad, load=True)  # a new one
        after = r.rpc_list_loras()
        assert after["registered"] == before["registered"] == {"a": str(adapters["a"])}
        assert [e["source"] for e in after["loaded"]] == [e["source"] for e in before["loaded"]]
        assert np.array_equal(images(run(r, req("a", lora={"name": "a"}))[0]), with_a)
    # A good re-point then takes effect, and the old file's adapter is unloaded.
    assert r.rpc_add_lora("a", str(adapters["b"]), load=True)["loaded"]
    assert [e["names"] for e in r.rpc_list_loras()["loaded"]] == [["a"]]
    assert not np.array_equal(images(run(r, req("a", lora={"name": "a"}))[0]), with_a)


# ---------------------------------------------------------------------------- names


CONTROL = st.characters(categories=["Cc", "Cf", "Zl", "Zp", "Zs"])


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.sampled_from(["ink", "a", "film-grain.v2"]),
    bad=st.text(CONTROL, min_size=1, max_size=3),
    where=st.integers(0, 3),
)
def test_names_with_control_or_space_characters_are_refused_everywhere(
    runner: DiffusionRunner, adapters: dict[str, Path], name: str, bad: str, where: int
) -> None:
    """``$`` matches before a final newline: ``"ink\\n"`` passed. Every place that takes a name —
    a request's params, the YAML, add_lora, the HTTP field — refuses it wherever the character is."""
    from entrypoints.openai.protocol import LoraSpec

    hostile = name + bad if where == 0 else name[:1] + bad + name[1:] if where < 3 else bad + name
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"name": hostile}, LoraRequest)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"loras": {hostile: str(adapters["a"])}}, EngineArgs)
    with pytest.raises(InvalidRequestError) as info:
        runner.rpc_add_lora(hostile, str(adapters["a"]))
    assert info.value.param == "name"
    with pytest.raises(pydantic.ValidationError):
        LoraSpec(name=hostile)
    assert msgspec.convert({"name": name}, LoraRequest).name == name == LoraSpec(name=name).name
