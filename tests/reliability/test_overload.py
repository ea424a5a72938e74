"""Overload: far more offered requests than ``max_pending`` against a slow stage.

Every request ends one of two ways: its output, or QueueFullError raised at once (never after a
wait); nothing else, and the two counts add up to what was offered. Admission never goes past
``max_pending``, and memory of the whole process tree stays flat.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from omni_runtime.exceptions import QueueFullError
from tests.conftest import echo_stage
from tests.reliability.support import close, last, start, status, tree_rss

MAX_PENDING = 50
OFFERED = 1_000
SLOW = {"delay_ms": 20}  # 8 per 20 ms: about 400 requests/s, well below the offered rate


@pytest.fixture(scope="module")
async def engine():
    engine = start(echo_stage(engine_args={"max_num_seqs": 8}), max_pending=MAX_PENDING)
    yield engine
    await close(engine)


async def storm(engine, n: int, tag: str) -> tuple[Counter, list[float], int]:
    """Offer ``n`` requests in bursts of 10 every few ms; return outcomes, refusal latencies, and
    the most requests the engine held at once."""
    outcomes: Counter = Counter()
    refusals: list[float] = []
    peak = 0

    async def one(i: int) -> None:
        nonlocal peak
        t = time.monotonic()
        try:
            out = await last(engine, f"{tag}-{i}", SLOW)
        except QueueFullError:
            refusals.append(time.monotonic() - t)
            outcomes["refused"] += 1
        except Exception as e:
            outcomes[type(e).__name__] += 1
        else:
            assert out.finished and out.text == f"{tag}-{i}"
            outcomes["served"] += 1
        peak = max(peak, engine.engine.num_pending)

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        if i % 10 == 9:
            await asyncio.sleep(0.004)
            peak = max(peak, engine.engine.num_pending)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return outcomes, refusals, peak


async def test_overload_refuses_at_once_serves_the_rest_and_memory_stays_flat(engine):
    await storm(engine, 200, "warm-up")  # first-use allocations (imports, buffers) are not growth
    rss_start = tree_rss()

    outcomes, refusals, peak = await storm(engine, OFFERED, "storm")

    assert set(outcomes) <= {"served", "refused"}, outcomes
    assert outcomes["served"] + outcomes["refused"] == OFFERED
    assert outcomes["served"] >= MAX_PENDING and outcomes["refused"] >= OFFERED // 2, outcomes
    assert max(refusals) < 0.05, f"a refusal took {max(refusals) * 1000:.1f} ms"
    assert peak <= MAX_PENDING
    assert engine.engine.num_pending == 0 and status(engine).inflight == 0

    rss_end = tree_rss()
    assert rss_end <= rss_start * 1.10, f"process tree RSS {rss_start / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB"
    # And it serves at once afterwards.
    assert (await last(engine, "after the storm")).text == "after the storm"
