"""Text stage under Poisson arrivals: token-level continuous batching against request-level batching.

One arrival sequence per (load, round): Poisson arrivals (fixed seed), each request with one of a few
``max_tokens`` at random (short and long answers mixed, as a chat stage sees). The same sequence goes
to two engines, each a text stage process (``builtin:tiny-lm`` unless ``--model``) with the same torch
thread count, interleaved within a round:

  request  request-level batching: waves of up to N requests, each wave decoded to its longest
           request's end (``max_num_seqs=N``, ``request_batch_max_wait_ms=W``)
  token    token-level continuous batching (``engine_args.step_execution``): one step is one token
           of every running request; requests join and leave between tokens (``max_num_seqs=N``)

Loads are multiples of the request-level engine's rate on a closed burst of the same mix. Reported per
run, at the caller: tokens/s (completion tokens over the time from the first arrival to the last
completion), p50/p99 time to first token (submit to the first text delta) and p50/p99 request
latency (submit to the final output); then token/request ratios side by side.

    python -m benchmarks.text_batching [--loads 0.5,2,6] [--rounds 2] [--requests 60] [--base-rate R]
                                       [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

import uvloop

from benchmarks._common import pct, table, write_json
from omni_runtime import AsyncOmni
from omni_runtime.config import parse_config

THREADS = 1
MODES = ("request", "token")
#: max_tokens of a request, drawn uniformly: most answers short, some long.
LENGTHS = (8, 16, 32, 128)
PROMPTS = ("the cat sat on", "tell me about the weather", "a list of three things:", "once upon a time")


def deploy(mode: str, model: str, n: int, wait_ms: float) -> Any:
    engine_args: dict[str, Any] = {
        "request": {"max_num_seqs": n, "request_batch_max_wait_ms": wait_ms},
        "token": {"max_num_seqs": n, "step_execution": True},
    }[mode]
    return parse_config(
        {
            "model": "text-bench",
            "stage_args": [
                {
                    "stage_id": 0,
                    "stage_type": "text",
                    "model": model,
                    "runtime": {"torch_threads": THREADS},
                    "engine_args": engine_args,
                    "final_output": True,
                    "final_output_type": "text",
                    "default_sampling_params": {"temperature": 1.0},
                }
            ],
        },
        source=f"bench-text-{mode}",
    )


def arrivals(total: int, rate: float | None, seed: int) -> list[tuple[float, str, int]]:
    """(offset s, prompt, max_tokens) per request; offset 0 for all when ``rate`` is None (a burst)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(total):
        out.append((t, rng.choice(PROMPTS), rng.choice(LENGTHS)))
        if rate is not None:
            t += rng.expovariate(rate)
    return out


async def one(engine: AsyncOmni, i: int, prompt: str, max_tokens: int) -> tuple[float, float, float, int]:
    """(submit, first delta, done, completion tokens) of one request, at the caller."""
    submit = time.perf_counter()
    first = float("nan")
    out = None
    # EOS is suppressed nowhere: a request may end before max_tokens; tokens are counted as reported.
    async for out in engine.generate(prompt, {"seed": i, "max_tokens": max_tokens}):
        if out.text_delta and first != first:
            first = time.perf_counter()
    done = time.perf_counter()
    assert out is not None and out.error is None, out and out.error
    if first != first:  # an empty text: its first token came with the final output
        first = done
    return submit, first, done, int(out.metrics.get("completion_tokens", 0))


async def open_loop(engine: AsyncOmni, plan: list[tuple[float, str, int]]) -> dict[str, float]:
    t0 = time.perf_counter()
    tasks = []
    for i, (offset, prompt, max_tokens) in enumerate(plan):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(engine, i, prompt, max_tokens)))
    results = await asyncio.gather(*tasks)
    ttft = [(first - submit) * 1000 for submit, first, _, _ in results]
    lat = [(done - submit) * 1000 for submit, _, done, _ in results]
    end = max(done for _, _, done, _ in results)
    return {
        "tok_s": sum(r[3] for r in results) / (end - t0),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
    }


