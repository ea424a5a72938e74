"""SLO attainment under a mixed image and video trace: several servers, side by side, in one run.

What a user of a generation service feels is whether each request meets its deadline. This
benchmark replays a trace (arrival time, task, size, frames, steps, seed, ``slo_ms`` per request)
over HTTP, open loop, against real ``omni-runtime serve`` processes, and reports per server:

* **attainment**: the fraction of all requests answered within their ``slo_ms`` (a shed request, a
  429, and an error count as misses);
* **goodput**: the requests that met their SLO per second of the run (from the first arrival to
  the last answer, as vLLM's serving benchmark divides by its duration: a server that drains its
  backlog slowly pays for it here);
* p50 / p99 latency per request class (answered requests only), and the shed count;
* its own one-at-a-time figures: the solo time of each class (median of ``--solo-repeats``
  requests sent one after another to the idle server) and the sequential throughput on the
  trace's mix, one client sending its requests back to back (1 / the mix's mean solo time), so
  that every comparison states its baseline's own sequential figure.

The trace (JSON Lines, one request a line, no header; :class:`TraceRequest`)::

    {"t": 0.41, "task": "text2video", "model": "tiny-wan", "width": 32, "height": 32,
     "num_frames": 9, "steps": 16, "seed": 1234, "slo_ms": null, "class": "vid-9"}

``slo_ms: null`` means "``--slo-scale`` x this class's solo time", filled at replay: a solo time is
a property of a server on a machine, not of the trace, so ``gen`` writes nulls and ``run`` measures
the solo times on the reference server (the first of ``--servers``) before its first replay, then
gives every server the same filled trace (vLLM-Omni's diffusion benchmark fills a missing
``slo_ms`` the same way from its warm-up). A number in the file is kept as it is.

The generator mixes small and larger images (one-frame videos: one Wan stage serves image and video
keys side by side) with short and longer videos, and its arrivals come in bursts and quiet periods:
a two-state Markov-modulated Poisson process (a burst state 4 times busier than the quiet one, 30 %
of the time on average, a quiet and a burst period lasting ``--period`` seconds together on
average), scaled so that the mean rate is ``--rate``.

Servers (``--servers``; each a fresh ``omni-runtime serve`` of ``stage_configs/tiny-wan.yaml``'s one
Wan stage with these ``engine_args``, started one at a time, on 127.0.0.1 at a free port):
``fcfs`` (the runtime's own request batching with no hold: the FCFS baseline), ``window``,
``learned``, ``deadline`` (step execution, least slack first) and ``deadline+shed`` (the same,
refusing what cannot meet its SLO); :data:`SERVERS`. Rounds interleave the servers (round 1 of
each, then round 2 of each, each round starting one server later) because the machines are noisy.

    python -m benchmarks.slo gen --seed 0 --duration 20 --rate 5 --out trace.jsonl
    python -m benchmarks.slo run [--servers fcfs,window,learned,deadline,deadline+shed]
        [--rounds 2] [--seed 0 --duration 20 --load 1.5 | --trace trace.jsonl] [--json out.json]
    python -m benchmarks.slo replay --url http://127.0.0.1:8000 --trace trace.jsonl

Without ``--trace``, ``run`` generates the trace after measuring the reference server's solo times,
at ``--load`` x its sequential throughput (a load past one-at-a-time capacity), and writes it with
its SLOs filled to ``--save-trace``, so the same trace can be replayed later. The default run (5
servers x 2 rounds, 20 s of arrivals at 1.5x) takes about 5.5 minutes on a 2-core CPU: a server
starts in about 6 s, its solo requests take about 5 s and its replay 20 to 25 s.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import msgspec
import yaml

from benchmarks._common import REPO, Server, pct, write_json
from omni_runtime.bounds import meta

#: The deploy config every server is derived from (its one Wan stage; only ``engine_args`` change).
BASE_CONFIG = REPO / "stage_configs" / "tiny-wan.yaml"
MODEL = "tiny-wan"
#: Each server's ``engine_args`` for the Wan stage. ``fcfs`` is the runtime's own request-level
#: batching with the hold at 0: what a plain first-come-first-served batcher does, with none of a
#: toy's handicaps (the issue's "credible baseline").
SERVERS: dict[str, dict[str, Any]] = {
    "fcfs": {"max_num_seqs": 4, "request_batch_max_wait_ms": 0, "batch_policy": "window"},
    "window": {"max_num_seqs": 4, "request_batch_max_wait_ms": 50, "batch_policy": "window"},
    "learned": {"max_num_seqs": 4, "request_batch_max_wait_ms": 50, "batch_policy": "learned"},
    "deadline": {"max_num_seqs": 4, "step_execution": True, "batch_policy": "deadline"},
    "deadline+shed": {"max_num_seqs": 4, "step_execution": True, "batch_policy": "deadline", "slo_shed": True},
}
#: Longest trace, seconds: past a day a ``t`` is a unit mistake (milliseconds), not a trace.
MAX_TRACE_S = 86_400.0
#: A request that takes longer than this has hung: it is recorded as an error.
REQUEST_TIMEOUT_S = 900.0


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request of a trace: one line of its JSON Lines file. The bounds are the server's own
    (:mod:`omni_runtime.bounds`), so a line the server would refuse is refused at load."""

    #: Arrival, seconds from the start of the replay; lines are in arrival order.
    t: Annotated[float, msgspec.Meta(ge=0, le=MAX_TRACE_S)]
    task: Literal["text2image", "text2video"]
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    width: Annotated[int, meta("width")]
    height: Annotated[int, meta("height")]
    #: Frames of a video (task ``text2video``); unset: the stage's default.
    num_frames: Annotated[int, meta("num_frames")] | None = None
    steps: Annotated[int, meta("num_inference_steps")]
    seed: Annotated[int, meta("seed")]
    #: The latency target (ms), sent as the request's ``config.slo_ms``; null: filled at replay
    #: from the class's solo time (see the module's doc).
    slo_ms: Annotated[float, meta("slo_ms")] | None = None
    #: A label of the request's shape ("img-32", "vid-9"): solo times and latencies are per class.
    cls: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = msgspec.field(name="class")


