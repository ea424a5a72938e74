"""A runner that raises on one prompt of a fused batch, or hangs: the fault stays with its request.

* ``poison`` raises for the whole fused forward; the worker re-runs the wave one request at a
  time, so exactly that request fails and the seven it was fused with succeed.
* ``hang`` blocks the forward until its request is aborted; the request's deadline fires
  (RequestTimeoutError), which aborts it in the stage, and meanwhile the worker keeps answering
  control calls (they run on its event loop, not on the blocked forward thread) and another
  replica keeps serving.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from omni_runtime.exceptions import RequestTimeoutError, StageExecutionError
from tests.reliability.support import close, eventually, fault_stage, last, pids, start, stats, status


@pytest.fixture(scope="module")
async def one():
    """One replica that fuses up to 8 requests (it holds a wave briefly for a burst to join)."""
    engine = start(fault_stage(max_restarts=0, request_batch_max_wait_ms=200))
    yield engine
    await close(engine)


@pytest.fixture(scope="module")
async def two():
    engine = start(fault_stage(replicas=2, max_restarts=0))
    yield engine
    await close(engine)


async def test_one_poisoned_prompt_in_a_fused_batch_fails_alone(one):
    before = (await stats(one))[0]
    prompts = [f"fine-{i}" for i in range(8)]
    prompts[3] = "poison-3"
    results = await asyncio.gather(*(last(one, p) for p in prompts), return_exceptions=True)

    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(results[3], StageExecutionError), results
    assert results[3].stage_id == 0 and "poisoned batch of 1" in str(results[3])
    outs = [r for i, r in enumerate(results) if i != 3]
    assert [o.text for o in outs] == [p for i, p in enumerate(prompts) if i != 3]

    # They were fused: one wave of eight (then the retries, one by one, outside the scheduler).
    assert len({o.metrics["batch_id"] for o in outs}) == 1
    after = (await stats(one))[0]
    hist_before, hist_after = before["batch_size_histogram"], after["batch_size_histogram"]
    assert hist_after.get("8", 0) - hist_before.get("8", 0) == 1
    assert after["waves"] - before["waves"] == 1
    assert after["requests_served"] - before["requests_served"] == 7
    assert after["requests_failed"] - before["requests_failed"] == 1
    assert status(one).restarts == 0


async def test_a_hanging_forward_times_out_and_the_worker_keeps_answering(one):
    [pid] = (await pids(one)).values()
    start_hang = time.monotonic()
    hang = asyncio.create_task(last(one, "hang", {"timeout": 1.5}))
    # Requests that arrive behind the hung wave wait for it, with their own (longer) deadlines.
    await eventually(lambda: status(one).inflight == 1, what="the hang reaching the stage")

    async def hang_running() -> bool:
        # Past its admission hold: requests sent now queue behind the wave instead of joining it.
        return (await stats(one))[0]["running"] == 1

    await eventually(hang_running, what="the hang's wave running")
    behind = [asyncio.create_task(last(one, f"behind-{i}", {"timeout": 10})) for i in range(3)]

    # The forward thread is blocked; control calls are still answered at once.
    await asyncio.sleep(0.2)
    for _ in range(5):
        t = time.monotonic()
        assert await pids(one) == {0: pid}
        assert time.monotonic() - t < 0.5
    s = (await stats(one))[0]
    assert s["running"] == 1 and s["queue_len"] == 3

    with pytest.raises(RequestTimeoutError):
        await hang
    assert 1.4 < time.monotonic() - start_hang < 2.5
    # The deadline aborted the forward in the stage, so what queued behind it runs now.
    outs = await asyncio.wait_for(asyncio.gather(*behind), 2.0)
    assert [o.text for o in outs] == [f"behind-{i}" for i in range(3)]
    t = time.monotonic()
    assert (await last(one, "next")).text == "next"
    assert time.monotonic() - t < 0.5
    s = (await stats(one))[0]
    assert (s["running"], s["queue_len"]) == (0, 0)
    assert await pids(one) == {0: pid} and status(one).restarts == 0


async def test_a_hanging_replica_does_not_stop_the_other_one(two):
    before = await pids(two)
    hang = asyncio.create_task(last(two, "hang", {"timeout": 2.0}))
    await eventually(lambda: sum(status(two).per_replica_inflight) == 1, what="the hang routed")
    other = 1 - status(two).per_replica_inflight.index(1)
    for i in range(10):
        t = time.monotonic()
        out = await last(two, f"served-{i}")
        assert out.text == f"served-{i}" and out.metrics["replica_id"] == other
        assert time.monotonic() - t < 0.5
    results = await two.collective_rpc("ping", timeout=1)
    assert [r.ok for r in results] == [True, True]
    assert not hang.done()
    with pytest.raises(RequestTimeoutError):
        await hang
    await eventually(lambda: status(two).inflight == 0, what="the hang released")
    outs = await asyncio.gather(*(last(two, f"after-{i}", {"delay_ms": 50}) for i in range(4)))
    assert {o.metrics["replica_id"] for o in outs} == {0, 1}
    assert await pids(two) == before
