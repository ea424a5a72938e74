"""HTTP load generator behind ``omni-runtime bench`` (and benchmarks/http.py): closed-loop or
Poisson open-loop arrivals, a latency summary, a table and an optional plot."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class Sample:
    """One request of a load run; times in seconds from the start of the run."""

    start: float
    latency: float
    status: int
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


async def run_http_load(
    url: str,
    path: str,
    payload: dict[str, Any],
    *,
    concurrency: int,
    total: int,
    rate: float | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
    seed: int = 0,
) -> tuple[list[Sample], float]:
    """Send ``total`` requests with at most ``concurrency`` in flight; with ``rate``, arrivals are a
    Poisson process of that many requests per second (open loop), else back to back (closed loop).
    Returns the samples and the wall time."""
    import httpx

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(total):
        arrivals.append(t)
        if rate:
            t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    samples: list[Sample] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, headers=auth_headers(api_key)) as client:
        begin = time.perf_counter()

        async def one(at: float) -> None:
            if rate:
                await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
            async with gate:
                start = time.perf_counter()
                try:
                    resp = await client.post(path, json=payload)
                    error = None if resp.status_code == 200 else resp.text[:200]
                    status = resp.status_code
                except httpx.HTTPError as e:
                    status, error = 0, f"{type(e).__name__}: {e}"
                end = time.perf_counter()
                samples.append(Sample(start - begin, end - start, status, error))

        await asyncio.gather(*(one(at) for at in arrivals))
        wall = time.perf_counter() - begin
    return sorted(samples, key=lambda s: s.start), wall


def summarize(samples: Sequence[Sample], wall: float, images_per_request: int = 1) -> dict[str, Any]:
    ok = [s.latency * 1000.0 for s in samples if s.error is None]
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": len(samples) - len(ok),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else 0.0,
        "images_per_s": round(len(ok) * images_per_request / wall, 3) if wall > 0 else 0.0,
        "latency_ms": {
            "mean": round(sum(ok) / len(ok), 2) if ok else None,
            **{f"p{q}": _round(percentile(ok, q)) for q in (50, 90, 99)},
            "max": _round(max(ok)) if ok else None,
        },
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def print_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> None:
    head = f"{'run':<22}{'ok/total':>10}{'wall s':>9}{'req/s':>9}{'img/s':>9}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}"
    print(head)
    print("-" * len(head))
    for name, s in rows:
        lat = s["latency_ms"]
        cells = [lat[k] if lat[k] is not None else float("nan") for k in ("p50", "p90", "p99")]
        print(
            f"{name:<22}{s['ok']:>5}/{s['requests']:<4}{s['wall_s']:>9.2f}{s['requests_per_s']:>9.2f}"
            f"{s['images_per_s']:>9.2f}{cells[0]:>10.1f}{cells[1]:>10.1f}{cells[2]:>10.1f}"
        )


def plot_run(samples: Sequence[Sample], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    done = [s for s in samples if s.error is None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ax1.scatter([s.start + s.latency for s in done], [s.latency * 1000 for s in done], s=8)
    failed = [s for s in samples if s.error is not None]
    if failed:
        ax1.scatter([s.start + s.latency for s in failed], [s.latency * 1000 for s in failed], s=8, c="red")
    ax1.set_ylabel("latency (ms)")
    ax1.set_title(title)
    end = max((s.start + s.latency for s in samples), default=1.0)
    width = max(end / 30, 0.25)  # about 30 bins, none shorter than 250 ms
    bins = [0] * (int(end / width) + 1)
    for s in done:
        bins[int((s.start + s.latency) / width)] += 1
    ax2.bar([i * width for i in range(len(bins))], [b / width for b in bins], width=width, align="edge")
    ax2.set_ylabel("completed requests / s")
    ax2.set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
