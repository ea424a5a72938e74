"""One replica on one rank against the same replica as a 2-rank group (``runtime.parallel``),
the same requests, in one run.

For each mode (``cfg``: CFG-parallel on a UNet model; ``ulysses``: sequence parallelism on a
transformer with a context-parallel plan), two engines run one after the other, each warmed up
first:

* **one rank**: one stage process with ``--threads`` torch threads (every core of a 2-core
  machine) on the first device;
* **two ranks**: a group of two processes with ``--threads / 2`` torch threads each (the same
  cores in all), one device each.

Each gets ``--requests`` seeded requests one at a time (latency: what a single user sees) and
then all at once (throughput: what the batcher makes of them). Reported: median latency and
images per second of each, and the group's ratio to the one rank. Every image of the group is
checked against the one rank's for the same seed (±1 uint8 level): a figure from a group that
drew different images would mean nothing.

On a 2-core CPU the two ranks share the cores that one rank used with two threads, so no gain is
expected: the run shows what the lock step costs. On a machine with several GPUs the same command
with ``--devices cuda:0,cuda:1`` and a real model directory (``--model /path``) measures the
split itself.

    python -m benchmarks.parallel [--modes cfg,ulysses] [--requests 6] [--threads 2]
                                  [--devices cpu] [--model-cfg small-sd] [--model-ulysses tiny-flux]
                                  [--size 256] [--steps 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import numpy as np
import uvloop

from benchmarks._common import table, write_json
from omni_runtime import AsyncOmni
from omni_runtime.config import parse_config


def deploy(model: str, devices: str, threads: int, parallel: dict[str, int] | None, size: int, steps: int) -> Any:
    source = model if os.path.isdir(model) else f"builtin:{model}"
    runtime: dict[str, Any] = {"backend": "process", "devices": devices, "torch_threads": threads}
    if parallel is not None:
        runtime["parallel"] = parallel
    return parse_config(
        {
            "stage_args": [
                {
                    "stage_id": 0,
                    "stage_type": "diffusion",
                    "model": source,
                    "runtime": runtime,
                    "engine_args": {"max_num_seqs": 4, "request_batch_max_wait_ms": 20, "max_pixels": size * size},
                    "final_output": True,
                    "final_output_type": "image",
                    "default_sampling_params": {
                        "num_inference_steps": steps,
                        "guidance_scale": 5.0,
                        "height": size,
                        "width": size,
                    },
                }
            ]
        }
    )


async def measure(config: Any, requests: int) -> dict[str, Any]:
    async with AsyncOmni(config) as omni:

        async def one(i: int) -> tuple[float, np.ndarray]:
            start = time.perf_counter()
            final = None
            async for out in omni.generate(
                f"a lighthouse at dusk, take {i}", {"seed": 100 + i}, request_id=f"b{i}-{time.time_ns()}"
            ):
                final = out
            assert final is not None and final.error is None, final and final.error
            return time.perf_counter() - start, np.asarray(final.media[0].data)

        await one(-1)  # warm-up
        latencies, images = [], {}
        for i in range(requests):
            took, image = await one(i)
            latencies.append(took)
            images[i] = image
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - start
    return {"latency_s": statistics.median(latencies), "images_per_s": requests / wall, "images": images}


async def run_mode(mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    model = args.model_cfg if mode == "cfg" else args.model_ulysses
    devices = [d.strip() for d in args.devices.split(",")]
    group_devices = ",".join(devices[:2]) if len(devices) > 1 else devices[0]
    parallel = {"cfg_parallel_size": 2} if mode == "cfg" else {"ulysses_degree": 2}
    one = await measure(deploy(model, devices[0], args.threads, None, args.size, args.steps), args.requests)
    per_rank = max(1, args.threads // 2)
    two = await measure(deploy(model, group_devices, per_rank, parallel, args.size, args.steps), args.requests)
    worst = max(int(np.abs(one["images"][i].astype(int) - two["images"][i].astype(int)).max()) for i in one["images"])
    assert worst <= 1, f"{mode}: the group's images differ from one rank's by {worst} levels"
    rows = []
    for name, result, threads in (
        (f"1 rank x {args.threads} threads", one, args.threads),
        (f"2 ranks x {per_rank} thread(s)", two, per_rank),
    ):
        rows.append(
            {
                "mode": mode,
                "model": model,
                "layout": name,
                "threads_per_rank": threads,
                "latency_s": round(result["latency_s"], 3),
                "images_per_s": round(result["images_per_s"], 3),
                "latency_ratio": round(result["latency_s"] / one["latency_s"], 2),
                "throughput_ratio": round(result["images_per_s"] / one["images_per_s"], 2),
                "max_pixel_diff": worst,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="cfg,ulysses")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the one rank (halved per rank)")
    parser.add_argument("--devices", default="cpu", help="cpu, or two GPUs: cuda:0,cuda:1")
    parser.add_argument("--model-cfg", default="small-sd", help="a builtin name or a model directory")
    parser.add_argument("--model-ulysses", default="tiny-flux", help="a builtin name or a model directory")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for mode in args.modes.split(","):
        rows += uvloop.run(run_mode(mode.strip(), args))
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    columns = [
        "mode",
        "model",
        "layout",
        "latency_s",
        "images_per_s",
        "latency_ratio",
        "throughput_ratio",
        "max_pixel_diff",
    ]
    print(table(rows, columns))
    if args.json:
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