def burst_rate(loop: asyncio.AbstractEventLoop, engine: AsyncOmni, total: int) -> float:
    """Requests per second of a closed burst of the mix (the request-level engine's capacity)."""
    plan = arrivals(total, None, seed=1000)
    start = time.perf_counter()
    loop.run_until_complete(open_loop(engine, plan))
    return total / (time.perf_counter() - start)


def run(
    loads: list[float],
    rounds: int,
    total: int,
    n: int = 8,
    wait_ms: float = 5.0,
    model: str = "builtin:tiny-lm",
    base_rate: float | None = None,
) -> list[dict[str, Any]]:
    """Every (round, load, mode) run, as rows; also printed as they finish."""
    loop = uvloop.new_event_loop()
    engines = {mode: AsyncOmni(deploy(mode, model, n, wait_ms)) for mode in MODES}
    rows: list[dict[str, Any]] = []
    try:
        for engine in engines.values():  # warm-up: first calls, allocator
            loop.run_until_complete(open_loop(engine, arrivals(8, None, seed=999)))
        # The faster of two passes: one slowed by a neighbour on the shared machine would make every
        # arrival schedule too sparse.
        mu = base_rate or max(burst_rate(loop, engines["request"], 3 * n) for _ in range(2))
        print(f"base rate {mu:.2f} req/s over max_tokens {LENGTHS}, max_num_seqs {n}")
        for r in range(rounds):
            for load in loads:
                plan = arrivals(total, load * mu, seed=r)
                print(f" load {load}: {total} arrivals over {plan[-1][0]:.2f} s", flush=True)
                # The other mode first in odd rounds: the shared machine drifts.
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    res = loop.run_until_complete(open_loop(engines[mode], plan))
                    rows.append({"load": load, "round": r, "mode": mode, **res, "loadavg": os.getloadavg()[0]})
                    print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in rows[-1].items()), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return rows


def _fmt(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


COLUMNS = ["load", "round", "mode", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "p50_ms", "p99_ms", "loadavg"]
RATIOS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "p50_ms", "p99_ms")


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per load: medians over rounds of each mode, and token/request ratios of the same round."""
    out = []
    for load in dict.fromkeys(r["load"] for r in rows):
        mine = [r for r in rows if r["load"] == load]
        row: dict[str, Any] = {"load": load}
        for key in RATIOS:
            for mode in MODES:
                row[f"{mode} {key}"] = statistics.median(r[key] for r in mine if r["mode"] == mode)
            pairs = [
                (t[key], q[key])
                for t in mine
                for q in mine
                if t["mode"] == "token" and q["mode"] == "request" and t["round"] == q["round"]
            ]
            row[f"token/request {key}"] = statistics.median(a / b for a, b in pairs)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="0.5,2,6", help="arrival rates as multiples of the request-level burst rate")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=60, help="requests per run")
    ap.add_argument("--n", type=int, default=8, help="max_num_seqs of both modes")
    ap.add_argument("--wait-ms", type=float, default=5.0, help="request_batch_max_wait_ms of request-level")
    ap.add_argument("--model", default="builtin:tiny-lm")
    ap.add_argument(
        "--base-rate", type=float, help="req/s to scale loads by (default: the request-level burst rate, measured)"
    )
    ap.add_argument("--quick", action="store_true", help="one round of 16 requests at one load (smoke)")
    ap.add_argument("--json")
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    rounds, total = (1, 16) if args.quick else (args.rounds, args.requests)
    if args.quick:
        loads = loads[:1]
    rows = run(loads, rounds, total, args.n, args.wait_ms, args.model, args.base_rate)
    print()
    print(table(rows, COLUMNS))
    print()
    for s in summarize(rows):
        print(
            f"load {s['load']}: token/request tokens/s {s['token/request tok_s']:.2f}, "
            f"TTFT p50 {s['token/request ttft_p50_ms']:.2f} p99 {s['token/request ttft_p99_ms']:.2f}, "
            f"latency p50 {s['token/request p50_ms']:.2f} p99 {s['token/request p99_ms']:.2f}"
        )
    write_json(args.json, {"runs": rows, "summary": summarize(rows)})


if __name__ == "__main__":
    main()
