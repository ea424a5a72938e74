"""One engine, many callers: AsyncOmni from several event loops (one after another and at once),
Omni from many threads, backpressure past ``max_pending``, and close() while others wait."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import threading
import time

import pytest
import yaml

from omni_runtime import AsyncOmni, Omni
from omni_runtime.exceptions import EngineClosedError
from tests.conftest import echo_stage, make_config
from tests.entrypoints.openai.server_process import CLI, REPO
from tests.reliability.support import http_config


@pytest.fixture(scope="module")
def echo():
    with AsyncOmni(make_config([echo_stage(engine_args={"max_num_seqs": 8})])) as engine:
        yield engine


async def texts(engine: AsyncOmni, prompts: list[str], **params: object) -> list[str]:
    async def one(p: str) -> str:
        last = None
        async for out in engine.generate(p, params or None):
            last = out
        return last.text

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_asyncomni_from_one_loop_after_another(echo):
    """The defect: the output queue was bound to the first loop; a second loop hung forever."""
    for round_ in range(3):
        prompts = [f"round {round_} #{i}" for i in range(5)]
        assert asyncio.run(asyncio.wait_for(texts(echo, prompts), 10)) == prompts
    assert echo.engine.num_pending == 0


def test_asyncomni_from_many_loops_at_once(echo):
    def in_own_loop(tag: str) -> list[str]:
        async def run() -> list[str]:
            results = await asyncio.wait_for(texts(echo, [f"{tag}-{i}" for i in range(20)], delay_ms=5), 20)
            rpc = await echo.collective_rpc("ping", timeout=5)
            assert rpc[0].ok
            return results

        return asyncio.run(run())

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = {tag: pool.submit(in_own_loop, tag) for tag in "abcdef"}
        for tag, fut in futures.items():
            assert fut.result(timeout=60) == [f"{tag}-{i}" for i in range(20)]
    assert echo.engine.num_pending == 0


def test_a_request_whose_loop_closed_is_swept_and_its_stage_work_stopped(echo):
    loop = asyncio.new_event_loop()

    async def submit() -> None:
        echo.engine.add_request("orphan", {"delay_ms": 60_000}, request_id="orphan")

    loop.run_until_complete(submit())
    loop.close()  # nobody will ever read its answer
    assert "orphan" in echo.engine._channels.pending

    async def after() -> None:
        await texts(echo, ["next"])  # a new loop: its channel sweeps the closed one
        deadline = time.monotonic() + 5
        while (await echo.collective_rpc("get_stats", timeout=5))[0].result["running"]:
            assert time.monotonic() < deadline, "the orphan's forward kept running"
            await asyncio.sleep(0.05)

    asyncio.run(after())
    assert "orphan" not in echo.engine._channels.pending


def test_omni_from_many_threads_at_once():
    """The defect: a second thread got 'This event loop is already running'."""
    with Omni(make_config([echo_stage(engine_args={"max_num_seqs": 8})])) as omni:
        barrier = threading.Barrier(8)

        def call(i: int) -> list[str]:
            barrier.wait()
            outs = omni.generate([f"t{i}-{j}" for j in range(10)], {"delay_ms": 5}, use_tqdm=False)
            assert omni.collective_rpc("ping", timeout=5)[0].ok
            return [o.text for o in outs]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(8)))
        assert results == [[f"t{i}-{j}" for j in range(10)] for i in range(8)]
        batch_sizes = omni.collective_rpc("get_stats")[0].result["batch_size_histogram"]
        assert max(int(k) for k in batch_sizes) > 1  # the threads' requests batched together


def test_omni_close_while_other_threads_wait_and_after():
    omni = Omni(make_config([echo_stage()]))
    started = threading.Event()

    def waiting() -> list:
        started.set()
        return omni.generate(["long"] * 3, {"delay_ms": 60_000}, use_tqdm=False)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(waiting)
        started.wait()
        deadline = time.monotonic() + 10
        while omni.engine.num_pending < 3:  # the three are admitted
            assert time.monotonic() < deadline
            time.sleep(0.02)
        start = time.monotonic()
        omni.close()
        outs = fut.result(timeout=10)
        assert time.monotonic() - start < 10
    assert all(isinstance(o.error, EngineClosedError) and o.request_id for o in outs)
    with pytest.raises(EngineClosedError):
        omni.generate("late", use_tqdm=False)
    with pytest.raises(EngineClosedError):
        omni.collective_rpc("ping")
    omni.close()  # twice is a no-op


def test_omni_applies_backpressure_past_max_pending():
    """The defect: prompts past max_pending came back as QueueFullError with request_id=''."""
    with Omni(make_config([echo_stage(engine_args={"max_num_seqs": 4})], max_pending=3)) as omni:
        prompts = [f"p{i}" for i in range(25)]
        outs = omni.generate(prompts, {"delay_ms": 5}, use_tqdm=False)
        assert [o.error for o in outs] == [None] * 25
        assert [o.text for o in outs] == prompts
        assert len({o.request_id for o in outs}) == 25 and all(o.request_id for o in outs)


def test_cli_generate_applies_backpressure_too(tmp_path):
    config = {**http_config(), "max_pending": 2}
    path = tmp_path / "images.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [*CLI, "generate", "a", "b", "-n", "4", "--model", str(path), "--out", str(tmp_path / "out"), "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["requests"] == 8 and report["failed"] == 0 and report["images"] == 8
