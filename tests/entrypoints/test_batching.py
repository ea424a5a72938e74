"""Request-level batching on tiny-sd in a real stage process: fused waves, per-request seeds,
isolation of a failing request, abort mid-forward."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from omni_runtime import AsyncOmni
from omni_runtime.exceptions import InvalidRequestError, RequestAbortedError, StageExecutionError
from tests.conftest import eventually, has_progress, make_config

DEFAULTS = {"num_inference_steps": 4, "guidance_scale": 7.5, "height": 64, "width": 64}


def sd_stage(**engine_args):
    return {
        "stage_id": 0,
        "stage_type": "tests.helpers:PoisonableDiffusion",
        "model": "builtin:tiny-sd",
        "final_output": True,
        "final_output_type": "image",
        "default_sampling_params": DEFAULTS,
        "engine_args": {"max_num_seqs": 4, "request_batch_max_wait_ms": 200, **engine_args},
        # One torch thread: intra-op threads that wait for each other slow down badly on a busy
        # machine (the batched and the solo runs of a comparison both run on it).
        "runtime": {"torch_threads": 1},
    }


@pytest.fixture(scope="module")
async def engine():
    engine = AsyncOmni(make_config([sd_stage()]))
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


async def run(engine, prompt, outs=None, **params):
    """The request's last output; ``outs`` (a list) gets every output as it arrives."""
    out = None
    async for item in engine.generate(prompt, params):
        out = item
        if outs is not None:
            outs.append(item)
    return out


async def test_eight_concurrent_requests_run_as_two_fused_waves(engine):
    outs = await asyncio.gather(*(run(engine, f"prompt {i}", seed=i) for i in range(8)))
    sizes = [o.metrics["batch_size"] for o in outs]
    waves = {o.metrics["batch_id"] for o in outs}
    assert sizes == [4] * 8 and len(waves) == 2
    assert [o.metrics["seed"] for o in outs] == list(range(8))
    stats = (await engine.collective_rpc("get_stats"))[0].result
    assert stats["batch_size_histogram"].get("4", 0) >= 2


async def test_each_request_equals_its_solo_run_within_tolerance(engine):
    # float output: |Δ| <= 1e-4; uint8 images: at most one level (batched CPU math is not bitwise).
    batched = await asyncio.gather(*(run(engine, f"a red fox {i}", seed=100 + i, output_type="np") for i in range(4)))
    assert {o.metrics["batch_size"] for o in batched} == {4}
    for i, out in list(enumerate(batched))[:2]:
        solo = await run(engine, f"a red fox {i}", seed=100 + i, output_type="np")
        assert solo.metrics["batch_size"] == 1
        np.testing.assert_allclose(out.tensors["images"], solo.tensors["images"], atol=1e-4, rtol=0)
    pil_batched = await asyncio.gather(*(run(engine, f"cat {i}", seed=7 + i) for i in range(4)))
    pil_solo = await run(engine, "cat 2", seed=9)
    diff = np.abs(np.asarray(pil_batched[2].images[0], np.int16) - np.asarray(pil_solo.images[0], np.int16))
    assert diff.max() <= 1


async def test_incompatible_requests_are_not_fused(engine):
    outs = await asyncio.gather(
        run(engine, "a", seed=1),
        run(engine, "b", seed=2, height=32),
        run(engine, "c", seed=3),
        run(engine, "d", seed=4, height=32),
    )
    by_size = {}
    for o in outs:
        by_size.setdefault(o.images[0].size, set()).add(o.metrics["batch_id"])
    assert by_size[(64, 64)].isdisjoint(by_size[(64, 32)])
    assert all(len(ids) == 1 for ids in by_size.values())  # each size ran as one wave


