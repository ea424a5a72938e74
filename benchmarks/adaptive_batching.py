"""Cost-aware batching: the learned policy against the runtime's own request batching, each beside
its own one-at-a-time figure.

Three servers of the same runner, each the runtime with one batching configuration
(``max_num_seqs`` 4 for all):

* ``learned``: ``batch_policy: learned``, ``request_batch_max_wait_ms`` 20 (the upper bound of a hold);
* ``window``: ``batch_policy: window`` with the same wait (the fixed window, ended early by the quiet
  window): today's default policy;
* ``fcfs``: ``batch_policy: window`` with ``request_batch_max_wait_ms`` 0: a wave goes as soon as the
  runner is free, with whatever of the oldest request's key is waiting. The FCFS baseline: the
  runtime's own dynamic batching with no hold.

``fcfs`` and ``window`` are the baselines. Every server first serves the run's requests one at a time
(closed loop, one client, one request in flight): its own one-at-a-time figure, taken in the same
run. Then the same sizes in order as four loads: 16 closed-loop clients, and Poisson arrivals at
0.6x, 1.5x and 3x of what ``fcfs`` served one at a time. Every row states its throughput against
its server's own one-at-a-time figure and against ``fcfs`` in the same load.

A baseline that serves fewer requests per second batched than one at a time is a bug in the
baseline, not a win for the policy beside it: where a baseline's throughput, in a load that offers
at least twice what it serves one at a time, is more than :data:`NOISE` below its own
one-at-a-time figure, the run prints a ``WARNING`` line naming it, and the JSON lists it under
``warnings`` (:func:`baseline_warnings`).

Two runners: tiny-sd on the CPU (20 steps, 2 torch threads), where a fused forward costs about what
its requests cost one by one, and :class:`SleepRunner`, whose batch of n requests sleeps
``fixed + 0.1 * n * per_item`` (a GPU's curve: a batch of 4 costs little more than 1).

    python -m benchmarks.adaptive_batching [--quick] [--only synthetic|tiny-sd] [--json out.json]

The machine's load average is printed at the start and the end, and beside each row (``load1``,
taken as the row ends): a CPU comparison is only as good as the quiet it was taken in. On a shared
machine use ``--threads 1``: with two threads per process, a descheduled thread stalls every
operation of the other. The full run (both runners, 20 steps, 24 tiny-sd and 64 synthetic requests
per load) runs three servers over five loads where the version before it ran four over four
(about 8 minutes on a quiet 2-core machine); ``--quick`` (8 tiny-sd and 24 synthetic requests per
load) takes about a third of that.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable, Hashable
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

#: The servers: (name, max_num_seqs, request_batch_max_wait_ms, batch_policy).
SERVERS: tuple[tuple[str, int, float, str], ...] = (
    ("learned", 4, 20.0, "learned"),
    ("window", 4, 20.0, "window"),
    ("fcfs", 4, 0.0, "window"),
)
#: The servers the policy is measured against, and that :func:`baseline_warnings` checks.
BASELINES = ("fcfs", "window")
#: The baseline every ratio is stated against, and whose one-at-a-time figure sets the Poisson rates.
FCFS = "fcfs"
#: The load every server serves first: its own one-at-a-time figure.
ONE_AT_A_TIME = "one at a time"
#: How far (a fraction) a baseline's batched throughput may fall below its own one-at-a-time
#: figure before it counts as a loss rather than noise.
NOISE = 0.10
#: A load is checked by the guard when it offers at least this many times what the server serves
#: one at a time (closed loops always are): below that, throughput is the arrival rate, and a
#: lower figure than one at a time says nothing about the batcher.
SATURATING = 2.0


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
    #: Closed loop: how many clients, each sending its next request when its last is answered.
    #: 0: open loop (the arrival offsets hold).
    clients: int = 0
    #: The rate an open loop offers (requests/s); ``None`` for a closed loop.
    offered_req_s: float | None = None


def draw_sizes(total: int, seed: int) -> list[int]:
    """Each request's size, drawn once per run: every load takes them in this order."""
    rng = random.Random(seed)
    return [rng.choice(SIZES) for _ in range(total)]


def one_at_a_time_load(sizes: list[int]) -> Load:
    return Load(ONE_AT_A_TIME, [(0.0, s) for s in sizes], clients=1)


