"""What the HTTP server costs: the same load through a real uvicorn server and through AsyncOmni in
process, in one run.

1) throughput: ``--concurrency`` clients (default 16) send ``--total`` one-image requests to tiny-sd,
   over HTTP (httpx async client -> ``omni-runtime serve`` in a subprocess) and in process
   (``AsyncOmni.generate``); img/s of both and their ratio (target >= 0.9)
2) overhead: sequential chat requests to the ``echo`` config (a stage that returns its input), over
   HTTP and in process; the per-request overhead is the difference of the p50 latencies
   (target <= 5 ms)

The two sides never run together (they would compete for cores); they alternate in ``--rounds``
so that a machine whose load drifts during the run weighs on both alike, and the verdict uses the
median of the per-round ratios.

    python -m benchmarks.http [--total 64] [--concurrency 16] [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named http.py: run as a script, its folder would be first on the import path and
# `import http` (which httpx needs) would find this file, not the standard library. Take the folder
# off and put the checkout on, so both `python benchmarks/http.py` and `-m benchmarks.http` work.
REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "benchmarks"] + [str(REPO)]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from omni_runtime.entrypoints.async_omni import AsyncOmni  # noqa: E402
from omni_runtime.entrypoints.loadgen import percentile, run_http_load  # noqa: E402

from benchmarks._common import Server  # noqa: E402

THROUGHPUT_TARGET = 0.9
OVERHEAD_TARGET_MS = 5.0


async def inprocess_load(
    omni: AsyncOmni, prompt: str, params: Any, concurrency: int, total: int
) -> tuple[list[float], float]:
    """``total`` requests from ``concurrency`` closed-loop workers; latencies (s) and wall time."""
    todo = iter(range(total))
    latencies: list[float] = []

    async def worker() -> None:
        for _ in todo:
            start = time.perf_counter()
            async for _out in omni.generate(prompt, params):
                pass
            latencies.append(time.perf_counter() - start)

    begin = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - begin


def _ms(values: list[float], q: float) -> float:
    return round((percentile(values, q) or 0.0) * 1000.0, 3)


async def compare(
    model: str, path: str, payload: dict[str, Any], prompt: str, *, concurrency: int, total: int, rounds: int
) -> dict[str, Any]:
    """The same closed-loop load over HTTP and in process, alternating in ``rounds`` so that a
    machine whose load drifts during the run weighs on both sides alike. Both engines stay up; an
    idle engine uses no CPU, so only the side being measured runs."""
    per_round = max(1, total // rounds)
    http_lat: list[float] = []
    local_lat: list[float] = []
    http_wall = local_wall = 0.0
    errors = 0
    paired: list[float] = []  # HTTP rate / in-process rate of each round: robust to load drift
    with Server(model) as server:
        async with AsyncOmni(model) as omni:
            # Warm-up: the first forwards of a fresh process are slower.
            await run_http_load(server.url, path, payload, concurrency=concurrency, total=concurrency)
            await inprocess_load(omni, prompt, None, concurrency, concurrency)
            for _ in range(rounds):
                samples, wall = await run_http_load(server.url, path, payload, concurrency=concurrency, total=per_round)
                http_lat += [s.latency for s in samples if s.error is None]
                errors += sum(s.error is not None for s in samples)
                http_wall += wall
                http_rate = sum(s.error is None for s in samples) / wall
                latencies, wall = await inprocess_load(omni, prompt, None, concurrency, per_round)
                local_lat += latencies
                local_wall += wall
                paired.append(http_rate / (len(latencies) / wall))
    return {
        "requests_per_side": per_round * rounds,
        "http_per_s": round(len(http_lat) / http_wall, 3),
        "inprocess_per_s": round(len(local_lat) / local_wall, 3),
        "http_errors": errors,
        "ratio": round(len(http_lat) / http_wall / (len(local_lat) / local_wall), 3),
        "median_round_ratio": round(sorted(paired)[len(paired) // 2], 3),
        "round_ratios": [round(r, 3) for r in paired],
        "http_p50_ms": _ms(http_lat, 50),
        "http_p99_ms": _ms(http_lat, 99),
        "inprocess_p50_ms": _ms(local_lat, 50),
        "inprocess_p99_ms": _ms(local_lat, 99),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    sd = await compare(
        "tiny-sd",
        "/v1/images/generations",
        {"prompt": "a red fox in the snow", "n": 1},
        "a red fox in the snow",
        concurrency=args.concurrency,
        total=args.total,
        rounds=args.rounds,
    )
    echo = await compare(
        "echo",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "ping"}]},
        "ping",
        concurrency=1,
        total=args.echo_total,
        rounds=args.rounds,
    )
    return {
        "throughput": sd,
        "echo": echo | {"overhead_p50_ms": round(echo["http_p50_ms"] - echo["inprocess_p50_ms"], 3)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=64, help="tiny-sd requests per side")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--echo-total", type=int, default=300, help="sequential echo requests per side")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the HTTP and in-process runs")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if min(args.total, args.concurrency, args.echo_total, args.rounds) < 1:
        parser.error("--total, --concurrency, --echo-total and --rounds must be >= 1")

    results = asyncio.run(measure(args))
    tput, echo = results["throughput"], results["echo"]
    n = tput["requests_per_side"]
    print(f"tiny-sd, {args.concurrency} concurrent clients, {n} one-image requests per side, {args.rounds} rounds")
    errors = tput["http_errors"]
    print(f"  HTTP        {tput['http_per_s']:8.2f} img/s   p50 {tput['http_p50_ms']:9.1f} ms   errors {errors}")
    print(f"  in process  {tput['inprocess_per_s']:8.2f} img/s   p50 {tput['inprocess_p50_ms']:9.1f} ms")
    verdict = "ok" if tput["median_round_ratio"] >= THROUGHPUT_TARGET else "BELOW TARGET"
    print(f"  ratio       {tput['ratio']:8.3f}   (all rounds)")
    median = tput["median_round_ratio"]
    print(f"  ratio       {median:8.3f}   (median of paired rounds; target >= {THROUGHPUT_TARGET}: {verdict})")
    print(f"echo, sequential, {echo['requests_per_side']} requests per side")
    print(f"  HTTP round trip        p50 {echo['http_p50_ms']:7.3f} ms   p99 {echo['http_p99_ms']:7.3f} ms")
    print(f"  AsyncOmni round trip   p50 {echo['inprocess_p50_ms']:7.3f} ms   p99 {echo['inprocess_p99_ms']:7.3f} ms")
    verdict = "ok" if echo["overhead_p50_ms"] <= OVERHEAD_TARGET_MS else "ABOVE TARGET"
    print(
        f"  HTTP overhead          p50 {echo['overhead_p50_ms']:7.3f} ms   (target <= {OVERHEAD_TARGET_MS}: {verdict})"
    )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