async def test_a_poisoned_request_fails_alone(engine):
    results = await asyncio.gather(
        *(run(engine, "poison" if i == 2 else f"fine {i}", seed=i) for i in range(4)), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(results[2], StageExecutionError)
    assert results[2].stage_id == 0 and "poisoned" in str(results[2])
    assert all(r.images and r.error is None for i, r in enumerate(results) if i != 2)


async def test_abort_mid_forward_releases_the_caller_at_once(engine):
    steps = {"num_inference_steps": 300}
    slow_outs: list = []
    other_outs: list = []
    slow = asyncio.create_task(run(engine, "slow", slow_outs, seed=1, **steps))
    other = asyncio.create_task(run(engine, "other", other_outs, seed=2, **steps))
    await eventually(  # both are in a running forward: each has had progress from its steps
        lambda: has_progress(slow_outs) and has_progress(other_outs), timeout=60, what="a step of both requests"
    )
    first, second = list(engine.engine._channels.pending)
    start = time.monotonic()
    engine.abort(first)
    done, _ = await asyncio.wait({slow, other}, return_when=asyncio.FIRST_COMPLETED)
    assert time.monotonic() - start < 0.5
    with pytest.raises(RequestAbortedError):
        await done.pop()
    # Once every request of the wave is aborted the forward stops at its next step, so a new
    # request waits in the queue for a step or two, not for the rest of 300 steps.
    engine.abort(second)
    await asyncio.gather(slow, other, return_exceptions=True)
    after = await run(engine, "after", seed=3)
    # Machine load varies; compare with what the remaining steps would have cost at this speed.
    per_step_ms = after.metrics["execution_ms"] / 4
    assert after.images and after.metrics["queue_wait_ms"] < per_step_ms * 300 / 5


async def test_set_batching_changes_a_live_engine(engine):
    [res] = await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 2})
    assert res.ok and res.result["max_num_seqs"] == 2
    outs = await asyncio.gather(*(run(engine, f"p{i}", seed=i) for i in range(4)))
    assert {o.metrics["batch_size"] for o in outs} == {2}
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 0})
    await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 4})


@pytest.mark.parametrize(
    ("kwargs", "bound"),
    [
        ({"request_batch_max_wait_ms": 1e300}, "<= 60000"),
        ({"max_num_seqs": 2**62}, "<= 1024"),
        ({"request_batch_max_wait_ms": float("nan")}, ">= 0"),
        ({"request_batch_max_wait_ms": -1}, ">= 0"),
        ({"max_num_seqs": "4"}, "Expected `int`"),
        ({"max_num_seqs": True}, "Expected `int`"),
        ({"max_num_seqs": 4.0}, "Expected `int`"),
        ({"request_batch_max_wait_ms": [1]}, "Expected `float`"),
        ({"batch_quiet_window_ms": float("inf")}, "<= 60000"),
        ({"batch_quiet_window_ms": -0.5}, ">= 0"),
        ({"batch_quiet_window_ms": "5"}, "Expected `float`"),
        ({"max_wait": 5}, "takes only max_num_seqs, request_batch_max_wait_ms, batch_quiet_window_ms"),
    ],
)
async def test_set_batching_refuses_what_the_yaml_refuses_and_the_engine_serves_on(engine, kwargs, bound):
    [(name, _)] = kwargs.items()
    with pytest.raises(InvalidRequestError) as err:
        await engine.collective_rpc("set_batching", kwargs=kwargs)
    assert err.value.param == f"kwargs.{name}" and bound in str(err.value)
    # Nothing was applied: the YAML's values still hold, and requests are served.
    [res] = await engine.collective_rpc("set_batching", kwargs={})
    assert res.result["max_num_seqs"] == 4 and res.result["request_batch_max_wait_ms"] == 200
    assert res.result["batch_quiet_window_ms"] <= 200  # still adaptive: at most the wait
    out = await run(engine, "still serving", seed=1)
    assert out.images and out.error is None


async def test_a_lone_sequential_client_is_not_held_longer_and_longer(engine):
    # The longest wait a config allows. Each request is sent when the one before is answered;
    # the quiet window learned from gaps that held its own holds and forwards: 8, 25, 76 s.
    await engine.collective_rpc("set_batching", kwargs={"request_batch_max_wait_ms": 60_000})
    try:
        outs = [await run(engine, f"alone {i}", seed=i, num_inference_steps=1) for i in range(4)]
    finally:
        await engine.collective_rpc("set_batching", kwargs={"request_batch_max_wait_ms": 200})
    holds = [o.metrics["admission_wait_ms"] for o in outs]
    # Each hold is the window learned from the bursts of the tests before (the floor, 5 ms, on a
    # fresh engine), not 3 x the previous request's hold and forward.
    assert max(holds) <= holds[0] + 50, holds


async def test_one_step_past_the_schedulers_limit_is_refused_before_the_queue(engine):
    # tiny-sd's DDIM (steps_offset 1) indexes past its 1,000 training timesteps at 1,000 steps:
    # that was an IndexError mid-forward (StageExecutionError). That 999 runs through the pipeline
    # is shown on the runner itself (test_diffusion.py), where one torch thread makes it 10x cheaper.
    with pytest.raises(InvalidRequestError) as err:
        await run(engine, "too many", num_inference_steps=1000)
    assert err.value.param == "num_inference_steps" and "1..999" in str(err.value)
    [before] = await engine.collective_rpc("get_stats")
    assert (await run(engine, "fine", seed=1)).images
    [after] = await engine.collective_rpc("get_stats")  # served on, nothing failed
    assert after.result["requests_served"] == before.result["requests_served"] + 1
    assert after.result["requests_failed"] == before.result["requests_failed"]