_DECODER = msgspec.json.Decoder(TraceRequest)


def parse_trace(text: str, source: str = "<trace>") -> list[TraceRequest]:
    """The requests of a trace's text; :class:`TraceError` naming ``source:line`` for the first
    line that is not a valid request, or that arrives before the line above it."""
    requests: list[TraceRequest] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            request = _DECODER.decode(line)
        except msgspec.ValidationError as e:
            raise TraceError(f"{where}: {e}") from None
        except msgspec.DecodeError as e:
            raise TraceError(f"{where}: not a JSON object: {e}") from None
        if request.task == "text2image" and request.num_frames is not None:
            raise TraceError(f"{where}: num_frames is for task text2video, not text2image")
        if requests and request.t < requests[-1].t:
            raise TraceError(f"{where}: t {request.t} is before the line above it ({requests[-1].t}): sort by t")
        requests.append(request)
    if not requests:
        raise TraceError(f"{source}: no requests")
    return requests


def load_trace(path: str | Path) -> list[TraceRequest]:
    return parse_trace(Path(path).read_text(), str(path))


def dump_trace(trace: Iterable[TraceRequest]) -> str:
    return "".join(msgspec.json.encode(r).decode() + "\n" for r in trace)


# ---------------------------------------------------------------- the generator


@dataclass(frozen=True, slots=True)
class RequestClass:
    """A request shape of the generated traces, and its share of them."""

    name: str
    task: Literal["text2image", "text2video"]
    width: int
    height: int
    num_frames: int | None
    steps: int
    weight: float

    def request(self, t: float, seed: int, model: str = MODEL, slo_ms: float | None = None) -> TraceRequest:
        return TraceRequest(
            t=t, task=self.task, model=model, width=self.width, height=self.height, num_frames=self.num_frames,
            steps=self.steps, seed=seed, slo_ms=slo_ms, cls=self.name,
        )  # fmt: skip


