"""Cost-aware batching: the learned policy beside today's window, a plain batcher, and no batching.

On the same arrival sequences (16 closed-loop clients; Poisson arrivals below and above one
request at a time's capacity; two sizes interleaved), four servers of the same runner:

* ``learned``: the runtime, ``batch_policy: learned`` (max_num_seqs 4, request_batch_max_wait_ms 20);
* ``window``: the runtime, ``batch_policy: window`` (the same knobs, the fixed window and quiet window);
* ``plain``: a plain dynamic batcher written here: first come first served, the head waits up to
  20 ms for up to 3 more requests of its size, then one fused call; no runtime around it;
* ``sequential``: the runtime with max_num_seqs 1 and no wait.

Two runners: tiny-sd on the CPU (20 steps, 2 torch threads), where a fused forward costs about what
its requests cost one by one, and :class:`SleepRunner`, whose batch of n requests sleeps
``fixed + 0.1 * n * per_item`` (a GPU's curve: a batch of 4 costs little more than 1).

    python -m benchmarks.adaptive_batching [--quick] [--only synthetic|tiny-sd] [--json out.json]

The machine's load average is printed at the start and the end, and beside each row (``load1``,
taken as the row ends): a CPU comparison is only as good as the quiet it was taken in. On a shared
machine use ``--threads 1``: with two threads per process, a descheduled thread stalls every
operation of the other. The full run (both runners, 20 steps, 24 tiny-sd requests per load) took
6.5 minutes for tiny-sd alone on 1 thread at load average 3 to 8, so both runners should take about
7 minutes on a quiet machine; ``--quick`` (8 tiny-sd and 24 synthetic requests per load) takes
about a third of that.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from benchmarks._common import summary, table, write_json
from omni_runtime import AsyncOmni
from omni_runtime.config import DeployConfig, parse_config
from omni_runtime.params import GenericSamplingParams
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner

#: Torch threads of every tiny-sd server (``--threads``). On a machine shared with other work, 1:
#: two threads that wait on each other at every operation slow down many times over when one of
#: them is descheduled, and which server that hits is chance.
THREADS = 2
#: Denoising steps of tiny-sd (``--steps``).
STEPS = 20
SIZES = (64, 48)
#: The synthetic runner's curve at size 64 (a size-48 request costs (48/64)^2 of it).
FIXED_MS = 150.0
PER_ITEM_MS = 150.0
CLIENTS = 16


def synthetic_cost_s(size: int, n: int) -> float:
    """A GPU-like batch: ``fixed + 0.1 * n * per_item``, scaled by the area."""
    return (FIXED_MS + 0.1 * n * PER_ITEM_MS) * (size / 64) ** 2 / 1000.0


class SleepRunner(StageRunner):
    """Sleeps what :func:`synthetic_cost_s` says a batch costs; requests of one ``size`` fuse."""

    params_cls = GenericSamplingParams

    def batch_key(self, request: RunnerRequest) -> Hashable:
        return int(request.params.get("size") or 64)

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        time.sleep(synthetic_cost_s(int(batch[0].params.get("size") or 64), len(batch)))
        return [RunnerOutput(text=str(r.prompt)) for r in batch]


# ---------------------------------------------------------------- loads


@dataclass(frozen=True)
class Load:
    name: str
    #: Open loop: (arrival offset s, size) per request; closed loop: the sizes, taken in order.
    arrivals: list[tuple[float, int]]
    closed: bool = False


def make_loads(capacity: float, total: int, seed: int) -> list[Load]:
    """``capacity``: requests/s one at a time; Poisson at 0.6x, 1.5x and 3x of it. The last is
    past what the plain batcher serves too (its batches average about 2), the one load where a
    batcher's throughput can differ from the arrival rate for every server but sequential."""
    rng = random.Random(seed)
    sizes = [rng.choice(SIZES) for _ in range(total)]
    loads = [Load(f"closed {CLIENTS} clients", [(0.0, s) for s in sizes], closed=True)]
    for name, factor in (("poisson below", 0.6), ("poisson above", 1.5), ("poisson far above", 3.0)):
        t, arrivals = 0.0, []
        for s in sizes:
            arrivals.append((t, s))
            t += rng.expovariate(capacity * factor)
        loads.append(Load(f"{name} {capacity * factor:.1f}/s", arrivals))
    return loads


Submit = Callable[[int, int], Awaitable[int]]  # (index, size) -> the batch size it ran in


