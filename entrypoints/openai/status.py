"""``GET /v1/status``: one JSON snapshot of the server for the dashboard page and for scripts.
Runs on the server's event loop.

Built from what the engine already reports: the stage pools' replica states and nodes
(``health()``), each replica's scheduler counters (the ``get_stats`` control call, answered by the
stage worker's event loop, so a long forward does not hold it), and the server's metrics (latency
of the latest waves and requests, job counters). Waves per second are the change of the wave
counters over the last :data:`RATE_WINDOW_S` seconds of calls, so a page polling every second
sees a live rate and a script calling once sees 0 until its second call.

``GET /v1/status/history``: the last minutes of each model, sampled by the server in the
background (status_history.py), for the dashboard's charts.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from omni_runtime.engine.status import EngineState, ReplicaState

from ..async_omni import AsyncOmni
from ..multi_omni import ModelCounts, ServedModel
from .body import BodyRoute
from .dependencies import AUTH, State
from .responses import SafeJSONResponse
from .state import ServerState
from .status_history import HistoryReport, MultiHistoryReport, StatusHistory

router = APIRouter(prefix="/v1", dependencies=[AUTH], route_class=BodyRoute)

#: Seconds a status call waits for the replicas' counters: a hung replica shows as unanswered.
STATS_TIMEOUT_S = 2.0
#: The span of past calls over which waves per second are measured.
RATE_WINDOW_S = 10.0

_Body = {"kw_only": True, "frozen": True}


class ReplicaReport(msgspec.Struct, **_Body):
    """One replica: its state and node (None before it started), the requests inside it, and its
    scheduler's counters (None when it did not answer ``get_stats`` in time)."""

    replica_id: int
    state: ReplicaState
    node: str | None
    inflight: int
    queue_len: int | None
    running: int | None
    waves: int | None


class StageReport(msgspec.Struct, **_Body):
    """One stage, over its replicas."""

    stage_id: int
    stage_type: str
    replicas: list[ReplicaReport]
    restarts: int
    #: Requests waiting in the stages' schedulers (the replicas that answered).
    queue_depth: int
    #: Requests inside the stage, waiting or running.
    inflight: int
    #: Waves run so far (with step execution: batched denoising steps).
    waves: int
    waves_per_s: float
    #: Wave size -> how many waves had it, over the replicas.
    batch_size_histogram: dict[str, int]
    #: Durations of the stage's latest waves (None before the first).
    wave_p50_ms: float | None
    wave_p99_ms: float | None


class JobsReport(msgspec.Struct, **_Body):
    """The jobs layer: ``active`` (this gateway's running and queued jobs now), ``reached`` (how many
    jobs of this gateway reached each status since it started), ``stored`` (records in the store)."""

    active: dict[str, int]
    reached: dict[str, int]
    stored: int | None


class StatusReport(msgspec.Struct, **_Body):
    """The body of ``GET /v1/status``."""

    model: str
    #: Epoch seconds of the snapshot.
    time: float
    status: EngineState | str
    pending: int
    max_pending: int
    draining: bool
    stages: list[StageReport]
    #: Engine end-to-end latency of the latest finished requests (None before the first).
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    jobs: JobsReport | None
    #: The model's state (loaded, asleep, unloaded, loading, failed, dead, closed), and its cold
    #: loads, wakes from sleep and evictions so far (see the budget in docs/http_api.md).
    state: str = "loaded"
    loads: int = 0
    wakes: int = 0
    evictions: int = 0
    #: Weight bytes its runners reported resident when last loaded (None: none reported).
    resident_bytes: int | None = None


class MultiStatusReport(msgspec.Struct, **_Body):
    """The body of ``GET /v1/status`` when several models are served and none is named."""

    models: list[StatusReport]