#: The tiny Wan's mix: images (one-frame videos: the Wan stage serves them as it serves videos,
#: in keys of their own) of two sizes, and videos of 9, 17 and 33 frames (4k + 1, as its VAE packs
#: time) with more steps. Small requests are most of the arrivals, long videos most of the work:
#: on a 2-core CPU their solo times run from about 70 ms to 560 ms.
CLASSES: tuple[RequestClass, ...] = (
    RequestClass("img-32", "text2video", 32, 32, 1, 8, 0.35),
    RequestClass("img-64", "text2video", 64, 64, 1, 8, 0.25),
    RequestClass("vid-9", "text2video", 32, 32, 9, 16, 0.20),
    RequestClass("vid-17", "text2video", 64, 64, 17, 32, 0.12),
    RequestClass("vid-33", "text2video", 64, 64, 33, 32, 0.08),
)


def arrivals(
    rng: random.Random, duration: float, rate: float, *, burst_ratio: float, burst_share: float, period: float
) -> list[float]:
    """Arrival times in ``[0, duration)`` of a two-state Markov-modulated Poisson process whose
    mean rate is ``rate``: a burst state ``burst_ratio`` times busier than the quiet one, in which
    the process spends ``burst_share`` of its time; a quiet and a burst period last ``period``
    seconds together on average (each exponentially distributed)."""
    if not (rate > 0 and duration > 0 and burst_ratio >= 1 and 0 < burst_share < 1 and period > 0):
        raise ValueError("need rate, duration, period > 0, burst_ratio >= 1, 0 < burst_share < 1")
    quiet = rate / (burst_share * burst_ratio + (1 - burst_share))
    rates = {False: quiet, True: quiet * burst_ratio}
    mean_stay = {False: (1 - burst_share) * period, True: burst_share * period}
    burst = rng.random() < burst_share
    t, times = 0.0, []
    state_end = rng.expovariate(1 / mean_stay[burst])
    while t < duration:
        gap = rng.expovariate(rates[burst])
        if t + gap >= state_end:  # memoryless: the next arrival is drawn again in the new state
            t, burst = state_end, not burst
            state_end = t + rng.expovariate(1 / mean_stay[burst])
            continue
        t += gap
        if t < duration:
            times.append(t)
    return times


def generate(
    seed: int,
    duration: float,
    rate: float,
    *,
    classes: Sequence[RequestClass] = CLASSES,
    model: str = MODEL,
    burst_ratio: float = 4.0,
    burst_share: float = 0.3,
    period: float = 5.0,
) -> list[TraceRequest]:
    """A seeded trace (``slo_ms`` null): :func:`arrivals`, each request of a class drawn by weight,
    with a seed of its own (no two requests alike, so no cache across requests can answer one)."""
    rng = random.Random(seed)
    times = arrivals(rng, duration, rate, burst_ratio=burst_ratio, burst_share=burst_share, period=period)
    weights = [c.weight for c in classes]
    picked = rng.choices(list(classes), weights, k=len(times))
    seeds = rng.sample(range(1, 2**31), len(times))
    return [c.request(round(t, 4), s, model) for t, c, s in zip(times, picked, seeds, strict=True)]


def with_slos(trace: Sequence[TraceRequest], solo_ms: Mapping[str, float], scale: float) -> list[TraceRequest]:
    """``trace`` with every null ``slo_ms`` set to ``scale`` x its class's solo time."""
    missing = {r.cls for r in trace if r.slo_ms is None} - solo_ms.keys()
    if missing:
        raise ValueError(f"no solo time for classes {sorted(missing)}")
    return [
        r if r.slo_ms is not None else msgspec.structs.replace(r, slo_ms=round(solo_ms[r.cls] * scale, 1))
        for r in trace
    ]


def sequential_rps(mix: Mapping[str, float], solo_ms: Mapping[str, float]) -> float:
    """Requests/s of one client sending requests of this class ``mix`` (weights or counts) back to
    back, each taking its class's solo time: the server's one-at-a-time capacity on the mix."""
    return 1000.0 * sum(mix.values()) / sum(w * solo_ms[name] for name, w in mix.items())


# ---------------------------------------------------------------- replay


