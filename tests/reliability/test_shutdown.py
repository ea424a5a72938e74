"""Closing the engine with work in flight: every request and control call ends with
EngineClosedError at once (none hangs), later calls are refused, and nothing is left running."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from omni_runtime.exceptions import EngineClosedError
from tests.reliability.support import close, eventually, fault_stage, last, start, stats, status


async def runs(engine, n: int) -> bool:
    return sum(s["running"] for s in (await stats(engine)).values()) == n


@pytest.mark.parametrize("closer", ["executor", "foreign thread"])
async def test_close_with_requests_in_flight_ends_each_with_engine_closed(no_leaks, closer):
    # The quiet window fixed at the whole wait: with the adaptive one (5 ms at first) a loaded
    # machine that delivered one request late split a wave, and the late one queued behind 30 s.
    engine = start(fault_stage(replicas=2, max_restarts=0, request_batch_max_wait_ms=200, batch_quiet_window_ms=200))
    try:
        # 8 running in two fused waves of 30 s, 12 queued behind them, a control call stuck behind
        # a forward thread (runner control calls run there), and the caller's loop idle.
        running = [asyncio.create_task(last(engine, f"run-{i}", {"delay_ms": 30_000})) for i in range(8)]
        await eventually(lambda: status(engine).inflight == 8, what="8 requests in the stages")
        await eventually(lambda: runs(engine, 8), what="8 requests running in two waves")
        queued = [asyncio.create_task(last(engine, f"queued-{i}", {"delay_ms": 10})) for i in range(12)]
        rpc = asyncio.create_task(engine.collective_rpc("slow", args=[0.01]))
        await eventually(lambda: status(engine).inflight == 20, what="20 requests in the stages")

        start_close = time.monotonic()
        if closer == "executor":
            closing = asyncio.create_task(close(engine))
        else:  # e.g. a signal handler's thread: the caller's loop must still wake up for it
            thread = threading.Thread(target=engine.close)
            thread.start()
        results = await asyncio.wait_for(asyncio.gather(*running, *queued, rpc, return_exceptions=True), 10)
        assert time.monotonic() - start_close < 1.0
        assert all(isinstance(r, EngineClosedError) for r in results), results

        # The stages stop their running forwards instead of waiting them out: close() is prompt.
        if closer == "executor":
            await asyncio.wait_for(closing, 10)
        else:
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 30)
        assert time.monotonic() - start_close < 3.0
    finally:
        await close(engine)
    assert not engine.engine.is_running and engine.engine.num_pending == 0
    t = time.monotonic()
    with pytest.raises(EngineClosedError):
        await last(engine, "too late")
    with pytest.raises(EngineClosedError):
        await engine.collective_rpc("ping")
    assert time.monotonic() - t < 0.1
    engine.close()  # again: a no-op
