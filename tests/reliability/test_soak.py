"""Soak: 10,000 requests with random aborts, failures and deadlines, 64 at a time.

The promise: every accepted request ends exactly once — its output, a typed error, or the
acknowledgement of its abort — and nothing is lost (every request is accounted for, and nothing
is left queued or running anywhere in the engine), nothing is duplicated (no request yields
anything after its finished output, and no request ever sees another's output, although many
reuse the id of a request that was just aborted), and memory does not grow.

The plan of each request (what it asks, whether and how it is aborted) comes from a seeded RNG;
the moment of each abort is random against the engine's real timing.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass

import pytest

from omni_runtime.exceptions import OmniError, RequestAbortedError, RequestTimeoutError, StageExecutionError
from tests.conftest import echo_stage
from tests.reliability.support import close, eventually, start, stats, status, tree_rss

SEED = 20_251_121
REQUESTS = 10_000
WARMUP = 2_000
CONCURRENCY = 64


@dataclass(frozen=True)
class Plan:
    prompt: str
    params: dict
    #: None, "abort" (engine abort by id) or "cancel" (the consumer is cancelled).
    abort: str | None
    abort_after_s: float
    #: Reuse the worker's request id (the previous request with it has just ended).
    reuse_id: bool
    poison: bool
    timeout: bool


def make_plans(rng: random.Random, n: int, tag: str) -> list[Plan]:
    plans = []
    for i in range(n):
        roll = rng.random()
        poison, timeout = roll < 0.02, 0.02 <= roll < 0.04
        params: dict = {}
        if timeout:
            params = {"delay_ms": 30, "timeout": 0.005}
        elif rng.random() < 0.2:  # a real forward in the forward thread: aborts can land mid-wave
            params = {"delay_ms": rng.uniform(0.5, 3.0)}
        abort = rng.choice(["abort", "cancel"]) if rng.random() < 0.10 else None
        plans.append(
            Plan(
                prompt=f"poison-{tag}{i}" if poison else f"{tag}{i}",
                params=params,
                abort=abort,
                abort_after_s=rng.uniform(0.0, 0.004),
                reuse_id=rng.random() < 0.3,
                poison=poison,
                timeout=timeout,
            )
        )
    return plans


@pytest.fixture(scope="module")
async def engine():
    stage = echo_stage(stage_type="tests.helpers:FlakyRunner", engine_args={"max_num_seqs": 8})
    engine = start(stage, max_pending=CONCURRENCY)
    yield engine
    await close(engine)


async def consume(engine, plan: Plan, request_id: str) -> str:
    """Run one request to its end; check what it yields on the way."""
    finished = 0
    async for out in engine.generate(plan.prompt, plan.params, request_id=request_id):
        assert finished == 0, f"{request_id}: an output after the finished one"
        assert out.request_id == request_id
        if out.finished:
            finished += 1
            assert out.text == plan.prompt, f"{request_id} got another request's output: {out.text!r}"
    assert finished == 1, f"{request_id}: the stream ended without a finished output"
    return "output"


async def run(engine, plans: list[Plan], tag: str) -> dict[int, str]:
    outcomes: dict[int, str] = {}
    todo = iter(range(len(plans)))

    async def abort_later(task: asyncio.Task, plan: Plan, request_id: str) -> None:
        await asyncio.sleep(plan.abort_after_s)
        if plan.abort == "abort":
            engine.abort(request_id)
        else:
            task.cancel()

    async def worker(w: int) -> None:
        for i in todo:
            plan = plans[i]
            request_id = f"{tag}-w{w}" if plan.reuse_id else f"{tag}-r{i}"
            task = asyncio.create_task(consume(engine, plan, request_id))
            aborter = asyncio.create_task(abort_later(task, plan, request_id)) if plan.abort else None
            try:
                outcome = await task
            except RequestAbortedError:
                outcome = "aborted"
            except asyncio.CancelledError:
                outcome = "cancelled"
            except RequestTimeoutError:
                outcome = "timeout"
            except StageExecutionError:
                outcome = "failed"
            except OmniError as e:
                outcome = type(e).__name__
            if aborter is not None:
                await aborter
            assert i not in outcomes, f"request {i} ended twice"
            outcomes[i] = outcome

    await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(CONCURRENCY))), 240)
    return outcomes


def check(plans: list[Plan], outcomes: dict[int, str]) -> Counter:
    assert sorted(outcomes) == list(range(len(plans))), "requests lost"
    for i, plan in enumerate(plans):
        got = outcomes[i]
        allowed = {"failed"} if plan.poison else {"timeout"} if plan.timeout else {"output"}
        if plan.abort:
            # An abort that lands after the end changes nothing; one that lands before it wins.
            allowed |= {"aborted"} if plan.abort == "abort" else {"cancelled"}
        assert got in allowed, f"request {i} ({plan}) ended with {got}"
    return Counter(outcomes.values())


async def assert_nothing_left(engine) -> None:
    """Nothing queued, running or routed anywhere once every caller has its answer."""
    assert engine.engine.num_pending == 0
    orchestrator = engine.engine._orchestrator
    await eventually(lambda: not orchestrator._requests and status(engine).inflight == 0, what="engine drained")
    s = (await stats(engine))[0]
    assert (s["running"], s["queue_len"]) == (0, 0), s


async def test_soak_every_request_ends_exactly_once_and_memory_is_flat(engine):
    rng = random.Random(SEED)
    warmup = make_plans(rng, WARMUP, "warm")
    check(warmup, await run(engine, warmup, "warm"))
    await assert_nothing_left(engine)
    rss_start = tree_rss()

    plans = make_plans(rng, REQUESTS, "soak")
    counts = check(plans, await run(engine, plans, "soak"))
    await assert_nothing_left(engine)
    rss_end = tree_rss()

    assert sum(counts.values()) == REQUESTS
    # The mix really happened: aborts landed before the end, mid-wave included, and typed errors.
    assert counts["output"] > 0.8 * REQUESTS
    assert counts["aborted"] > 50 and counts["cancelled"] > 50, counts
    assert counts["failed"] > 50 and counts["timeout"] > 50, counts
    assert rss_end < rss_start * 1.10, f"process tree RSS {rss_start / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB"