@dataclass(slots=True)
class Record:
    """What happened to one request of a replay; times in seconds from the replay's start."""

    index: int
    cls: str
    slo_ms: float | None
    arrival_s: float
    sent_s: float
    finished_s: float
    latency_ms: float
    #: ``ok`` (completed), ``shed`` (refused with 429: at admission, or by the stage as a job's
    #: error) or ``error``.
    status: str
    #: The HTTP status of the answer (a shed job that the engine admitted first is a 200 whose
    #: job failed with a 429 error); None when no answer came.
    http_status: int | None = None
    #: The wave or step batch it ran in, as the job's timings report it.
    batch_size: int | None = None
    error: str | None = None

    @property
    def met(self) -> bool:
        """Answered within its SLO (a request without one: answered)."""
        return self.status == "ok" and (self.slo_ms is None or self.latency_ms <= self.slo_ms)


def body_of(r: TraceRequest) -> dict[str, Any]:
    """The ``POST /v1/generate`` body of a trace request: answered when the job ends."""
    inputs: dict[str, Any] = {
        "prompt": f"{r.cls} request {r.seed}",  # distinct per request, as the seed is
        "width": r.width,
        "height": r.height,
        "num_inference_steps": r.steps,
        "seed": r.seed,
    }
    if r.num_frames is not None:
        inputs["num_frames"] = r.num_frames
    config = {} if r.slo_ms is None else {"slo_ms": r.slo_ms}
    return {"task": r.task, "model": r.model, "inputs": inputs, "config": config, "async_run": False}


def outcome(status_code: int, body: Any) -> tuple[str, str | None]:
    """(``ok`` | ``shed`` | ``error``, what went wrong) of a ``/v1/generate`` answer. A request the
    engine admitted and a stage then refused as unable to meet its SLO ends as a failed job whose
    error has status 429: shed, as the immediate 429 is."""
    if status_code == 429:
        return "shed", None
    if status_code == 200 and isinstance(body, dict):
        if body.get("status") == "completed":
            return "ok", None
        error = body.get("error")
        error = error if isinstance(error, dict) else {}
        if error.get("status") == 429:
            return "shed", None
        return "error", f"job {body.get('status')}: {error.get('code')}: {error.get('message')}"
    detail = body.get("error", body) if isinstance(body, dict) else body
    return "error", f"HTTP {status_code}: {str(detail)[:300]}"


def _batch_size(body: Any) -> int | None:
    stages = body.get("timings", {}).get("stages", {}) if isinstance(body, dict) else {}
    sizes = [s.get("batch_size") for s in stages.values() if isinstance(s, dict)]
    return next((s for s in sizes if isinstance(s, int)), None)


async def send(client: httpx.AsyncClient, r: TraceRequest) -> tuple[str, str | None, int | None, int | None]:
    """One request, answered: (status, error, HTTP status, batch size)."""
    try:
        response = await client.post("/v1/generate", json=body_of(r))
    except httpx.HTTPError as e:
        return "error", f"{type(e).__name__}: {e}", None, None
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    status, error = outcome(response.status_code, body)
    return status, error, response.status_code, _batch_size(body)


