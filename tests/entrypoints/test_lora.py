"""LoRA per request through a real engine (a stage process each): waves group by adapter, results
equal the in-process runner's, hostile ``lora`` values are refused at the call and the engine serves
on, a failing adapter fails only its request, the control calls, and step execution with adapters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_runtime import AsyncOmni, DiffusionSamplingParams
from omni_runtime.config import StageConfig
from omni_runtime.exceptions import InvalidRequestError, LoraFormatError
from omni_runtime.models.builtin import resolve_model
from omni_runtime.models.tiny_lora import build_tiny_sd_lora
from omni_runtime.params import LoraRequest
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.conftest import make_config
from tests.helpers import diffusion_params
from tests.hostile_loras import bin_adapter, nan_adapter
from tests.strategies import ANY_FLOAT, ANY_TEXT, JSON_VALUES

pytestmark = pytest.mark.integration

DEFAULTS = {"num_inference_steps": 2, "guidance_scale": 7.5, "height": 32, "width": 32}


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {name: str(build_tiny_sd_lora(root / name, seed=seed)) for name, seed in (("ink", 1), ("oil", 2))}


def sd_stage(adapters: dict[str, str], **engine_args: Any) -> dict:
    return {
        "stage_id": 0,
        "stage_type": "diffusion",
        "model": "builtin:tiny-sd",
        "runtime": {"backend": "process", "torch_threads": 1},
        "final_output": True,
        "final_output_type": "image",
        "default_sampling_params": DEFAULTS,
        "engine_args": {"max_num_seqs": 8, "loras": adapters, "max_loras": 2, **engine_args},
    }


@pytest.fixture(scope="module")
async def engine(cache: Path, adapters: dict[str, str]):
    # A long admission hold: requests sent together are all waiting when the first wave forms.
    engine = AsyncOmni(make_config([sd_stage(adapters, request_batch_max_wait_ms=500)]))
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


@pytest.fixture(scope="module")
def reference(cache: Path, adapters: dict[str, str]) -> Iterator[DiffusionRunner]:
    """The same model and adapters in this process, for solo results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runner = DiffusionRunner(msgspec.convert(sd_stage(adapters), StageConfig))
    runner.load()
    yield runner
    torch.set_num_threads(threads)


def solo(runner: DiffusionRunner, prompt: str, **params: Any) -> np.ndarray:
    request = RunnerRequest("solo", prompt, diffusion_params({**DEFAULTS, "output_type": "np", **params}))
    (out,) = runner.execute([request], ExecuteContext(lambda rid: False))
    assert out.error is None, out.error
    return out.tensors["images"]


async def final(engine: AsyncOmni, prompt: str, **params: Any):
    outs = [out async for out in engine.generate(prompt, params)]
    return outs[-1]


async def test_waves_group_by_adapter_and_scale(engine: AsyncOmni, reference: DiffusionRunner) -> None:
    asked: list[dict[str, Any]] = [
        {"lora": {"name": "ink"}},
        {"lora": {"name": "oil"}},
        {},
        {"lora": {"name": "ink"}},
        {"lora": {"name": "oil"}},
        {},
        {"lora": {"name": "ink", "scale": 0.5}},
    ]
    outs = await asyncio.gather(
        *(final(engine, "a fox", seed=30 + i, output_type="np", **p) for i, p in enumerate(asked))
    )
    waves: dict[Any, set[int]] = {}
    for p, out in zip(asked, outs, strict=True):
        lora = p.get("lora")
        waves.setdefault(None if lora is None else (lora["name"], lora.get("scale", 1.0)), set()).add(
            out.metrics["batch_id"]
        )
    # One wave per adapter and scale, and no wave shared between two of them.
    assert all(len(ids) == 1 for ids in waves.values()), waves
    assert len(set().union(*waves.values())) == len(waves) == 4
    assert [o.metrics["batch_size"] for o in outs] == [2, 2, 2, 2, 2, 2, 1]
    for i, (p, out) in enumerate(zip(asked, outs, strict=True)):
        expected = solo(reference, "a fox", seed=30 + i, **p)
        np.testing.assert_allclose(out.tensors["images"], expected, rtol=0, atol=1e-4)
    # The adapters really applied: same seed and prompt, three different pictures.
    plain, ink, oil = (
        solo(reference, "a fox", seed=1, **p) for p in ({}, {"lora": {"name": "ink"}}, {"lora": {"name": "oil"}})
    )
    assert min(np.abs(plain - ink).max(), np.abs(plain - oil).max(), np.abs(ink - oil).max()) > 0.02


async def test_typed_params_and_dicts_both_work(engine: AsyncOmni) -> None:
    typed = DiffusionSamplingParams(seed=5, output_type="np", lora=LoraRequest(name="ink", scale=0.8))
    a = [out async for out in engine.generate("a cat", typed)][-1]
    b = await final(engine, "a cat", seed=5, output_type="np", lora={"name": "ink", "scale": 0.8})
    assert np.array_equal(a.tensors["images"], b.tensors["images"])


