"""The caches across requests (docs/configuration.md, "Caches across requests"), in one run:

1. **Exact results** on tiny-sd (``result_cache`` on): a seeded request seen for the first time
   (a miss: encode, denoise, decode) against the same request again (a hit: answered by the stage
   worker from its store), one at a time, interleaved (miss of seed k, then its hit) so that both
   see the same machine. Reported: median time from submit to final output at the caller, and
   the hit's speed-up (the target is 50x or more).
2. **Prompt embeddings**, per builtin family in step execution (``prompt_cache`` at its default,
   on): one prompt repeated (each request after the first a hit: no text encoder) against a new
   prompt every time (each a miss), one at a time, interleaved, every request with a seed of its
   own. Reported: median time per request of each, the gain (new / repeated) and the time saved per
   request, with the hits and misses the stage counted. Tiny models have tiny text encoders: the
   gain says what the encode costs beside a tiny denoiser, not what a real model saves.

Every engine is a stage process with the same torch thread count; each family's engine is started,
warmed up (two requests) and measured before the next one starts.

    python -m benchmarks.caches [--families tiny-sd,tiny-flux] [--requests 20] [--threads 2]
                                [--quick] [--json out.json]

``--quick`` takes 4 requests of each kind (every family still runs): a smoke run of under a minute
on two cores (42 s, the models already built); a figure to quote wants the default 20 on a quiet
machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import uvloop

from benchmarks._common import table, write_json
from omni_runtime import AsyncOmni
from omni_runtime.config import load_config, parse_config

#: The builtin families with a step loop, by their tiny model (stage_configs/<name>.yaml).
FAMILIES = ("tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-pixart", "tiny-sana", "tiny-wan")


def deploy(model: str, threads: int, **engine_args: Any):
    """The bundled config of ``model`` (its sizes, steps and guidance), in one stage process with
    ``threads`` torch threads and ``engine_args`` over its own."""
    stage = load_config(model).stage_args[0]
    return parse_config(
        {
            "model": model,
            "stage_args": [
                {
                    "stage_id": 0,
                    "stage_type": "diffusion",
                    "model": f"builtin:{model}",
                    "runtime": {"backend": "process", "torch_threads": threads},
                    "engine_args": {"max_num_seqs": 4, **engine_args},
                    "final_output": True,
                    "final_output_type": stage.final_output_type,
                    "default_sampling_params": dict(stage.default_sampling_params),
                }
            ],
        },
        source=f"bench-caches-{model}",
    )


async def one(engine: AsyncOmni, prompt: str, seed: int) -> tuple[float, dict[str, Any]]:
    """(ms from submit to the final output, its metrics) of one request."""
    start = time.perf_counter()
    out = None
    async for out in engine.generate(prompt, {"seed": seed}):
        pass
    assert out is not None and out.error is None
    return (time.perf_counter() - start) * 1e3, out.metrics


async def stats(engine: AsyncOmni) -> dict[str, Any]:
    return (await engine.collective_rpc("get_stats"))[0].result


async def exact_results(requests: int, threads: int) -> dict[str, Any]:
    engine = AsyncOmni(deploy("tiny-sd", threads, result_cache={"max_bytes": 64 * 2**20}))
    try:
        for seed in (900, 900):  # warm-up: first calls, allocator, the cache's first entry
            await one(engine, "a lighthouse at dusk", seed)
        misses, hits = [], []
        for seed in range(requests):
            ms, metrics = await one(engine, "a lighthouse at dusk", seed)
            assert metrics["result_cache_hit"] == 0
            misses.append(ms)
            ms, metrics = await one(engine, "a lighthouse at dusk", seed)
            assert metrics["result_cache_hit"] == 1
            hits.append(ms)
        s = (await stats(engine))["result_cache"]
    finally:
        await asyncio.get_running_loop().run_in_executor(None, engine.close)
    miss, hit = statistics.median(misses), statistics.median(hits)
    return {
        "model": "tiny-sd",
        "miss_ms": miss,
        "hit_ms": hit,
        "speedup": miss / hit,
        "hit_p90_ms": sorted(hits)[int(0.9 * (len(hits) - 1))],
        "entries": s["entries"],
        "bytes": s["bytes"],
    }


async def prompt_embeddings(model: str, requests: int, threads: int) -> dict[str, Any]:
    engine = AsyncOmni(deploy(model, threads, step_execution=True))
    try:
        await one(engine, "a red kite over the sea", 0)  # warm-up, and the repeated prompt stored
        await one(engine, "warm-up 1", 1)
        repeated, new = [], []
        for i in range(requests):
            ms, metrics = await one(engine, "a red kite over the sea", 1000 + i)
            assert metrics["prompt_cache_hit"] == 1
            repeated.append(ms)
            ms, metrics = await one(engine, f"prompt number {i} of {model}", 2000 + i)
            assert metrics["prompt_cache_hit"] == 0
            new.append(ms)
        s = (await stats(engine))["prompt_cache"]
    finally:
        await asyncio.get_running_loop().run_in_executor(None, engine.close)
    same, distinct = statistics.median(repeated), statistics.median(new)
    return {
        "model": model,
        "repeated_ms": same,
        "new_ms": distinct,
        "gain": distinct / same,
        "saved_ms": distinct - same,
        "hits": s["hits"],
        "misses": s["misses"],
        "bytes_per_prompt": s["bytes"] // max(1, s["entries"]),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    print(f"exact results: tiny-sd, {args.requests} misses and hits, interleaved", flush=True)
    exact = await exact_results(args.requests, args.threads)
    print(table([exact], list(exact)), flush=True)
    rows = []
    for model in args.families:
        print(f"prompt embeddings: {model}, {args.requests} repeated and new prompts, interleaved", flush=True)
        rows.append(await prompt_embeddings(model, args.requests, args.threads))
        print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in rows[-1].items()), flush=True)
    print("\nexact-result cache (target: hit at least 50x faster than a miss)")
    print(table([exact], list(exact)))
    print("\nprompt cache, step execution (gain = new prompt / repeated prompt, median per request)")
    print(table(rows, list(rows[0]) if rows else []))
    # About 1 + threads is this benchmark alone; more means a neighbour shared the cores.
    print(f"\n1-minute load average at the end: {os.getloadavg()[0]:.2f}")
    return {"exact_result": exact, "prompt_cache": rows, "threads": args.threads, "requests": args.requests}


def _fmt(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help="tiny models, comma-separated")
    parser.add_argument("--requests", type=int, default=20, help="requests of each kind per model")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each stage process")
    parser.add_argument("--quick", action="store_true", help="4 requests of each kind: a smoke run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if args.quick:
        args.requests = 4
    write_json(args.json, uvloop.run(main_async(args)))


if __name__ == "__main__":
    main()
