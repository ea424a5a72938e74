"""Many models in one process (:class:`MultiOmni`): what bringing a model back costs, and what
routing by model costs.

For each tiny builtin config: a cold load (engine start), the first request after it, a wake
from sleep (runners reload their weights, processes stay) with its first request, and a full
stop and reload with its first request, in seconds. Then requests/s of an echo model served
alone against the same echo model served beside two others (their ratio is the routing cost).

    python -m benchmarks.multimodel [--families tiny-sd tiny-flux ...] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from omni_runtime.entrypoints.multi_omni import ModelSpec, MultiOmni

FAMILIES = [
    "tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-pixart", "tiny-sana",
    "tiny-wan", "tiny-ltx", "tiny-stable-audio", "tiny-tts",
]  # fmt: skip


async def _first(multi: MultiOmni, name: str) -> float:
    """Seconds of one small request (it waits for the model to come back first)."""
    model = multi.models[name]
    params: Any = None
    if model.image_stage is not None or model.video_stage is not None:
        params = model.resolved.sampling_params(image={"num_inference_steps": 2, "height": 32, "width": 32})
    start = time.perf_counter()
    async for _ in multi.generate("a red fox", params, model=name):
        pass
    return time.perf_counter() - start


async def _family(name: str) -> dict[str, float]:
    multi = MultiOmni([ModelSpec(source=name, name="m", lazy=True), ModelSpec(source="echo", lazy=True)])
    async with multi:
        row: dict[str, float] = {}
        start = time.perf_counter()
        await multi.acquire("m")  # 1) cold load
        row["cold_load_s"] = time.perf_counter() - start
        multi.release(multi.models["m"])
        row["first_s"] = await _first(multi, "m")
        # 2) sleep, then the first request after it (wake-up included)
        multi.max_loaded_models = 1
        await _first(multi, "echo")  # evicts m (sleep)
        assert multi.models["m"].state == "asleep"
        row["wake_and_first_s"] = await _first(multi, "m")
        # 3) full stop, then the first request after it (cold load included)
        multi.models["m"].evict = "stop"
        await _first(multi, "echo")
        assert multi.models["m"].state == "unloaded"
        row["reload_and_first_s"] = await _first(multi, "m")
    return row


async def _echo_rate(multi: MultiOmni, requests: int, concurrency: int = 16) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            async for _ in multi.generate(f"r{i}", model="echo"):
                pass

    await asyncio.gather(*(one(i) for i in range(50)))  # warm-up
    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    return requests / (time.perf_counter() - start)


async def _routing(requests: int) -> tuple[float, float]:
    async with MultiOmni([ModelSpec(source="echo")]) as alone:
        solo = await _echo_rate(alone, requests)
    others = [ModelSpec(source="echo", name="other1"), ModelSpec(source="echo", name="other2")]
    async with MultiOmni([ModelSpec(source="echo"), *others]) as beside:
        shared = await _echo_rate(beside, requests)
    return solo, shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    print(f"{'config':<20}{'cold load':>11}{'1st req':>9}{'wake+1st':>10}{'stop→reload+1st':>17}")
    for name in args.families:
        try:
            row = asyncio.run(_family(name))
        except Exception as e:  # a config that cannot load here is reported, not fatal
            print(f"{name:<20} failed: {e}")
            continue
        print(
            f"{name:<20}{row['cold_load_s']:>10.2f}s{row['first_s']:>8.2f}s{row['wake_and_first_s']:>9.2f}s"
            f"{row['reload_and_first_s']:>16.2f}s"
        )
    solo, shared = asyncio.run(_routing(args.requests))
    print(f"echo alone: {solo:.0f} req/s; beside two others: {shared:.0f} req/s; ratio {shared / solo:.2f}")


if __name__ == "__main__":
    main()
