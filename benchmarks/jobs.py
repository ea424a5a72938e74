"""What async jobs cost: one real ``omni-runtime serve`` (tiny-sd), in one run.

1) overhead: one-image requests, sequential, interleaved request by request (each side first
   every other time): the synchronous ``POST /v1/images/generations``, and an async job
   (``POST /v1/generate``, then its SSE stream until ``completed``, then ``GET /v1/jobs/{id}``);
   p50/p99 of each, the difference of p50s and the median paired difference, and the job's
   latency minus the engine's own end-to-end time (what the job machinery adds on top of it)
2) SSE delivery: ``--jobs`` jobs, ``--concurrency`` at a time, each followed by an SSE client;
   every event carries the gateway's clock (``at``), so delivery latency = received - at (one
   machine, one clock); p50/p99, and the events/s the clients received
3) store throughput: the gateway's event path without the engine: one task appends events (with
   a record update, as a step event does) as fast as it can, another follows them with
   ``wait_events``; events/s of the in-memory store and of Redis (a private redis-server)

With ``--redis`` the server uses a private redis-server as its job store (1 and 2 then go through
Redis). Both sides of 1 share the engine and never run at the same time.

    python -m benchmarks.jobs [--total 40] [--jobs 24] [--concurrency 4] [--redis] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from omni_runtime.entrypoints.jobs.redis_store import RedisJobStore
from omni_runtime.entrypoints.jobs.store import JobStore, MemoryJobStore

from benchmarks._common import Server, free_port, pct, write_json

IMAGE = {"num_inference_steps": 2, "size": "32x32"}


class Redis:
    """A private redis-server, persistence off, stopped by PID."""

    def __enter__(self) -> Redis:
        self.dir = tempfile.mkdtemp(prefix="omni-bench-redis-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (make test installs it)")
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([binary, *args, "--dir", self.dir], stdout=subprocess.DEVNULL)
        for _ in range(500):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(8).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.01)
        raise TimeoutError("redis-server did not start")

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


async def follow_sse(http: httpx.AsyncClient, job_id: str) -> list[tuple[float, dict[str, Any]]]:
    """(arrival time, event data) of every event of the job, until it ends."""
    got: list[tuple[float, dict[str, Any]]] = []
    kind = None
    async with http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                got.append((time.time(), {"type": kind, **json.loads(line[6:])}))
    return got


async def overhead(url: str, total: int) -> dict[str, Any]:
    sync_ms: list[float] = []
    job_ms: list[float] = []
    gateway_ms: list[float] = []  # a job's latency minus the engine's own e2e time
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        image = {"prompt": "a red fox", "num_inference_steps": IMAGE["num_inference_steps"], "size": IMAGE["size"]}
        job = {"task": "text2image", "inputs": {"prompt": "a red fox", **IMAGE}, "response_format": "b64_json"}

        async def one_sync() -> float:
            start = time.perf_counter()
            r = await http.post("/v1/images/generations", json=image)
            r.raise_for_status()
            return (time.perf_counter() - start) * 1000.0

        async def one_job() -> float:
            start = time.perf_counter()
            r = await http.post("/v1/generate", json=job)
            r.raise_for_status()
            job_id = r.json()["job_id"]
            events = await follow_sse(http, job_id)
            assert events[-1][1]["type"] == "completed", events[-1]
            r = await http.get(f"/v1/jobs/{job_id}")
            r.raise_for_status()
            took = (time.perf_counter() - start) * 1000.0
            gateway_ms.append(took - r.json()["timings"]["engine_e2e_ms"])
            return took

        for i in range(total + 2):  # the first pair is warm-up
            # Each side goes first every other time: the first request after a pause may run on
            # a colder engine than the one right behind it.
            if i % 2:
                sync, done = await one_sync(), await one_job()
            else:
                done, sync = await one_job(), await one_sync()
            if i >= 2:
                sync_ms.append(sync)
                job_ms.append(done)
    paired = [j - s for j, s in zip(job_ms, sync_ms, strict=True)]
    gateway = gateway_ms[2:]  # without the warm-up pair
    return {
        "requests_per_side": total,
        "paired_difference_p50_ms": round(pct(paired, 50), 2),
        "job_gateway_p50_ms": round(pct(gateway, 50), 2),
        "job_gateway_p99_ms": round(pct(gateway, 99), 2),
        "sync_p50_ms": round(pct(sync_ms, 50), 2),
        "sync_p99_ms": round(pct(sync_ms, 99), 2),
        "job_p50_ms": round(pct(job_ms, 50), 2),
        "job_p99_ms": round(pct(job_ms, 99), 2),
        "overhead_p50_ms": round(pct(job_ms, 50) - pct(sync_ms, 50), 2),
    }


async def delivery(url: str, jobs: int, concurrency: int) -> dict[str, Any]:
    latencies: list[float] = []
    received = 0
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def one(i: int) -> None:
            nonlocal received
            async with slots:
                inputs = {"prompt": f"job {i}", "num_inference_steps": 8, "size": "64x64"}
                body = {"task": "text2image", "inputs": inputs}
                r = await http.post("/v1/generate", json=body)
                r.raise_for_status()
                for arrived, data in await follow_sse(http, r.json()["job_id"]):
                    received += 1
                    latencies.append((arrived - data["at"]) * 1000.0)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(jobs)))
        wall = time.perf_counter() - start
    return {
        "jobs": jobs,
        "concurrency": concurrency,
        "events": received,
        "events_per_s": round(received / wall, 1),
        "delivery_p50_ms": round(pct(latencies, 50), 3),
        "delivery_p99_ms": round(pct(latencies, 99), 3),
    }


async def store_rate(store: JobStore, events: int) -> dict[str, Any]:
    await store.create({"job_id": "bench", "status": "running"}, ("queued", {}))
    followed = 0

    async def follower() -> None:
        nonlocal followed
        after = None
        while followed < events:
            got = await store.wait_events("bench", after, 5.0)
            if got:
                followed += sum(1 for e in got if e.type == "step")
                after = got[-1].id

    reader = asyncio.create_task(follower())
    start = time.perf_counter()
    for i in range(events):
        step = {"stage_id": 0, "step": i, "steps": events}
        await store.append_event("bench", "step", step, {"progress": step})
    written = time.perf_counter() - start
    await asyncio.wait_for(reader, 60)
    followed_s = time.perf_counter() - start
    await store.close()
    return {"events": events, "append_per_s": round(events / written), "end_to_end_per_s": round(events / followed_s)}


async def measure(args: argparse.Namespace, redis_url: str | None) -> dict[str, Any]:
    results: dict[str, Any] = {"store": "redis" if args.redis else "memory"}
    with Server("tiny-sd", *(["--redis-url", redis_url] if args.redis else [])) as server:
        results["overhead"] = await overhead(server.url, args.total)
        results["delivery"] = await delivery(server.url, args.jobs, args.concurrency)
    results["store_memory"] = await store_rate(MemoryJobStore(), args.store_events)
    if redis_url is not None:
        results["store_redis"] = await store_rate(RedisJobStore(redis_url), args.store_events)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=40, help="requests per side of the overhead comparison")
    parser.add_argument("--jobs", type=int, default=24, help="jobs of the SSE delivery run")
    parser.add_argument("--concurrency", type=int, default=4, help="jobs at a time in the SSE delivery run")
    parser.add_argument("--store-events", type=int, default=5000, help="events of the store throughput run")
    parser.add_argument("--redis", action="store_true", help="the server's job store is Redis")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if min(args.total, args.jobs, args.concurrency, args.store_events) < 1:
        parser.error("--total, --jobs, --concurrency and --store-events must be >= 1")
    with Redis() if shutil.which("redis-server") else _NoRedis() as redis:
        results = asyncio.run(measure(args, getattr(redis, "url", None)))
    o, d = results["overhead"], results["delivery"]
    print(f"job store: {results['store']}; tiny-sd, {IMAGE}")
    print(f"overhead, sequential, interleaved, {o['requests_per_side']} per side")
    print(f"  POST /v1/images/generations   p50 {o['sync_p50_ms']:8.1f} ms   p99 {o['sync_p99_ms']:8.1f} ms")
    print(f"  job: submit -> SSE completed  p50 {o['job_p50_ms']:8.1f} ms   p99 {o['job_p99_ms']:8.1f} ms")
    print(f"  overhead of a job             p50 {o['overhead_p50_ms']:8.1f} ms (difference of the p50s)")
    print(f"  job - sync, paired            p50 {o['paired_difference_p50_ms']:8.1f} ms")
    print(
        f"  job latency - engine e2e      p50 {o['job_gateway_p50_ms']:8.1f} ms   p99 {o['job_gateway_p99_ms']:8.1f} ms"
        " (the gateway's share: submit, store, events, SSE, GET)"
    )
    print(f"SSE delivery, {d['jobs']} jobs of 8 steps, {d['concurrency']} at a time")
    print(f"  {d['events']} events, {d['events_per_s']} events/s received")
    print(f"  delivery latency              p50 {d['delivery_p50_ms']:8.3f} ms   p99 {d['delivery_p99_ms']:8.3f} ms")
    for name in ("store_memory", "store_redis"):
        if name in results:
            s = results[name]
            print(
                f"{name.replace('_', ' ')}: {s['append_per_s']} appends/s, "
                f"{s['end_to_end_per_s']} events/s appended and followed ({s['events']} events)"
            )
    write_json(str(args.json) if args.json else None, results)
    return 0


class _NoRedis:
    def __enter__(self) -> _NoRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
