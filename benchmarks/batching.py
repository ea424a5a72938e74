"""Request-level batching: the runtime beside direct diffusers calls, in one run.

For each config, side by side and interleaved over rounds:
  (a) N sequential pipeline calls (one prompt each, its own generator),
  (b) one direct ``pipe(prompt=[...N], generator=[...N])`` call,
  (c) the runtime: N concurrent requests through AsyncOmni with ``max_num_seqs=N``,
      the stage in its own process with the same torch thread count.
Then a mixed workload (two resolutions interleaved, Poisson arrivals) comparing the
oldest-key-first policy with strict FIFO on throughput and p99 latency.

    python -m benchmarks.batching [--n 4] [--rounds 3] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import numpy as np
import torch
import uvloop

from benchmarks._common import summary, table, write_json
from omni_runtime import AsyncOmni
from omni_runtime.config import parse_config
from omni_runtime.models.builtin import ensure_builtin

PROMPTS = [
    "a cup of coffee",
    "a toy dinosaur",
    "a fox yawning",
    "a red bicycle",
    "a lighthouse at dusk",
    "a bowl of ramen",
    "a sleeping cat",
    "a paper boat",
]
THREADS = 2


def deploy(model: str, size: int, steps: int, n: int, wait_ms: float, policy: str = "oldest_key"):
    return parse_config(
        {
            "model": model,
            "stage_args": [
                {
                    "stage_id": 0,
                    "stage_type": "diffusion",
                    "model": f"builtin:{model}",
                    "runtime": {"torch_threads": THREADS},
                    "engine_args": {
                        "max_num_seqs": n,
                        "request_batch_max_wait_ms": wait_ms,
                        "scheduling_policy": policy,
                    },
                    "final_output": True,
                    "final_output_type": "image",
                    "default_sampling_params": {
                        "num_inference_steps": steps,
                        "guidance_scale": 7.5,
                        "height": size,
                        "width": size,
                    },
                }
            ],
        },
        source="bench",
    )


def load_pipe(model: str):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(ensure_builtin(model)))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def direct(pipe, prompts: list[str], size: int, steps: int, fused: bool) -> tuple[float, list[float]]:
    """(elapsed s, per-image latency ms) for sequential or one fused pipeline call."""
    kw = {"num_inference_steps": steps, "guidance_scale": 7.5, "height": size, "width": size, "output_type": "np"}
    t0 = time.perf_counter()
    with torch.inference_mode():
        if fused:
            pipe(prompt=prompts, generator=[torch.Generator().manual_seed(i) for i in range(len(prompts))], **kw)
            lat = [(time.perf_counter() - t0) * 1000] * len(prompts)
        else:
            lat = []
            for i, p in enumerate(prompts):
                pipe(prompt=p, generator=torch.Generator().manual_seed(i), **kw)
                lat.append((time.perf_counter() - t0) * 1000)
    return time.perf_counter() - t0, lat


async def through_runtime(engine: AsyncOmni, prompts: list[str]) -> tuple[float, list[float], list[int]]:
    async def one(i: int, p: str):
        t = time.perf_counter()
        out = None
        async for out in engine.generate(p, {"seed": i}):
            pass
        return (time.perf_counter() - t) * 1000, out.metrics["batch_size"]

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - t0, [r[0] for r in res], [r[1] for r in res]


def batching_table(loop, model: str, size: int, steps: int, n: int, rounds: int) -> list[dict]:
    prompts = (PROMPTS * 2)[:n]
    pipe = load_pipe(model)
    direct(pipe, prompts[:1], size, 1, fused=False)  # warm-up
    rows = []
    with AsyncOmni(deploy(model, size, steps, n, wait_ms=50)) as engine:
        loop.run_until_complete(through_runtime(engine, prompts[:2]))  # warm-up
        for r in range(rounds):
            ta, la = direct(pipe, prompts, size, steps, fused=False)
            tb, _ = direct(pipe, prompts, size, steps, fused=True)
            tc, lc, sizes = loop.run_until_complete(through_runtime(engine, prompts))
            row = {
                "config": f"{model} {size}px {steps} steps",
                "round": r,
                "a_seq_img_s": n / ta,
                "b_fused_img_s": n / tb,
                "c_runtime_img_s": n / tc,
                "c_p50_ms": summary(lc)["p50_ms"],
                "c_p99_ms": summary(lc)["p99_ms"],
                "a_p50_ms": summary(la)["p50_ms"],
                "mean_batch": float(np.mean(sizes)),
                "c/b": tb / tc,
                "c/a": ta / tc,
            }
            rows.append(row)
    del pipe
    return rows


async def mixed_workload(engine: AsyncOmni, total: int, rate: float, seed: int) -> dict:
    """Two resolutions interleaved at random, Poisson arrivals at ``rate`` req/s."""
    rng = random.Random(seed)
    lat, sizes = [], []

    async def one(i: int, size: int):
        t = time.perf_counter()
        out = None
        async for out in engine.generate(f"mixed {i}", {"seed": i, "height": size, "width": size}):
            pass
        lat.append((time.perf_counter() - t) * 1000)
        sizes.append(out.metrics["batch_size"])

    tasks = []
    t0 = time.perf_counter()
    for i in range(total):
        tasks.append(asyncio.create_task(one(i, rng.choice((64, 48)))))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    return {"img_s": total / elapsed, **summary(lat), "mean_batch": float(np.mean(sizes))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="concurrent requests = max_num_seqs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mixed-total", type=int, default=64)
    ap.add_argument("--mixed-rate", type=float, default=15.0, help="Poisson arrival rate, req/s (above capacity)")
    ap.add_argument("--mixed-only", action="store_true", help="skip the side-by-side tables")
    ap.add_argument("--quick", action="store_true", help="tiny-sd only, fewer rounds (CI smoke)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    loop = uvloop.new_event_loop()

    configs = [("tiny-sd", 64, 20)] if args.quick else [("tiny-sd", 64, 20), ("small-sd", 128, 20)]
    if args.mixed_only:
        configs = []
    rows = []
    for model, size, steps in configs:
        rows += batching_table(loop, model, size, steps, args.n, 1 if args.quick else args.rounds)
    cols = [
        "config",
        "round",
        "a_seq_img_s",
        "b_fused_img_s",
        "c_runtime_img_s",
        "c/b",
        "c/a",
        "mean_batch",
        "a_p50_ms",
        "c_p50_ms",
        "c_p99_ms",
    ]
    if rows:
        print(table(rows, cols))
    for model, _size, _steps in configs:
        mine = [r for r in rows if r["config"].startswith(f"{model} ")]
        cb = sorted(r["c/b"] for r in mine)[len(mine) // 2]
        ca = sorted(r["c/a"] for r in mine)[len(mine) // 2]
        print(f"{model}: median (c)/(b) = {cb:.2f} (target >= 0.95), (c)/(a) = {ca:.2f}")

    # Mixed workload: same arrivals (same seed) under both policies, alternated over rounds.
    mixed = []
    total = 16 if args.quick else args.mixed_total
    for r in range(1 if args.quick else 2):
        for policy in ("oldest_key", "fifo"):
            with AsyncOmni(deploy("tiny-sd", 64, 4, 8, wait_ms=20, policy=policy)) as engine:
                loop.run_until_complete(through_runtime(engine, PROMPTS[:2]))
                res = loop.run_until_complete(mixed_workload(engine, total, args.mixed_rate, seed=r))
            mixed.append({"round": r, "policy": policy, **res})
    print()
    print(table(mixed, ["round", "policy", "img_s", "mean_batch", "p50_ms", "p99_ms"]))
    write_json(args.json, {"batching": rows, "mixed": mixed})


if __name__ == "__main__":
    main()