LORA_VALUES = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.one_of(ANY_TEXT, JSON_VALUES),
            "path": st.one_of(ANY_TEXT, st.sampled_from(["user/repo", "relative/dir", "/a\x00b", "/" + "x" * 5000])),
            "scale": st.one_of(ANY_FLOAT, JSON_VALUES),
            "extra": JSON_VALUES,
        },
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=LORA_VALUES)
def test_hostile_lora_values_are_refused_at_the_call(engine: AsyncOmni, value: Any) -> None:
    try:
        valid = engine.validate("a cat", {"lora": value})
    except InvalidRequestError as e:
        assert e.param is not None and e.param.startswith("lora")
        return
    # Only a well-formed one passes (or none): one of name/path, a finite scale in range.
    lora = valid.params[0].get("lora")
    if value is None:
        assert lora is None
        return
    assert ("name" in lora) != ("path" in lora)
    assert -10 <= lora["scale"] <= 10


async def test_bad_adapters_fail_their_request_and_the_engine_serves_on(
    engine: AsyncOmni, adapters: dict[str, str], tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await final(engine, "a cat", lora={"name": "watercolor"})
    assert info.value.param == "lora.name" and "ink, oil" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        await final(engine, "a cat", lora={"path": str(tmp_path / "nothing-here")})
    assert info.value.param == "lora.path"
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "pytorch_lora_weights.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(LoraFormatError) as info:  # refused from its header: no loader reads it
        await final(engine, "a cat", lora={"path": str(junk)})
    assert info.value.param == "lora.path"
    out = await final(engine, "a cat", seed=1)
    assert out.finished and len(out.images) == 1
    assert (await final(engine, "a cat", lora={"name": "ink"})).finished


async def test_control_calls_add_list_and_remove(engine: AsyncOmni, adapters: dict[str, str]) -> None:
    [res] = await engine.collective_rpc("add_lora", kwargs={"name": "late", "path": adapters["oil"], "load": True})
    assert res.ok and res.result == {"name": "late", "path": adapters["oil"], "loaded": True}
    [res] = await engine.collective_rpc("list_loras")
    assert res.ok and res.result["registered"] == {
        "ink": adapters["ink"],
        "oil": adapters["oil"],
        "late": adapters["oil"],
    }
    assert len(res.result["loaded"]) <= 2 and res.result["max_loras"] == 2
    late = await final(engine, "a cat", seed=2, output_type="np", lora={"name": "late"})
    oil = await final(engine, "a cat", seed=2, output_type="np", lora={"name": "oil"})
    assert np.array_equal(late.tensors["images"], oil.tensors["images"])  # one file, two names
    [res] = await engine.collective_rpc("remove_lora", kwargs={"name": "late"})
    assert res.ok and res.result["removed"] and not res.result["unloaded"]  # "oil" still names it
    with pytest.raises(InvalidRequestError):
        await final(engine, "a cat", lora={"name": "late"})
    for method, kwargs in (
        ("add_lora", {"name": "x y", "path": adapters["ink"]}),
        ("add_lora", {"name": "x", "path": "user/repo"}),
        ("add_lora", {"name": "x"}),
        ("remove_lora", {"name": "never-added"}),
    ):
        [res] = await engine.collective_rpc(method, kwargs=kwargs)
        assert not res.ok and res.error
    assert (await final(engine, "a cat")).finished


async def anext_all(stream) -> list:
    return [out async for out in stream]


async def stage_rss(engine: AsyncOmni) -> int:
    [res] = await engine.collective_rpc("get_stats")
    return psutil.Process(res.result["pid"]).memory_info().rss


async def test_a_failed_add_lora_changes_nothing(engine: AsyncOmni, adapters: dict[str, str], tmp_path: Path) -> None:
    before = await final(engine, "a cat", seed=6, output_type="np", lora={"name": "ink"})
    # LoRA-shaped bytes that are not LoRA weights: the model's own VAE passes the file checks and
    # fails in the loader, after which the old adapter must still be serving.
    vae = str(Path(resolve_model("builtin:tiny-sd")) / "vae" / "diffusion_pytorch_model.safetensors")
    for name in ("ink", "fresh"):
        [res] = await engine.collective_rpc("add_lora", kwargs={"name": name, "path": vae, "load": True})
        assert not res.ok and "LoraLoadError" in res.error
    [res] = await engine.collective_rpc("list_loras")
    assert res.result["registered"] == {"ink": adapters["ink"], "oil": adapters["oil"]}
    after = await final(engine, "a cat", seed=6, output_type="np", lora={"name": "ink"})
    assert np.array_equal(before.tensors["images"], after.tensors["images"])


async def test_hostile_adapter_files_are_400s_in_milliseconds_and_the_stage_serves_on(
    engine: AsyncOmni, adapters: dict[str, str], tmp_path: Path
) -> None:
    pickled = bin_adapter(Path(adapters["ink"]), tmp_path / "pickled")
    nan = nan_adapter(Path(adapters["ink"]), tmp_path / "nan")
    huge = tmp_path / "huge.safetensors"
    with huge.open("wb") as f:
        f.truncate(3 * 2**30)  # sparse: the stage used to read all of it (6.6 GB RSS, ~40 s)
    rss = await stage_rss(engine)
    for path, why in (
        (pickled, "safetensors only"),
        (pickled / "pytorch_lora_weights.bin", "safetensors only"),
        (huge, "max_lora_file_mb"),
        (nan, "NaN or infinite"),
    ):
        start = time.monotonic()
        with pytest.raises(LoraFormatError, match=why) as info:
            await final(engine, "a cat", lora={"path": str(path)})
        assert info.value.param == "lora.path" and time.monotonic() - start < 5, path
        [res] = await engine.collective_rpc("add_lora", kwargs={"name": "hostile", "path": str(path), "load": True})
        assert not res.ok and "LoraFormatError" in res.error
    assert await stage_rss(engine) - rss < 200 * 2**20
    [res] = await engine.collective_rpc("list_loras")
    assert "hostile" not in res.result["registered"]
    assert (await final(engine, "a cat", lora={"name": "ink"})).finished
    assert (await final(engine, "a cat")).finished


async def test_a_stage_without_lora_support_refuses_it_before_enqueue(cache: Path) -> None:
    """A stage of the split SD pipeline takes diffusion params but no adapter: it must say so at
    the call, not run the request without the adapter."""
    split = make_config(
        [
            {
                "stage_id": 0,
                "stage_type": "omni_runtime.stage.runners.sd_split:SDTextEncoderRunner",
                "model": "builtin:tiny-sd",
                "runtime": {"backend": "inproc"},
                "final_output": True,
                "final_output_type": "tensor",
            }
        ]
    )
    async with AsyncOmni(split) as other:
        with pytest.raises(InvalidRequestError, match="does not take LoRA") as info:
            other.validate("x", {"lora": {"name": "ink"}})
        assert info.value.param == "lora"


# ---------------------------------------------------------------------------- step execution


@pytest.fixture(scope="module")
async def stepping(cache: Path, adapters: dict[str, str]):
    engine = AsyncOmni(make_config([sd_stage(adapters, step_execution=True, max_num_seqs=4)]))
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


async def test_step_execution_runs_each_adapter_in_its_own_step_batches(
    stepping: AsyncOmni, reference: DiffusionRunner
) -> None:
    asked = [{"lora": {"name": "ink"}}, {"lora": {"name": "oil", "scale": 0.7}}, {}, {"lora": {"name": "ink"}}]
    outs = await asyncio.gather(
        *(final(stepping, "a fox", seed=40 + i, output_type="np", **p) for i, p in enumerate(asked))
    )
    for i, (p, out) in enumerate(zip(asked, outs, strict=True)):
        assert out.finished and out.metrics["steps_run"] == DEFAULTS["num_inference_steps"]
        expected = solo(reference, "a fox", seed=40 + i, **p)
        np.testing.assert_allclose(out.tensors["images"], expected, rtol=0, atol=1e-3)
    # Only the two "ink" requests can share a step; every other one steps alone.
    assert [o.metrics["batch_size"] for o in outs] == [2, 1, 1, 2]
    [res] = await stepping.collective_rpc("list_loras")
    assert res.ok and res.result["loads"] == 2


async def test_re_pointing_a_name_mid_denoise_keeps_the_running_requests_adapter(
    stepping: AsyncOmni, reference: DiffusionRunner, adapters: dict[str, str]
) -> None:
    """A request pinned to the file its name pointed at when it was admitted: ``add_lora`` moving
    the name to another file between two of its steps does not switch its adapter half way (its
    image used to match neither adapter). Later requests get the new file."""
    steps = 120
    params = {"seed": 9, "num_inference_steps": steps, "output_type": "np", "lora": {"name": "ink"}}
    stream = stepping.generate("a fox", params, "pinned")
    first = await stream.__anext__()  # its first step is done
    assert first.progress.step >= 1 and not first.finished
    running = asyncio.create_task(anext_all(stream))
    try:
        [res] = await stepping.collective_rpc("add_lora", kwargs={"name": "ink", "path": adapters["oil"]})
        assert res.ok
        assert not running.done()  # the re-point landed while the request was still stepping
        out = (await running)[-1]
        assert out.metrics["steps_run"] == steps
        ink = solo(reference, "a fox", seed=9, num_inference_steps=steps, lora={"name": "ink"})
        np.testing.assert_allclose(out.tensors["images"], ink, rtol=0, atol=1e-3)
        later = await final(stepping, "a fox", seed=9, output_type="np", lora={"name": "ink"})
        oil = solo(reference, "a fox", seed=9, lora={"name": "oil"})
        np.testing.assert_allclose(later.tensors["images"], oil, rtol=0, atol=1e-3)
    finally:
        [res] = await stepping.collective_rpc("add_lora", kwargs={"name": "ink", "path": adapters["ink"]})
        assert res.ok
