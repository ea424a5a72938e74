"""Multi-stage pipelines on real stage processes: tiny-omni (text -> image), replicas, abort and
errors across stages, and tensors through shared memory without leaking it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import numpy as np
import pytest

from omni_runtime import AsyncOmni, Omni, shm
from omni_runtime.events import Final, Progress, StageDone, TextDelta
from omni_runtime.exceptions import InvalidRequestError, RequestAbortedError, StageDeadError, StageExecutionError
from tests.conftest import children, echo_stage, make_config, shm_segments
from tests.multistage_helpers import payload

SOURCE = "tests.multistage_helpers:TensorSourceRunner"
FLAKY = "tests.helpers:FlakyRunner"


def two_stage(first: dict | None = None, second: dict | None = None, **top: object):
    """Stage 0 -> stage 1 (final, text); stage 0 is not final unless ``first`` says so."""
    s0 = echo_stage(0, **{"final_output": False, "final_output_type": None, **(first or {})})
    s1 = echo_stage(1, **{"engine_input_source": [0], **(second or {})})
    return make_config([s0, s1], **top)


async def run(engine, prompt, params=None, **kw):
    return [out async for out in engine.generate(prompt, params, **kw)]


async def stats(engine, stage_id: int) -> list[dict]:
    return [r.result for r in await engine.collective_rpc("get_stats", stage_ids=[stage_id], timeout=5)]


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


@pytest.fixture
def no_leaks():
    """No child process and no runtime segment left behind. (conftest's no_leaks compares all of
    /dev/shm, where other programs on the machine come and go; this one looks at ours only.)"""
    before_shm = set(shm.segment_names(shm.NAME_ROOT + "-"))
    before = {p.pid for p in children()}
    yield
    assert not [p.pid for p in children() if p.pid not in before and p.is_running() and p.status() != "zombie"]
    assert set(shm.segment_names(shm.NAME_ROOT + "-")) - before_shm == set()


def engine_segments(engine) -> set[str]:
    prefix = engine.engine._orchestrator.backends["process"].shm_prefix
    return {n for n in shm_segments() if n.startswith(prefix + "-")}


# --------------------------------------------------------------------------- tiny-omni


@pytest.fixture(scope="module")
async def omni_async():
    # Progress at every denoising step: a few steps show it, and nothing waits for the throttle.
    engine = AsyncOmni("tiny-omni", progress_interval_s=0)
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


async def test_tiny_omni_streams_text_deltas_then_delivers_the_image(omni_async):
    outs = await run(omni_async, "a red fox in the snow", [{"seed": 1}, {"seed": 2}])
    deltas = [o for o in outs if o.text_delta is not None]
    assert deltas and all(o.stage_id == 0 and not o.finished for o in deltas)
    final = outs[-1]
    assert final.finished and [o.finished for o in outs].count(True) == 1
    text = final.outputs_by_stage[0].text
    assert text and "".join(o.text_delta for o in deltas) == text
    assert final.text == text
    assert len(final.images) == 1 and final.images[0].size == (64, 64)
    assert final.outputs_by_stage[1].images and final.metrics["seed"] == 2


async def test_tiny_omni_events_say_the_text_stage_done_then_each_step_then_the_image(omni_async):
    steps = 3
    params = [{"seed": 1}, {"seed": 2, "num_inference_steps": steps}]
    # Only the image asked for: the text stage is an inner one, whose text goes to stage 1 only.
    events = [e async for e in omni_async.events("a red fox", params, request_id="fox", modalities=["image"])]
    kinds = [(type(e).__name__, getattr(e, "stage", None)) for e in events]
    expected = [("StageDone", 0), *[("Progress", 1)] * steps, ("StageDone", 1), ("Final", None)]
    assert kinds == expected
    assert not any(isinstance(e, TextDelta) for e in events)
    assert [(e.step, e.steps) for e in events if isinstance(e, Progress)] == [(i, steps) for i in range(1, steps + 1)]
    inner, image = (e for e in events if isinstance(e, StageDone))
    assert inner.result is None and inner.metrics["execution_ms"] >= 0  # its timings, not its text
    final = events[-1]
    assert isinstance(final, Final) and final.error is None
    out = final.output
    assert out.finished and out.request_id == "fox" and sorted(out.outputs_by_stage) == [1]
    assert image.result is out.outputs_by_stage[1] and len(image.result.images) == 1
    assert image.metrics["seed"] == 2 and image.metrics["e2e_ms"] > 0


async def test_tiny_omni_text_modality_stops_after_the_text_stage(omni_async):
    served = (await stats(omni_async, 1))[0]["requests_served"]
    outs = await run(omni_async, "a lighthouse", modalities=["text"])
    assert outs[-1].finished and sorted(outs[-1].outputs_by_stage) == [0]
    assert outs[-1].text and outs[-1].images == []
    assert (await stats(omni_async, 1))[0]["requests_served"] == served


async def test_stages_and_entry_stages_run_only_part_of_the_pipeline(relay):
    served = [(await stats(relay, sid))[0]["requests_served"] for sid in (0, 1)]
    valid = relay.validate("inner", stages=[0])
    outs = await run(relay, valid)
    assert outs[-1].finished and sorted(outs[-1].outputs_by_stage) == [0]
    assert outs[-1].outputs_by_stage[0].text == "inner"
    assert [(await stats(relay, sid))[0]["requests_served"] for sid in (0, 1)] == [served[0] + 1, served[1]]
    # Both stages, named: the whole pipeline, each stage's output delivered.
    outs = await run(relay, relay.validate("both", stages=[0, 1]))
    assert sorted(outs[-1].outputs_by_stage) == [0, 1]
    # Entering at stage 1: the prompt goes to it as it is, and stage 0 never runs.
    served = [(await stats(relay, sid))[0]["requests_served"] for sid in (0, 1)]
    outs = await run(relay, relay.validate("straight to 1", entry_stages=[1]))
    assert sorted(outs[-1].outputs_by_stage) == [1] and outs[-1].text == "straight to 1"
    assert [(await stats(relay, sid))[0]["requests_served"] for sid in (0, 1)] == [served[0], served[1] + 1]
    with pytest.raises(InvalidRequestError, match="is not fed") as err:
        relay.validate("x", stages=[0], entry_stages=[1])
    assert err.value.param == "entry_stages"


@pytest.mark.parametrize(
    ("stages", "says"),
    [([], "non-empty"), ("0", "non-empty"), ([2], "no stage 2"), ([True], "no stage True"), ([0.0], "no stage 0.0"),
     ([0, 0], "each stage id once"), ([2**80], "no stage")],
)  # fmt: skip
async def test_stages_refuses_what_names_no_stage_of_the_pipeline(relay, stages, says):
    with pytest.raises(InvalidRequestError, match=says) as err:
        relay.validate("x", stages=stages)
    assert err.value.param == "stages"
    with pytest.raises(InvalidRequestError, match="not both"):
        relay.validate("x", modalities=["text"], stages=[1])
    assert (await run(relay, "still serves"))[-1].text == "still serves"


def test_tiny_omni_generate_returns_text_and_image_per_prompt():
    with Omni("tiny-omni") as omni:
        prompts = ["a cup of coffee", "a toy dinosaur", "a fox yawning"]
        outs = omni.generate(prompts, use_tqdm=False)
    assert len(outs) == len(prompts)
    for out in outs:
        assert out.error is None and out.finished
        assert sorted(out.outputs_by_stage) == [0, 1]
        assert isinstance(out.text, str) and out.text == out.outputs_by_stage[0].text
        assert len(out.images) == 1 and out.images[0].mode == "RGB"


# --------------------------------------------------------------------------- replicas


async def test_load_spreads_over_replicas_and_rpc_reaches_each():
    config = make_config([echo_stage(runtime={"num_replicas": 2}, engine_args={"max_num_seqs": 1})])
    async with AsyncOmni(config) as engine:
        outs = await asyncio.gather(*(run(engine, f"p{i}", {"delay_ms": 100}) for i in range(8)))
        assert [o[-1].text for o in outs] == [f"p{i}" for i in range(8)]
        used = {o[-1].metrics["replica_id"] for o in outs}
        assert used == {0, 1}
        per_replica = await stats(engine, 0)
        assert [s["replica_id"] for s in per_replica] == [0, 1]
        assert len({s["pid"] for s in per_replica}) == 2
        # Least-loaded routing: with one request per forward, each replica takes half.
        assert [s["requests_served"] for s in per_replica] == [4, 4]
        assert engine.engine.stage_status()[0].per_replica_inflight == [0, 0]


# --------------------------------------------------------------------------- abort and errors


@pytest.fixture(scope="module")
async def relay():
    """echo -> echo (final): either stage can be slowed with delay_ms."""
    engine = AsyncOmni(two_stage())
    yield engine
    await asyncio.get_running_loop().run_in_executor(None, engine.close)


async def test_abort_while_stage_1_runs_cancels_it_there(relay):
    before = [(await stats(relay, sid))[0]["requests_served"] for sid in (0, 1)]
    task = asyncio.create_task(run(relay, "slow", [None, {"delay_ms": 30_000}], request_id="abort-at-1"))

    async def running_at_1() -> bool:
        return (await stats(relay, 1))[0]["running"] == 1

    await wait_for(running_at_1)
    relay.abort("abort-at-1")
    with pytest.raises(RequestAbortedError):
        await task

    # Stage 1 got the abort: its 30 s forward stops at the next step, unanswered and uncounted.
    async def idle_at_1() -> bool:
        return (await stats(relay, 1))[0]["running"] == 0

    await wait_for(idle_at_1, timeout=2.0)
    after = [(await stats(relay, sid))[0]["requests_served"] for sid in (0, 1)]
    assert after == [before[0] + 1, before[1]]
    assert (await run(relay, "next"))[-1].text == "next"


async def test_abort_while_stage_0_runs_means_stage_1_never_sees_it(relay):
    served_1 = (await stats(relay, 1))[0]["requests_served"]
    task = asyncio.create_task(run(relay, "slow", [{"delay_ms": 500}, None], request_id="abort-at-0"))

    async def running_at_0() -> bool:
        return (await stats(relay, 0))[0]["running"] == 1

    await wait_for(running_at_0)
    relay.abort("abort-at-0")
    with pytest.raises(RequestAbortedError):
        await task
    await asyncio.sleep(0.8)  # past stage 0's delay: had it not been aborted, it would be at stage 1
    s1 = (await stats(relay, 1))[0]
    assert s1["requests_served"] == served_1 and s1["running"] == 0 and s1["queue_len"] == 0


@pytest.mark.parametrize("failing_stage", [0, 1])
async def test_a_stage_that_raises_fails_only_that_request_and_names_the_stage(failing_stage):
    # "poison" passes through the echo stage unchanged, so whichever stage is flaky raises on it.
    flaky = {"stage_type": FLAKY, "engine_args": {"max_num_seqs": 4, "request_batch_max_wait_ms": 50}}
    config = two_stage(flaky if failing_stage == 0 else None, flaky if failing_stage == 1 else None)
    async with AsyncOmni(config) as engine:
        results = await asyncio.gather(
            run(engine, "fine 1"), run(engine, "poison"), run(engine, "fine 2"), return_exceptions=True
        )
        assert isinstance(results[1], StageExecutionError) and "poisoned" in str(results[1])
        assert results[1].stage_id == failing_stage
        assert [r[-1].text for r in (results[0], results[2])] == ["fine 1", "fine 2"]
        if failing_stage == 0:
            assert (await stats(engine, 1))[0]["requests_served"] == 2  # never ran the poisoned one


# --------------------------------------------------------------------------- shared memory


async def test_tensors_between_stage_processes_leave_no_shared_memory_behind(no_leaks):
    """200 requests through source -> echo; half hand the source's tensor straight to the echo
    stage (only the tensor output is asked for), half are delivered too (so copied in the
    orchestrator and re-sent from its pool). The pools stay bounded by what is in flight, not by
    how many requests passed, and close removes every segment."""
    config = two_stage(
        {"stage_type": SOURCE, "final_output": True, "final_output_type": "text"},
        {"final_output_type": "tensor", "engine_args": {"max_num_seqs": 8}},
    )
    nbytes, width = 256 * 1024, 8
    async with AsyncOmni(config) as engine:

        async def one(i: int) -> None:
            params = [{"nbytes": nbytes, "fill": i, "torch": i % 3 == 0}, None]
            handed_off = i % 2 == 0
            outs = await run(engine, f"r{i}", params, modalities=["tensor"] if handed_off else None)
            final = outs[-1]
            assert sorted(final.outputs_by_stage) == ([1] if handed_off else [0, 1])
            got = np.asarray(final.outputs_by_stage[1].tensors["payload"])
            assert np.array_equal(got, payload(nbytes, i)), f"request {i} got the wrong tensor"

        # Hand-offs alone never touch the orchestrator's pool: no copy there.
        await asyncio.gather(*(one(i) for i in range(0, 2 * width, 2)))
        assert not any("-o-" in n for n in engine_segments(engine))
        counts = []
        for start in range(width, 200, width):
            await asyncio.gather(*(one(i) for i in range(start, min(start + width, 200))))
            segments = engine_segments(engine)
            counts.append(len(segments))
            # Three producers (source, echo, orchestrator), each with at most `width` arrays in
            # flight, plus at most a round whose release a busy consumer has not made yet (it
            # releases after it answered): bounded by the traffic in flight, however many pass.
            per_producer = Counter(n.rsplit("-", 1)[0] for n in segments)
            assert len(per_producer) == 3 and max(per_producer.values()) <= 2 * width, per_producer
        bound = 3 * 2 * width
        assert counts[-1] <= bound and sum(os.path.getsize(f"/dev/shm/{n}") for n in segments) <= bound << 20
    # no_leaks: every segment is gone after close.


async def test_a_crashed_stage_leaves_no_segments_and_its_successor_serves(no_leaks):
    config = two_stage(
        {"stage_type": SOURCE, "runtime": {"max_restarts": 1}},
        {"final_output_type": "tensor"},
    )
    async with AsyncOmni(config) as engine:
        params = [{"nbytes": 1 << 20}, None]
        await run(engine, "warm", params)
        dead = engine.engine._orchestrator.backends["process"].shm_prefix + "-s0r0g0-"
        assert any(n.startswith(dead) for n in shm_segments())
        with pytest.raises(StageDeadError) as info:
            await run(engine, "crash", params)
        assert info.value.stage_id == 0

        async def restarted() -> bool:
            return engine.engine.stage_status()[0].live_replicas == 1

        await wait_for(restarted, timeout=10.0)
        assert not any(n.startswith(dead) for n in shm_segments())
        out = (await run(engine, "again", params))[-1]
        assert np.array_equal(out.tensors["payload"], payload(1 << 20))


async def test_over_tcp_tensors_travel_as_frames_not_shared_memory(no_leaks):
    tcp = {"runtime": {"transport": "tcp"}}
    config = two_stage({"stage_type": SOURCE, **tcp}, {"final_output_type": "tensor", **tcp})
    before = shm_segments()
    async with AsyncOmni(config) as engine:
        out = (await run(engine, "x", [{"nbytes": 1 << 20, "fill": 3}, None]))[-1]
        assert np.array_equal(out.tensors["payload"], payload(1 << 20, 3))
        assert shm_segments() == before


async def test_sigkill_of_the_consumer_stage_frees_the_tensors_it_was_sent(no_leaks):
    """A tensor handed to a stage that dies before reading it goes back to its producer's pool."""
    config = two_stage(
        {"stage_type": SOURCE},
        # A restart left, so that the death is the stage's (StageDeadError), not the engine's.
        {"final_output_type": "tensor", "runtime": {"max_restarts": 1}},
    )
    async with AsyncOmni(config) as engine:
        [ping] = await engine.collective_rpc("ping", stage_ids=[1], timeout=5)
        os.kill(ping.result["pid"], signal.SIGSTOP)  # it can no longer read its socket
        try:
            task = asyncio.create_task(run(engine, "x", [{"nbytes": 1 << 20}, None], modalities=["tensor"]))
            client = engine.engine._orchestrator.pools[1].replicas[0]

            async def sent() -> bool:
                return bool(client.unreleased)

            await wait_for(sent)
            [handle] = client.unreleased
        finally:
            os.kill(ping.result["pid"], signal.SIGKILL)
        with pytest.raises(StageDeadError):
            await task

        async def released() -> bool:
            return not shm.pending(handle)

        await wait_for(released)