async def drive(load: Load, submit: Submit) -> dict[str, Any]:
    lat: list[float] = []
    batches: list[int] = []

    async def one(i: int, size: int) -> None:
        t = time.perf_counter()
        batches.append(await submit(i, size))
        lat.append((time.perf_counter() - t) * 1000.0)

    t0 = time.perf_counter()
    if load.closed:
        queue = list(enumerate(s for _, s in load.arrivals))

        async def client() -> None:
            while queue:
                i, size = queue.pop(0)
                await one(i, size)

        await asyncio.gather(*(client() for _ in range(CLIENTS)))
    else:
        tasks = []
        for i, (at, size) in enumerate(load.arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, size)))
        await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    s = summary(lat)
    return {
        "req_s": len(lat) / elapsed,
        "p50_ms": s["p50_ms"],
        "p99_ms": s["p99_ms"],
        "mean_batch": sum(batches) / len(batches),
    }


# ---------------------------------------------------------------- the plain batcher


class PlainBatcher:
    """First come first served; the head waits up to ``timeout_ms`` for up to ``max_batch - 1``
    more of its size (the first of another size closes the batch); one call per batch."""

    def __init__(self, run_batch: Callable[[int, list[int]], None], max_batch: int = 4, timeout_ms: float = 20.0):
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.timeout_s = timeout_ms / 1000.0
        self.queue: asyncio.Queue[tuple[int, int, asyncio.Future[int]]] = asyncio.Queue()
        self.thread = ThreadPoolExecutor(1)
        self.task: asyncio.Task[None] | None = None

    async def submit(self, i: int, size: int) -> int:
        if self.task is None:
            self.task = asyncio.create_task(self._loop())
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        await self.queue.put((i, size, fut))
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        carry: tuple[int, int, asyncio.Future[int]] | None = None
        while True:
            head = carry or await self.queue.get()
            carry = None
            batch = [head]
            deadline = loop.time() + self.timeout_s
            while len(batch) < self.max_batch:
                try:
                    nxt = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    break
                if nxt[1] != head[1]:
                    carry = nxt
                    break
                batch.append(nxt)
            await loop.run_in_executor(self.thread, self.run_batch, head[1], [b[0] for b in batch])
            for _, _, fut in batch:
                fut.set_result(len(batch))


# ---------------------------------------------------------------- the runtime


def stage(runner: str, max_num_seqs: int, wait_ms: float, policy: str) -> DeployConfig:
    engine_args = {"max_num_seqs": max_num_seqs, "request_batch_max_wait_ms": wait_ms, "batch_policy": policy}
    if runner == "synthetic":
        spec: dict[str, Any] = {
            "stage_type": "benchmarks.adaptive_batching:SleepRunner",
            "final_output_type": "text",
            "runtime": {"torch_threads": 1},
        }
    else:
        spec = {
            "stage_type": "diffusion",
            "model": "builtin:tiny-sd",
            "final_output_type": "image",
            "runtime": {"torch_threads": THREADS},
            "default_sampling_params": {"num_inference_steps": STEPS, "guidance_scale": 7.5},
        }
    return parse_config(
        {"stage_args": [{"stage_id": 0, "final_output": True, "engine_args": engine_args, **spec}]}, source="bench"
    )


def runtime_submit(engine: AsyncOmni, runner: str) -> Submit:
    async def submit(i: int, size: int) -> int:
        params: dict[str, Any] = (
            {"size": size} if runner == "synthetic" else {"seed": abs(i), "height": size, "width": size}
        )
        out = None
        async for out in engine.generate(f"a red bicycle {i}", params):
            pass
        assert out is not None and out.finished
        return int(out.metrics.get("batch_size", 1))

    return submit


def tiny_sd_batch() -> Callable[[int, list[int]], None]:
    import torch
    from diffusers import DiffusionPipeline

    from omni_runtime.models.builtin import ensure_builtin

    torch.set_num_threads(THREADS)
    pipe = DiffusionPipeline.from_pretrained(str(ensure_builtin("tiny-sd")))
    pipe.set_progress_bar_config(disable=True)

    def run(size: int, ids: list[int]) -> None:
        with torch.inference_mode():
            pipe(
                prompt=[f"a red bicycle {i}" for i in ids],
                generator=[torch.Generator().manual_seed(abs(i)) for i in ids],
                num_inference_steps=STEPS,
                guidance_scale=7.5,
                height=size,
                width=size,
                output_type="np",
            )

    return run


async def warm_up(submit: Submit) -> None:
    """Both sizes alone, then in bursts: every server sees waves of several sizes first."""
    for size in SIZES:
        await submit(-1, size)
        await asyncio.gather(*(submit(-2 - k, size) for k in range(5)))