def quantile_ms(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of durations in seconds, in milliseconds; None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return round(ordered[rank] * 1000.0, 3)


class WaveRates:
    """Per stage, the (time, waves) samples of the last :data:`RATE_WINDOW_S` seconds of calls."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[float, int]]] = {}

    def rate(self, stage_id: int, now: float, waves: int) -> float:
        samples = self._samples.setdefault(stage_id, deque())
        samples.append((now, waves))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        then, before = samples[0]
        if now <= then or waves < before:  # the first call, or a replica restarted (counters reset)
            return 0.0
        return round((waves - before) / (now - then), 3)


def _rates(request: Request, model: str) -> WaveRates:
    by_model: dict[str, WaveRates] | None = getattr(request.app.state, "wave_rates", None)
    if by_model is None:
        by_model = request.app.state.wave_rates = {}
    return by_model.setdefault(model, WaveRates())


async def _replica_stats(engine: AsyncOmni) -> dict[tuple[int, int], dict[str, Any]]:
    results = await engine.collective_rpc("get_stats", timeout=STATS_TIMEOUT_S)
    return {(r.stage_id, r.replica_id): r.result for r in results if r.ok and isinstance(r.result, dict)}


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def build_status(state: ServerState, model: ServedModel, rates: WaveRates) -> StatusReport:
    """The report of ``model``."""
    counts = ModelCounts(
        state=model.state,
        loads=model.loads,
        wakes=model.wakes,
        evictions=model.evictions,
        resident_bytes=model.resident_bytes,
    )
    if state.several and (model.engine is None or model.state != "loaded"):
        # Not serving now (evicted, loading, failed): its state, without asking its replicas.
        health = model.health()
        return StatusReport(
            model=model.name, time=round(time.time(), 3), status=model.state,
            pending=health.pending if health is not None else 0,
            max_pending=health.max_pending if health is not None else 0,
            draining=state.draining, stages=[], e2e_p50_ms=None, e2e_p99_ms=None, jobs=None,
            **msgspec.structs.asdict(counts),
        )  # fmt: skip
    engine = state.engine_of(model)
    h = engine.health()
    stats = await _replica_stats(engine)
    now = time.time()
    stages: list[StageReport] = []
    for s in h.stages:
        replicas: list[ReplicaReport] = []
        histogram: dict[str, int] = {}
        waves = 0
        for rid, replica_state in enumerate(s.replica_states):
            st = stats.get((s.stage_id, rid), {})
            # Step execution counts batched steps; request batching counts fused forwards.
            replica_waves = _int(st.get("steps")) if st.get("step_execution") else _int(st.get("waves"))
            for size, count in (st.get("batch_size_histogram") or {}).items():
                histogram[str(size)] = histogram.get(str(size), 0) + int(count)
            waves += replica_waves or 0
            replicas.append(
                ReplicaReport(
                    replica_id=rid,
                    state=replica_state,
                    node=s.replica_nodes[rid] if rid < len(s.replica_nodes) else None,
                    inflight=s.per_replica_inflight[rid] if rid < len(s.per_replica_inflight) else 0,
                    queue_len=_int(st.get("queue_len")),
                    running=_int(st.get("running")),
                    waves=replica_waves,
                )
            )
        recent = state.metrics.recent_waves.get((model.name, s.stage_id), ())
        stages.append(
            StageReport(
                stage_id=s.stage_id,
                stage_type=s.stage_type,
                replicas=replicas,
                restarts=s.restarts,
                queue_depth=sum(r.queue_len or 0 for r in replicas),
                inflight=s.inflight,
                waves=waves,
                waves_per_s=rates.rate(s.stage_id, time.monotonic(), waves),
                batch_size_histogram=dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
                wave_p50_ms=quantile_ms(recent, 0.5),
                wave_p99_ms=quantile_ms(recent, 0.99),
            )
        )
    jobs = None
    if state.jobs is not None:
        jobs = JobsReport(
            active=state.jobs.active(), reached=state.metrics.job_counts(), stored=state.jobs.store.count()
        )
    return StatusReport(
        model=model.name,
        time=round(now, 3),
        status=h.status,
        pending=h.pending,
        max_pending=h.max_pending,
        draining=state.draining,
        stages=stages,
        e2e_p50_ms=quantile_ms(state.metrics.recent_e2e.get(model.name, ()), 0.5),
        e2e_p99_ms=quantile_ms(state.metrics.recent_e2e.get(model.name, ()), 0.99),
        jobs=jobs,
        **msgspec.structs.asdict(counts),
    )


@router.get("/status")
async def status(request: Request, state: State, model: str | None = None) -> JSONResponse:
    """One model's report (``?model=NAME``, or the only one); with several models served and
    none named, every model's (``{"models": [...]}``)."""
    report: StatusReport | MultiStatusReport
    if model is not None or not state.several:
        served = state.model(model)
        report = await build_status(state, served, _rates(request, served.name))
    else:
        served_models = list(state.multi.models.values())
        reports = [await build_status(state, m, _rates(request, m.name)) for m in served_models]
        report = MultiStatusReport(models=reports)
    return SafeJSONResponse(msgspec.to_builtins(report), headers={"Cache-Control": "no-store"})


@router.get("/status/history")
async def status_history(
    request: Request,
    state: State,
    model: str | None = None,
    since: float | None = Query(
        None, description="only the samples taken after this time (epoch seconds)", allow_inf_nan=False
    ),
) -> JSONResponse:
    """One model's samples (``?model=NAME``, or the only one), oldest first; with several models
    served and none named, every model's (``{"models": [...]}``)."""
    history: StatusHistory = request.app.state.history
    report: HistoryReport | MultiHistoryReport
    if model is not None or not state.several:
        report = history.report(state.model(model).name, since)
    else:
        report = MultiHistoryReport(models=[history.report(name, since) for name in state.multi.models])
    return SafeJSONResponse(msgspec.to_builtins(report), headers={"Cache-Control": "no-store"})