def client_for(url: str, api_key: str | None = None) -> httpx.AsyncClient:
    """An HTTP client with no cap on connections: an open loop must never wait for a free one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=REQUEST_TIMEOUT_S)


async def replay(client: httpx.AsyncClient, trace: Sequence[TraceRequest]) -> tuple[list[Record], float]:
    """Send each request at its arrival time, never waiting for earlier answers (open loop);
    the records in trace order and the wall time, first arrival to last answer."""
    records: list[Record | None] = [None] * len(trace)
    start = time.perf_counter()

    async def one(i: int, r: TraceRequest) -> None:
        sent = time.perf_counter()
        status, error, code, batch = await send(client, r)
        done = time.perf_counter()
        records[i] = Record(
            index=i, cls=r.cls, slo_ms=r.slo_ms, arrival_s=r.t, sent_s=sent - start, finished_s=done - start,
            latency_ms=(done - sent) * 1000.0, status=status, http_status=code, batch_size=batch, error=error,
        )  # fmt: skip

    tasks = []
    for i, r in enumerate(trace):
        delay = start + r.t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, r)))
    await asyncio.gather(*tasks)
    done = [r for r in records if r is not None]
    return done, max(r.finished_s for r in done) - min(r.arrival_s for r in done)


def score(records: Sequence[Record], wall_s: float) -> dict[str, Any]:
    """Attainment (shed and errors are misses), goodput, latency per class (answered requests)."""
    n = len(records)
    met = sum(r.met for r in records)
    ok = [r for r in records if r.status == "ok"]
    batches = [r.batch_size for r in ok if r.batch_size is not None]
    classes = {}
    for name in sorted({r.cls for r in records}):
        mine = [r for r in records if r.cls == name]
        latencies = [r.latency_ms for r in mine if r.status == "ok"]
        classes[name] = {
            "requests": len(mine),
            "met": sum(r.met for r in mine),
            "attainment": sum(r.met for r in mine) / len(mine),
            "shed": sum(r.status == "shed" for r in mine),
            "p50_ms": pct(latencies, 50),
            "p99_ms": pct(latencies, 99),
        }
    return {
        "requests": n,
        "met": met,
        "ok": len(ok),
        "shed": sum(r.status == "shed" for r in records),
        "errors": sum(r.status == "error" for r in records),
        "attainment": met / n if n else float("nan"),
        "goodput_rps": met / wall_s if wall_s > 0 else float("nan"),
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else float("nan"),
        "wall_s": wall_s,
        "mean_batch": statistics.fmean(batches) if batches else float("nan"),
        "max_send_lag_ms": max(((r.sent_s - r.arrival_s) * 1000.0 for r in records), default=0.0),
        "classes": classes,
    }


async def solo_times(client: httpx.AsyncClient, shapes: Mapping[str, TraceRequest], repeats: int) -> dict[str, float]:
    """Each class's solo time (ms): the median of ``repeats`` requests sent one after another to
    the idle server, after one unmeasured request of the class (a shape's first forward pays its
    set-up). Seeds differ from every trace request's and from each other."""
    solo: dict[str, float] = {}
    seed = 2**31  # above every generated seed
    for name, shape in shapes.items():
        times = []
        for i in range(repeats + 1):
            seed += 1
            start = time.perf_counter()
            status, error, _, _ = await send(client, msgspec.structs.replace(shape, seed=seed, slo_ms=None))
            if status != "ok":
                raise RuntimeError(f"solo request of class {name} failed: {status}: {error}")
            if i:
                times.append((time.perf_counter() - start) * 1000.0)
        solo[name] = statistics.median(times)
    return solo


def shapes_of(trace: Sequence[TraceRequest]) -> dict[str, TraceRequest]:
    """The first request of each class: what its solo time is measured with."""
    shapes: dict[str, TraceRequest] = {}
    for r in trace:
        shapes.setdefault(r.cls, r)
    return shapes


# ---------------------------------------------------------------- servers and the run


def deploy_config(name: str, threads: int = 0) -> dict[str, Any]:
    """``stage_configs/tiny-wan.yaml`` with server ``name``'s ``engine_args`` (and ``threads``
    torch threads when not 0)."""
    config = yaml.safe_load(BASE_CONFIG.read_text())
    [stage] = config["stage_args"]
    stage["engine_args"] = dict(SERVERS[name])
    if threads:
        stage["runtime"] = {**stage["runtime"], "torch_threads": threads}
    return config


def check_servers(names: Sequence[str], threads: int) -> None:
    """Every server's config is valid, before any starts: a policy the runtime does not know yet
    (``deadline`` before it lands) fails here, named, not minutes into the run."""
    from omni_runtime.config import parse_config  # lazy: only the run command needs the config types

    for name in names:
        if name not in SERVERS:
            raise SystemExit(f"unknown server {name!r}: choose from {', '.join(SERVERS)}")
        try:
            parse_config(deploy_config(name, threads), source=f"server {name}")
        except ValueError as e:
            raise SystemExit(f"server {name} cannot start: {e}\n(leave it out: --servers ...)") from None


@dataclass
class Run:
    """What ``run`` knows as it goes: the trace (its SLOs filled once the reference is measured)."""

    trace: list[TraceRequest] | None
    args: argparse.Namespace
    reference: dict[str, float] | None = None

    def prepare(self, solo: dict[str, float]) -> list[TraceRequest]:
        """The trace every server replays: generated at ``--load`` x the reference server's
        sequential throughput when no trace was given, its null SLOs filled from ``solo``."""
        if self.reference is None:
            self.reference = solo
            a = self.args
            if self.trace is None:
                rate = a.load * sequential_rps({c.name: c.weight for c in CLASSES}, solo)
                self.trace = generate(a.seed, a.duration, rate, period=a.period)
            self.trace = with_slos(self.trace, solo, a.slo_scale)
            if a.save_trace:
                Path(a.save_trace).write_text(dump_trace(self.trace))
        assert self.trace is not None
        return self.trace

    def shapes(self) -> dict[str, TraceRequest]:
        if self.trace is not None:
            return shapes_of(self.trace)
        return {c.name: c.request(0.0, 1) for c in CLASSES}