def make_loads(sizes: list[int], capacity: float, seed: int) -> list[Load]:
    """The closed loop, then Poisson at 0.6x, 1.5x and 3x of ``capacity`` (the requests/s ``fcfs``
    served one at a time). Where a server keeps up with an open load, its throughput is the arrival
    rate; 3x is the open load that offers a batcher the most room (and the one the guard checks)."""
    rng = random.Random(seed + 1)
    loads = [Load(f"closed {CLIENTS} clients", [(0.0, s) for s in sizes], clients=CLIENTS)]
    for name, factor in (("poisson below", 0.6), ("poisson above", 1.5), ("poisson far above", 3.0)):
        rate = capacity * factor
        t, arrivals = 0.0, []
        for s in sizes:
            arrivals.append((t, s))
            t += rng.expovariate(rate)
        loads.append(Load(f"{name} {rate:.1f}/s", arrivals, offered_req_s=rate))
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
    if load.clients:
        queue = list(enumerate(s for _, s in load.arrivals))

        async def client() -> None:
            while queue:
                i, size = queue.pop(0)
                await one(i, size)

        await asyncio.gather(*(client() for _ in range(load.clients)))
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


# ---------------------------------------------------------------- the figures


def one_at_a_time_figures(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(runner, server) -> the requests/s that server served one at a time."""
    return {(r["runner"], r["server"]): r["req_s"] for r in rows if r["load"] == ONE_AT_A_TIME}


def annotate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its server's own one-at-a-time figure, and its throughput as a multiple of
    that (``x_solo``) and of ``fcfs`` in the same load (``x_fcfs``); ``None`` where the run lacks
    the figure."""
    own = one_at_a_time_figures(rows)
    fcfs = {(r["runner"], r["load"]): r["req_s"] for r in rows if r["server"] == FCFS}
    out = []
    for r in rows:
        one = own.get((r["runner"], r["server"]))
        base = fcfs.get((r["runner"], r["load"]))
        out.append(
            {
                **r,
                "solo_req_s": one,
                "x_solo": r["req_s"] / one if one else None,
                "x_fcfs": r["req_s"] / base if base else None,
            }
        )
    return out


def baseline_warnings(
    rows: list[dict[str, Any]], baselines: tuple[str, ...] = BASELINES, noise: float = NOISE
) -> list[dict[str, Any]]:
    """Every baseline row whose throughput is more than ``noise`` below the same server's own
    one-at-a-time figure, in a load that offers at least :data:`SATURATING` times that figure (a
    closed loop of several clients, or ``offered_req_s`` high enough): a baseline that loses to
    sequential is a bug in the baseline. ``rows``: dicts with ``runner``, ``load``, ``server``,
    ``req_s`` and, for an open loop, ``offered_req_s``; one row per (runner, server) with ``load``
    :data:`ONE_AT_A_TIME`. Each warning carries the figures and a ``message``."""
    own = one_at_a_time_figures(rows)
    warnings = []
    for r in rows:
        one = own.get((r["runner"], r["server"]))
        if r["server"] not in baselines or r["load"] == ONE_AT_A_TIME or not one:
            continue
        offered = r.get("offered_req_s")
        if offered is not None and offered < SATURATING * one:
            continue
        ratio = r["req_s"] / one
        if ratio < 1.0 - noise:
            warnings.append(
                {
                    "runner": r["runner"],
                    "load": r["load"],
                    "server": r["server"],
                    "req_s": r["req_s"],
                    "one_at_a_time_req_s": one,
                    "ratio": ratio,
                    "message": (
                        f"WARNING: baseline {r['server']} ({r['runner']} / {r['load']}) serves "
                        f"{r['req_s']:.2f} req/s batched, {ratio:.2f}x its own one-at-a-time "
                        f"{one:.2f} req/s: a baseline that loses to sequential is a bug in the "
                        "baseline, and no ratio against it means anything"
                    ),
                }
            )
    return warnings


def verdict(rows: list[dict[str, Any]], runner: str) -> str:
    """Per load: learned against ``fcfs`` and ``window``, every server against its own one at a
    time, and the targets (against ``fcfs``)."""
    rows = annotate(rows)
    lines = []
    for load in dict.fromkeys(r["load"] for r in rows if r["runner"] == runner):
        by = {r["server"]: r for r in rows if r["runner"] == runner and r["load"] == load}
        if load == ONE_AT_A_TIME:
            figures = ", ".join(f"{name} {r['req_s']:.2f}" for name, r in by.items())
            lines.append(f"{runner} / {load} (req/s): {figures}")
            continue
        learned, fcfs = by["learned"], by[FCFS]
        ratio = learned["req_s"] / fcfs["req_s"]
        own = ", ".join(
            f"{name} {r['req_s']:.2f} = {r['x_solo']:.2f}x its {r['solo_req_s']:.2f}"
            for name, r in by.items()
            if r["x_solo"] is not None
        )
        if runner == "synthetic":
            ok = ratio >= 1.3 and learned["p99_ms"] <= fcfs["p99_ms"]
            target = ">= 1.3x fcfs throughput, p99 <= fcfs"
        else:
            ok = ratio >= 1.0 and learned["p99_ms"] < fcfs["p99_ms"]
            target = ">= fcfs throughput, lower p99"
        lines.append(
            f"{runner} / {load}: learned/fcfs {ratio:.2f}x, learned/window "
            f"{learned['req_s'] / by['window']['req_s']:.2f}x; against one at a time: {own}; p99 "
            f"learned {learned['p99_ms']:.0f}, window {by['window']['p99_ms']:.0f}, fcfs "
            f"{fcfs['p99_ms']:.0f} ms ({target}): {'met' if ok else 'NOT met'}"
        )
    return "\n".join(lines)


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


async def warm_up(submit: Submit) -> None:
    """Both sizes alone, then in bursts: every server sees waves of several sizes first."""
    for size in SIZES:
        await submit(-1, size)
        await asyncio.gather(*(submit(-2 - k, size) for k in range(5)))


async def bench_runner(runner: str, total: int, seed: int) -> list[dict[str, Any]]:
    """Every server is started and warmed up first, then serves the requests one at a time; the
    Poisson rates follow from what ``fcfs`` served so. Each load runs on each server in turn
    (starting with another server per load), so a busy machine's swings fall on all servers alike
    rather than on whichever ran last."""
    loop = asyncio.get_running_loop()
    engines = [AsyncOmni(stage(runner, n, wait, policy)) for _, n, wait, policy in SERVERS]
    rows: list[dict[str, Any]] = []
    try:
        submits = {name: runtime_submit(engine, runner) for (name, *_), engine in zip(SERVERS, engines, strict=True)}
        for submit in submits.values():
            await warm_up(submit)
        names = list(submits)
        sizes = draw_sizes(total, seed)

        async def run_load(k: int, load: Load) -> None:
            # Each load starts with another server: none always runs first (or last) in a load.
            for name in names[k % len(names) :] + names[: k % len(names)]:
                result = await drive(load, submits[name])
                row = {"runner": runner, "load": load.name, "server": name, **result}
                rows.append({**row, "offered_req_s": load.offered_req_s, "load1": os.getloadavg()[0]})
                print(rows[-1], flush=True)

        await run_load(0, one_at_a_time_load(sizes))
        capacity = one_at_a_time_figures(rows)[(runner, FCFS)]
        print(f"{runner}: {FCFS} one at a time {capacity:.2f} req/s sets the Poisson rates", flush=True)
        for k, load in enumerate(make_loads(sizes, capacity, seed), start=1):
            await run_load(k, load)
        [stats] = await engines[0].collective_rpc("get_stats")
        print("learned cost model:", stats.result["cost_model"], flush=True)
    finally:
        for engine in engines:
            await loop.run_in_executor(None, engine.close)
    return rows


COLUMNS = ["runner", "load", "server", "req_s", "solo_req_s", "x_solo", "x_fcfs", "p50_ms", "p99_ms"]


async def main_async(args: argparse.Namespace) -> None:
    runners = [args.only] if args.only else ["synthetic", "tiny-sd"]
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    rows: list[dict[str, Any]] = []
    for runner in runners:
        total = {"synthetic": 24 if args.quick else 64, "tiny-sd": 8 if args.quick else 24}[runner]
        if runner == "tiny-sd" and args.tiny_total:
            total = args.tiny_total
        how = f", {STEPS} steps, {THREADS} torch threads" if runner == "tiny-sd" else ""
        print(f"{runner}: {total} requests per load{how}", flush=True)
        rows += await bench_runner(runner, total, seed=args.seed)
    rows = annotate(rows)
    warnings = baseline_warnings(rows)
    print()
    print(table(rows, [*COLUMNS, "mean_batch", "load1"]))
    print("solo_req_s: the server's own one-at-a-time req/s; x_solo: req_s / solo_req_s; x_fcfs: req_s / fcfs's req_s")
    print()
    for runner in runners:
        print(verdict(rows, runner))
    print()
    for w in warnings:
        print(w["message"], flush=True)
    if not warnings:
        print(f"no baseline fell more than {NOISE:.0%} below its own one-at-a-time figure in a saturating load")
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    write_json(args.json, {"rows": rows, "warnings": warnings})


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
