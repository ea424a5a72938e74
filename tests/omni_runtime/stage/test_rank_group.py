"""A replica that spans several processes (``runtime.parallel``): real rank groups over gloo.

Each group's images equal those of one process running the same requests alone (the model loaded
here, within float32 noise: ±1 uint8 level): CFG-parallel on tiny-sd (a UNet; request-level
waves) and tiny-sd3 (a transformer; step execution, a request joining a running batch), Ulysses
on tiny-flux (request-level), and both at once on tiny-wan (a video; four ranks, step
execution). A request with no seed gets one seed on every rank; LoRA control calls, sleep and
wake-up reach every rank; an abort leaves the group in step. A rank killed mid-wave or mid-step, or stopped
mid-step, fails what the group was running with StageDeadError within the collective bound; the
whole group is restarted (new processes, the old ones gone) and serves again.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest

from omni_runtime import Omni
from omni_runtime.config import ParallelConfig, StageConfig, load_config, parse_config
from omni_runtime.exceptions import RequestAbortedError, StageDeadError
from omni_runtime.models.tiny_lora import build_tiny_sd_lora
from omni_runtime.outputs import OmniRequestOutput
from omni_runtime.stage.parallel import apply_parallelism
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.helpers import diffusion_params

pytestmark = pytest.mark.integration

#: A stopped rank is given up after this long in one collective.
COLLECTIVE_S = 3.0


def group_config(model: str, parallel: dict[str, Any], *, step: bool = False, output: str = "image") -> Any:
    stage = {
        "stage_id": 0,
        "stage_type": "diffusion",
        "model": f"builtin:{model}",
        "runtime": {
            "devices": "cpu",
            "torch_threads": 1,
            "max_restarts": 5,
            "parallel": {**parallel, "collective_timeout_s": COLLECTIVE_S},
        },
        "engine_args": {"max_num_seqs": 4, "request_batch_max_wait_ms": 50, "step_execution": step},
        "final_output": True,
        "final_output_type": output,
        "default_sampling_params": dict(load_config(model).stage_args[0].default_sampling_params),
    }
    return parse_config({"stage_args": [stage]})


def reference(model: str) -> DiffusionRunner:
    """The model loaded in this process: what one rank alone makes."""
    runner = DiffusionRunner(
        msgspec.convert({"stage_id": 0, "stage_type": "diffusion", "model": f"builtin:{model}"}, StageConfig)
    )
    runner.load()
    return runner


def alone(runner: DiffusionRunner, model: str, prompt: str, **params: Any) -> np.ndarray:
    defaults = dict(load_config(model).stage_args[0].default_sampling_params)
    request = RunnerRequest(request_id="ref", prompt=prompt, params=diffusion_params({**defaults, **params}))
    (out,) = runner.execute([request], ExecuteContext(lambda rid: False))
    assert out.error is None, out.error
    return np.asarray(out.media[0].data)


def pixels(out: OmniRequestOutput) -> np.ndarray:
    assert out.error is None, out.error
    return np.asarray(out.media[0].data)


def assert_close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


def group(omni: Omni) -> dict[str, Any]:
    (stats,) = omni.collective_rpc("get_stats")
    assert stats.ok, stats.error
    return stats.result["parallel"]


def serving_again(omni: Omni, restarts: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (stage,) = omni.engine.health().stages
        if stage.restarts >= restarts and stage.live_replicas == 1:
            return
        time.sleep(0.1)
    raise AssertionError(f"the group was not restarted: {omni.engine.health()}")


def gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


def submit(
    pool: ThreadPoolExecutor, omni: Omni, prompt: str, request_id: str | None = None, **params: Any
) -> Future[OmniRequestOutput]:
    ids = None if request_id is None else [request_id]
    return pool.submit(lambda: omni.generate(prompt, params, use_tqdm=False, request_ids=ids)[0])


def aborted_and_serving(omni: Omni, pool: ThreadPoolExecutor, request_id: str) -> None:
    """An abort mid-run ends the request on every rank at the same step: the group goes on
    without a restart."""
    (stage,) = omni.engine.health().stages
    running = submit(pool, omni, "a long one", request_id, seed=8, num_inference_steps=400)
    time.sleep(1.0)
    asked = time.monotonic()
    omni._async.abort(request_id)
    out = running.result(timeout=30)
    assert isinstance(out.error, RequestAbortedError), out.error
    assert time.monotonic() - asked < 2
    (again,) = omni.generate("a cat", {"seed": 1}, use_tqdm=False)
    assert again.error is None
    assert omni.engine.health().stages[0].restarts == stage.restarts


# ------------------------------------------------------------------------------- CFG-parallel


@pytest.fixture(scope="module")
def sd(model_cache: Path) -> Iterator[Omni]:
    with Omni(group_config("tiny-sd", {"cfg_parallel_size": 2})) as omni:
        yield omni


@pytest.fixture(scope="module")
def sd_alone(model_cache: Path) -> DiffusionRunner:
    return reference("tiny-sd")


def test_cfg_parallel_on_a_unet_makes_the_images_of_one_process(sd: Omni, sd_alone: DiffusionRunner) -> None:
    info = group(sd)
    assert info["world_size"] == 2 and len(set(info["rank_pids"])) == 2
    assert info["applied"] == "unet: cfg-parallel 2"
    # One fused wave of two requests with their own guidance: 4 rows, 2 on each rank.
    outs = sd.generate(["a cat", "a dog"], [{"seed": 1}, {"seed": 2, "guidance_scale": 3.0}], use_tqdm=False)
    assert_close(pixels(outs[0]), alone(sd_alone, "tiny-sd", "a cat", seed=1))
    assert_close(pixels(outs[1]), alone(sd_alone, "tiny-sd", "a dog", seed=2, guidance_scale=3.0))


def test_a_request_without_a_seed_gets_the_same_one_on_every_rank(sd: Omni, sd_alone: DiffusionRunner) -> None:
    (out,) = sd.generate("a bird", use_tqdm=False)
    # Ranks that drew their own noise would mix two images' halves: not this seed's image.
    assert_close(pixels(out), alone(sd_alone, "tiny-sd", "a bird", seed=out.metrics["seed"]))


def test_a_lora_added_by_a_control_call_is_on_every_rank(sd: Omni, sd_alone: DiffusionRunner, tmp_path: Path) -> None:
    adapter = str(build_tiny_sd_lora(tmp_path / "oil", seed=1))
    (added,) = sd.collective_rpc("add_lora", kwargs={"name": "oil", "path": adapter})
    assert added.ok, added.error
    sd_alone.rpc_add_lora("oil", adapter)
    lora = {"name": "oil", "scale": 1.0}
    (out,) = sd.generate("a cat", {"seed": 1, "lora": lora}, use_tqdm=False)
    # A rank without the adapter would give its half of the rows the base model's prediction.
    expected = alone(sd_alone, "tiny-sd", "a cat", seed=1, lora=lora)
    assert_close(pixels(out), expected)
    assert np.abs(expected.astype(int) - alone(sd_alone, "tiny-sd", "a cat", seed=1).astype(int)).max() > 8


def test_sleep_and_wake_up_reach_every_rank(sd: Omni, sd_alone: DiffusionRunner) -> None:
    for call in ("sleep", "wake_up"):
        (done,) = sd.collective_rpc(call)
        assert done.ok, done.error
    # The woken pipeline is new on each rank; the ranks still meet in each call, in step.
    (out,) = sd.generate("a fox", {"seed": 9}, use_tqdm=False)
    assert_close(pixels(out), alone(sd_alone, "tiny-sd", "a fox", seed=9))
    assert group(sd)["applied"] == "unet: cfg-parallel 2"


def test_ulysses_on_a_unet_is_refused_for_its_missing_plan(sd_alone: DiffusionRunner) -> None:
    with pytest.raises(ValueError, match="no context-parallel plan"):
        apply_parallelism(sd_alone.pipe, ParallelConfig(ulysses_degree=2), "cpu")


def test_an_abort_mid_wave_leaves_the_group_in_step(sd: Omni, pool) -> None:
    aborted_and_serving(sd, pool, "abort-wave")


def killed_mid_run(omni: Omni, pool: ThreadPoolExecutor) -> None:
    """A rank SIGKILLed while the group runs a request: the request fails with StageDeadError at
    once, the whole group is replaced by a new one (new processes, the old ones gone)."""
    (stage,) = omni.engine.health().stages
    before = group(omni)["rank_pids"]
    running = submit(pool, omni, "a long one", seed=3, num_inference_steps=400)
    time.sleep(1.0)  # it is running
    killed = time.monotonic()
    os.kill(before[1], signal.SIGKILL)
    out = running.result(timeout=30)
    assert isinstance(out.error, StageDeadError), out.error
    assert time.monotonic() - killed < 5
    serving_again(omni, restarts=stage.restarts + 1)
    assert gone(before)
    after = group(omni)["rank_pids"]
    assert not set(after) & set(before)


def test_a_rank_killed_mid_wave_fails_it_and_the_group_restarts(sd: Omni, sd_alone: DiffusionRunner, pool) -> None:
    killed_mid_run(sd, pool)
    (again,) = sd.generate("a cat", {"seed": 1}, use_tqdm=False)
    assert_close(pixels(again), alone(sd_alone, "tiny-sd", "a cat", seed=1))


# ------------------------------------------------------------- CFG-parallel, step execution


@pytest.fixture(scope="module")
def sd3(model_cache: Path) -> Iterator[Omni]:
    with Omni(group_config("tiny-sd3", {"cfg_parallel_size": 2}, step=True)) as omni:
        yield omni


def test_cfg_parallel_steps_with_a_request_joining_mid_run(sd3: Omni, pool) -> None:
    sd3_alone = reference("tiny-sd3")
    assert group(sd3)["applied"] == "transformer: cfg-parallel 2"
    long = submit(pool, sd3, "a long one", seed=4, num_inference_steps=200)
    time.sleep(0.5)
    short = submit(pool, sd3, "a short one", seed=5)
    first, second = long.result(timeout=60), short.result(timeout=60)
    # The short one joined the running batch at a step boundary and left it first.
    assert second.metrics["finished_at"] < first.metrics["finished_at"]
    assert_close(pixels(first), alone(sd3_alone, "tiny-sd3", "a long one", seed=4, num_inference_steps=200))
    assert_close(pixels(second), alone(sd3_alone, "tiny-sd3", "a short one", seed=5))


def test_an_abort_at_a_step_boundary_leaves_the_group_in_step(sd3: Omni, pool) -> None:
    aborted_and_serving(sd3, pool, "abort-step")


def test_a_rank_killed_mid_step_fails_the_batch_and_the_group_restarts(sd3: Omni, pool) -> None:
    killed_mid_run(sd3, pool)


def test_a_rank_stopped_mid_step_fails_the_batch_within_the_bound(sd3: Omni, pool) -> None:
    (stage,) = sd3.engine.health().stages
    before = group(sd3)["rank_pids"]
    running = submit(pool, sd3, "a long one", seed=6, num_inference_steps=400)
    time.sleep(1.0)
    stopped = time.monotonic()
    os.kill(before[1], signal.SIGSTOP)
    try:
        out = running.result(timeout=60)
        assert isinstance(out.error, StageDeadError), out.error
        assert time.monotonic() - stopped < 2 * COLLECTIVE_S + 5
        serving_again(sd3, restarts=stage.restarts + 1)
        assert gone(before)  # the stopped rank too: it dies with rank 0
    finally:
        if psutil.pid_exists(before[1]):
            os.kill(before[1], signal.SIGKILL)
    (again,) = sd3.generate("a cat", {"seed": 1}, use_tqdm=False)
    assert again.error is None


# ------------------------------------------------------------------------------- Ulysses


@pytest.fixture(scope="module")
def flux(model_cache: Path) -> Iterator[Omni]:
    with Omni(group_config("tiny-flux", {"ulysses_degree": 2})) as omni:
        yield omni


def test_ulysses_on_flux_makes_the_images_of_one_process(flux: Omni) -> None:
    assert group(flux)["applied"] == "transformer: ulysses 2 x ring 1"
    outs = flux.generate(["a cat", "a dog"], [{"seed": 1}, {"seed": 2}], use_tqdm=False)
    flux_alone = reference("tiny-flux")
    assert_close(pixels(outs[0]), alone(flux_alone, "tiny-flux", "a cat", seed=1))
    assert_close(pixels(outs[1]), alone(flux_alone, "tiny-flux", "a dog", seed=2))


def test_cfg_halves_each_split_by_ulysses_step_a_video_as_one_process_does(model_cache: Path) -> None:
    """Four ranks: the guided step's two halves, each half's tokens over two ranks (Wan's step
    loop batches both halves in one denoiser call)."""
    parallel = {"cfg_parallel_size": 2, "ulysses_degree": 2}
    with Omni(group_config("tiny-wan", parallel, step=True, output="video")) as wan:
        outs = wan.generate(["a boat", "a kite"], [{"seed": 7}, {"seed": 8, "guidance_scale": 3.0}], use_tqdm=False)
        info = group(wan)
        assert len(set(info["rank_pids"])) == 4
        assert info["applied"] == "transformer: ulysses 2 x ring 1 + cfg-parallel 2"
    assert gone(info["rank_pids"])  # no rank outlives its engine
    wan_alone = reference("tiny-wan")
    assert_close(pixels(outs[0]), alone(wan_alone, "tiny-wan", "a boat", seed=7))
    assert_close(pixels(outs[1]), alone(wan_alone, "tiny-wan", "a kite", seed=8, guidance_scale=3.0))