async def measure(url: str, run: Run, api_key: str | None = None) -> dict[str, Any]:
    """One server's round: its solo times, then the trace."""
    async with client_for(url, api_key) as client:
        solo = await solo_times(client, run.shapes(), run.args.solo_repeats)
        trace = run.prepare(solo)
        records, wall = await replay(client, trace)
    mix = Counter(r.cls for r in trace)
    result = score(records, wall)
    result["solo_ms"] = solo
    result["sequential_rps"] = sequential_rps(mix, solo)
    result["offered_rps"] = len(trace) / max(trace[-1].t, 1e-9)
    result["records"] = [asdict(r) for r in records]
    return result


def markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    def cell(v: Any) -> str:
        if not isinstance(v, float):
            return str(v)
        if math.isnan(v):
            return "-"  # a latency of a class whose requests were all shed
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


SUMMARY = ["round", "server", "seq_rps", "offered_rps", "offered/seq", "attainment", "goodput_rps", "ok_rps", "shed"]
SUMMARY += ["errors", "mean_batch", "load1"]


def summary_row(rnd: int, name: str, res: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "round": rnd, "server": name, "seq_rps": res["sequential_rps"], "offered_rps": res["offered_rps"],
        "offered/seq": res["offered_rps"] / res["sequential_rps"],
        "attainment": res["attainment"], "goodput_rps": res["goodput_rps"], "ok_rps": res["throughput_rps"],
        "shed": res["shed"], "errors": res["errors"], "mean_batch": res["mean_batch"], "load1": res.get("load1", ""),
    }  # fmt: skip


def class_rows(rnd: int, name: str, res: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {"round": rnd, "server": name, "class": c, "n": v["requests"], "solo_ms": res["solo_ms"][c],
         "attainment": v["attainment"], "p50_ms": v["p50_ms"], "p99_ms": v["p99_ms"], "shed": v["shed"]}
        for c, v in res["classes"].items()
    ]  # fmt: skip