async def bench_runner(runner: str, loads: list[Load]) -> list[dict[str, Any]]:
    """Every server is started and warmed up first; then each load runs on each server in turn
    (starting with another server per load), so a busy machine's swings fall on all servers alike
    rather than on whichever ran last."""
    systems: list[tuple[str, int, float, str]] = [
        ("learned", 4, 20.0, "learned"),
        ("window", 4, 20.0, "window"),
        ("sequential", 1, 0.0, "window"),
    ]
    loop = asyncio.get_running_loop()
    engines = [AsyncOmni(stage(runner, n, wait, policy)) for _, n, wait, policy in systems]
    try:
        submits: dict[str, Submit] = {
            name: runtime_submit(engine, runner) for (name, *_), engine in zip(systems, engines, strict=True)
        }
        if runner == "synthetic":

            def run_batch(size: int, ids: list[int]) -> None:
                time.sleep(synthetic_cost_s(size, len(ids)))
        else:
            run_batch = await loop.run_in_executor(None, tiny_sd_batch)
        submits["plain"] = PlainBatcher(run_batch).submit
        for submit in submits.values():
            await warm_up(submit)
        rows = []
        names = list(submits)
        for k, load in enumerate(loads):
            # Each load starts with another server: none always runs first (or last) in a load.
            for name in names[k % len(names) :] + names[: k % len(names)]:
                submit = submits[name]
                result = await drive(load, submit)
                rows.append(
                    {"runner": runner, "load": load.name, "server": name, **result, "load1": os.getloadavg()[0]}
                )
                print(rows[-1], flush=True)
        [stats] = await engines[0].collective_rpc("get_stats")
        print("learned cost model:", stats.result["cost_model"], flush=True)
    finally:
        for engine in engines:
            await loop.run_in_executor(None, engine.close)
    return rows


def capacity(runner: str) -> float:
    """Requests/s one at a time, over the two sizes."""
    if runner == "synthetic":
        return 2.0 / sum(synthetic_cost_s(s, 1) for s in SIZES)
    run = tiny_sd_batch()
    run(64, [0])  # warm-up
    per_size = []
    for s in SIZES:
        times = []
        for _ in range(3):  # the median: a busy machine's spikes do not set the rates
            t0 = time.perf_counter()
            run(s, [0])
            times.append(time.perf_counter() - t0)
        per_size.append(sorted(times)[1])
    return len(SIZES) / sum(per_size)


def verdict(rows: list[dict[str, Any]], runner: str) -> str:
    lines = []
    for load in dict.fromkeys(r["load"] for r in rows if r["runner"] == runner):
        by = {r["server"]: r for r in rows if r["runner"] == runner and r["load"] == load}
        learned, plain = by["learned"], by["plain"]
        ratio = learned["req_s"] / plain["req_s"]
        if runner == "synthetic":
            ok = ratio >= 1.3 and learned["p99_ms"] <= plain["p99_ms"]
            target = ">= 1.3x plain throughput, p99 <= plain"
        else:
            ok = ratio >= 1.0 and learned["p99_ms"] < plain["p99_ms"]
            target = ">= plain throughput, lower p99"
        lines.append(
            f"{runner} / {load}: learned/plain throughput {ratio:.2f}x, p99 {learned['p99_ms']:.0f} vs "
            f"{plain['p99_ms']:.0f} ms ({target}): {'met' if ok else 'NOT met'}"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    runners = [args.only] if args.only else ["synthetic", "tiny-sd"]
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    rows: list[dict[str, Any]] = []
    for runner in runners:
        cap = capacity(runner)
        total = {"synthetic": 24 if args.quick else 64, "tiny-sd": 8 if args.quick else 24}[runner]
        if runner == "tiny-sd" and args.tiny_total:
            total = args.tiny_total
        how = f" ({STEPS} steps, {THREADS} torch threads)" if runner == "tiny-sd" else ""
        print(f"{runner}: one at a time {cap:.2f} req/s{how}", flush=True)
        rows += await bench_runner(runner, make_loads(cap, total, seed=args.seed))
    print()
    print(table(rows, ["runner", "load", "server", "req_s", "p50_ms", "p99_ms", "mean_batch", "load1"]))
    print()
    for runner in runners:
        print(verdict(rows, runner))
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    write_json(args.json, rows)


def main() -> None:
    global STEPS, THREADS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests per load (a smoke run)")
    ap.add_argument("--only", choices=["synthetic", "tiny-sd"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=STEPS, help="tiny-sd denoising steps")
    ap.add_argument("--tiny-total", type=int, help="tiny-sd requests per load (default 24, --quick 8)")
    ap.add_argument("--threads", type=int, default=THREADS, help="torch threads per tiny-sd server")
    ap.add_argument("--json")
    args = ap.parse_args()
    STEPS, THREADS = args.steps, args.threads
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