def ratios(results: Sequence[Mapping[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Per server: the medians over rounds, and the median of its per-round ratios to the
    baseline's attainment and goodput in the same round (a noisy round weighs on both)."""
    by = {(r["round"], r["server"]): r["result"] for r in results}
    rows = []
    for name in dict.fromkeys(r["server"] for r in results):
        mine = [(rnd, res) for (rnd, srv), res in by.items() if srv == name]
        pairs = [(res, by[(rnd, baseline)]) for rnd, res in mine if (rnd, baseline) in by]

        def ratio(key: str, pairs: list[Any] = pairs) -> float:
            values = [a[key] / b[key] for a, b in pairs if b[key] > 0]
            return statistics.median(values) if values else float("nan")

        rows.append({
            "server": name,
            "seq_rps": statistics.median(res["sequential_rps"] for _, res in mine),
            "attainment": statistics.median(res["attainment"] for _, res in mine),
            "goodput_rps": statistics.median(res["goodput_rps"] for _, res in mine),
            f"attainment/{baseline}": ratio("attainment"),
            f"goodput/{baseline}": ratio("goodput_rps"),
            "shed": sum(res["shed"] for _, res in mine),
        })  # fmt: skip
    return rows


def report(results: Sequence[Mapping[str, Any]], baseline: str) -> str:
    summary = [summary_row(r["round"], r["server"], {**r["result"], "load1": r["load1"]}) for r in results]
    per_class = [row for r in results for row in class_rows(r["round"], r["server"], r["result"])]
    medians = ratios(results, baseline)
    return "\n\n".join([
        markdown(summary, SUMMARY),
        markdown(per_class, ["round", "server", "class", "n", "solo_ms", "attainment", "p50_ms", "p99_ms", "shed"]),
        markdown(medians, list(medians[0])) if medians else "",
    ])  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    check_servers(names, args.threads)
    state = Run(trace=load_trace(args.trace) if args.trace else None, args=args)
    results: list[dict[str, Any]] = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="slo-bench-") as tmp:
        for rnd in range(args.rounds):
            # Each round starts one server later, so that no server always runs first after a pause.
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                path = Path(tmp) / f"{name.replace('+', '-')}.yaml"
                path.write_text(yaml.safe_dump(deploy_config(name, args.threads), sort_keys=False))
                with Server(str(path)) as server:
                    result = asyncio.run(measure(server.url, state))
                results.append({"round": rnd, "server": name, "load1": os.getloadavg()[0], "result": result})
                r = result
                print(
                    f"round {rnd} {name:14s} attainment {r['attainment']:.2f} goodput {r['goodput_rps']:.2f}/s "
                    f"ok {r['ok']} shed {r['shed']} errors {r['errors']} wall {r['wall_s']:.1f} s "
                    f"({time.monotonic() - began:.0f} s in)",
                    flush=True,
                )
    assert state.trace is not None and state.reference is not None
    print()
    print(report(results, names[0]))
    return {
        "servers": {n: SERVERS[n] for n in names},
        "reference_solo_ms": state.reference,
        "slo_scale": args.slo_scale,
        "trace": [msgspec.to_builtins(r) for r in state.trace],
        "runs": results,
        "seconds": time.monotonic() - began,
    }


def replay_command(args: argparse.Namespace) -> dict[str, Any]:
    state = Run(trace=load_trace(args.trace), args=args)
    result = asyncio.run(measure(args.url, state, args.api_key))
    print(report([{"round": 0, "server": args.url, "load1": os.getloadavg()[0], "result": result}], args.url))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.slo", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("gen", help="write a seeded trace (slo_ms null: filled at replay)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    g.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    g.add_argument("--period", type=float, default=5.0, help="mean seconds of a quiet and a burst period together")
    g.add_argument("--model", default=MODEL)
    g.add_argument("--out", required=True)

    def replaying(s: argparse.ArgumentParser) -> None:
        s.add_argument("--slo-scale", type=float, default=3.0, help="SLO = scale x the class's solo time")
        s.add_argument("--solo-repeats", type=int, default=3, help="requests per class whose median is its solo time")
        s.add_argument("--json", help="write the raw numbers (every request's record) here")

    r = sub.add_parser("run", help="start each server in turn and replay the trace against it, in rounds")
    r.add_argument(
        "--servers", default=",".join(SERVERS), help=f"comma-separated, the first is the baseline: {', '.join(SERVERS)}"
    )
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--trace", help="a trace file (default: generate one at --load)")
    r.add_argument("--seed", type=int, default=0, help="of the generated trace")
    r.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals of the generated trace")
    r.add_argument("--load", type=float, default=1.5, help="generated rate: x the reference's sequential throughput")
    r.add_argument("--period", type=float, default=5.0, help="mean seconds of a quiet and a burst period together")
    r.add_argument("--save-trace", help="write the trace replayed, its SLOs filled, here")
    r.add_argument("--threads", type=int, default=0, help="torch threads of each stage (0: the config's default)")
    replaying(r)

    s = sub.add_parser("replay", help="replay a trace once against a running server")
    s.add_argument("--url", required=True)
    s.add_argument("--api-key")
    s.add_argument("--trace", required=True)
    s.add_argument("--save-trace", help="write the trace replayed, its SLOs filled, here")
    replaying(s)

    args = p.parse_args(argv)
    try:
        if args.command == "gen":
            trace = generate(args.seed, args.duration, args.rate, model=args.model, period=args.period)
            Path(args.out).write_text(dump_trace(trace))
            mix = Counter(t.cls for t in trace)
            print(
                f"{len(trace)} requests over {args.duration:g} s: "
                + ", ".join(f"{k} {v}" for k, v in sorted(mix.items()))
            )
            return
        print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
        data = run(args) if args.command == "run" else replay_command(args)
        print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
        write_json(args.json, data)
    except TraceError as e:
        sys.exit(f"bad trace: {e}")


if __name__ == "__main__":
    main()
