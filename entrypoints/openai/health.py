"""The probes and the model list: ``/health`` and ``/readyz`` (open, so that orchestrators need no
key; ``/readyz`` says only its verdict without it), ``/metrics`` (Prometheus), and
``/v1/models`` (behind the key like every /v1 route)."""

from __future__ import annotations

import socket
from typing import Literal

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_runtime.engine.status import EngineHealth, ReplicaState, StageStatus

from ..multi_omni import ServedModel
from . import protocol as proto
from .body import BodyRoute
from .dependencies import AUTH, State
from .metrics import CONTENT_TYPE
from .responses import SafeJSONResponse
from .state import ServerState

router = APIRouter(route_class=BodyRoute)

_HOSTNAME = socket.gethostname()  # the node name of this machine's own replicas

_Body = {"kw_only": True, "frozen": True}


class HealthReport(msgspec.Struct, **_Body):
    """The body of ``/health``: ``status``, and ``reason`` (failed, dead) or ``dead_stages``
    (unhealthy) where it has them; an unset field is left out of the JSON. With several models,
    ``models`` holds each one's report, and ``status`` is ``degraded`` while some serve and
    others do not."""

    status: Literal["loading", "failed", "ok", "dead", "unhealthy", "degraded"]
    reason: str | msgspec.UnsetType | None = msgspec.UNSET
    dead_stages: list[int] | msgspec.UnsetType = msgspec.UNSET
    models: dict[str, HealthReport] | msgspec.UnsetType = msgspec.UNSET


class ReadyVerdict(msgspec.Struct, **_Body):
    """The body of ``/readyz`` without the key: the verdict only."""

    ready: bool
    draining: bool


class ReadyStage(msgspec.Struct, **_Body):
    """One stage in ``/readyz``: its :class:`StageStatus`, with ``queue_depth`` (its inflight)."""

    stage_id: int
    stage_type: str
    replicas: int
    live_replicas: int
    replica_states: list[ReplicaState]
    replica_nodes: list[str | None]
    restarts: int
    unresponsive_kills: int
    inflight: int
    queue_depth: int
    per_replica_inflight: list[int]

    @classmethod
    def of(cls, s: StageStatus) -> ReadyStage:
        return cls(
            stage_id=s.stage_id,
            stage_type=s.stage_type,
            replicas=s.replicas,
            live_replicas=s.live_replicas,
            replica_states=s.replica_states,
            replica_nodes=s.replica_nodes,
            restarts=s.restarts,
            unresponsive_kills=s.unresponsive_kills,
            inflight=s.inflight,
            queue_depth=s.inflight,
            per_replica_inflight=s.per_replica_inflight,
        )


class JobStoreStatus(msgspec.Struct, **_Body):
    """The job store in ``/readyz``: its backend (None: no jobs layer) and whether it answers;
    with a store, how many jobs it holds and this gateway's id."""

    backend: str | None
    ok: bool
    jobs: int | msgspec.UnsetType | None = msgspec.UNSET
    gateway: str | msgspec.UnsetType | None = msgspec.UNSET


class ModelReadiness(msgspec.Struct, **_Body):
    """One model in ``/readyz`` when several are served: its state (loading, loaded, failed,
    dead), why it failed or died, and, once loaded, its admission and stages."""

    ready: bool
    state: str
    error: str | None
    pending: int
    max_pending: int
    stages: list[ReadyStage]


class MultiReadyReport(msgspec.Struct, **_Body):
    """The body of ``/readyz`` with the key when several models are served: ready once no model
    is loading and at least one serves (a model that failed fails only its own requests)."""

    ready: bool
    draining: bool
    models: dict[str, ModelReadiness]
    remote_replicas: int
    job_store: JobStoreStatus


class ReadyReport(msgspec.Struct, **_Body):
    """The body of ``/readyz`` with the key."""

    ready: bool
    #: Why the engine is dead, or None.
    dead: str | None
    draining: bool
    model: str
    pending: int
    max_pending: int
    stages: list[ReadyStage]
    #: Live replicas that are not this machine's processes (Ray actors, by node id).
    remote_replicas: int
    job_store: JobStoreStatus


def _json(body: msgspec.Struct, status_code: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return SafeJSONResponse(msgspec.to_builtins(body), status_code=status_code, headers=headers)


def _on_demand(model: ServedModel) -> bool:
    """Whether a request for it brings it back: lazy and not loaded yet, evicted, or coming back."""
    return model.state in ("unloaded", "asleep") or (model.state == "loading" and not model.starting)


def _model_health(model: ServedModel) -> HealthReport:
    h = model.health()
    if _on_demand(model):
        return HealthReport(status="ok")
    if h is None:
        if model.state == "failed":
            return HealthReport(status="failed", reason=str(model.error))
        return HealthReport(status="loading")
    if h.ok:
        return HealthReport(status="ok")
    if h.status == "dead":
        return HealthReport(status="dead", reason=h.reason)
    return HealthReport(status="unhealthy", reason=model.unplaced() or msgspec.UNSET, dead_stages=h.dead_stages)


def _several_health(state: ServerState) -> JSONResponse:
    """200 while any model serves (``ok`` when all do, else ``degraded``); 503 when none does:
    ``loading`` while one still loads, else ``failed`` or ``dead``."""
    models = {name: _model_health(m) for name, m in state.multi.models.items()}
    statuses = {r.status for r in models.values()}
    if statuses == {"ok"}:
        return _json(HealthReport(status="ok", models=models))
    if "ok" in statuses:
        return _json(HealthReport(status="degraded", models=models))
    status = "loading" if "loading" in statuses else "dead" if "dead" in statuses else "failed"
    headers = {"Retry-After": "1"} if status == "loading" else None
    return _json(HealthReport(status=status, models=models), 503, headers=headers)  # type: ignore[arg-type]


def _several_ready(state: ServerState, job_store: JobStoreStatus) -> JSONResponse:
    models: dict[str, ModelReadiness] = {}
    remote = 0
    for name, m in state.multi.models.items():
        h = m.health()
        models[name] = ModelReadiness(
            ready=(h is not None and h.ok and m.state == "loaded") or _on_demand(m),
            state=m.status(),
            error=str(m.error) if m.error is not None else m.unplaced(),
            pending=h.pending if h is not None else 0,
            max_pending=h.max_pending if h is not None else 0,
            stages=[ReadyStage.of(s) for s in h.stages] if h is not None else [],
        )
        remote += _remote_replicas(h) if h is not None else 0
    starting = any(m.starting for m in state.multi.models.values())
    serving = any(r.ready for r in models.values()) and not starting
    ready = serving and not state.draining and job_store.ok
    body = MultiReadyReport(
        ready=ready, draining=state.draining, models=models, remote_replicas=remote, job_store=job_store
    )
    return _json(body, 200 if ready else 503)


def _several_verdict(state: ServerState) -> bool:
    models = list(state.multi.models.values())
    loading = any(m.starting for m in models)
    serving = any((m.state == "loaded" and (h := m.health()) is not None and h.ok) or _on_demand(m) for m in models)
    return serving and not loading and not state.draining


def _remote_replicas(h: EngineHealth) -> int:
    return sum(
        1
        for s in h.stages
        for node, st in zip(s.replica_nodes, s.replica_states, strict=False)
        if node is not None and node != _HOSTNAME and st == "live"
    )


@router.get("/health")
async def health(state: State) -> JSONResponse:
    if state.several:
        return _several_health(state)
    model = state.only
    if model.engine is None:
        if state.failed is not None:
            return _json(HealthReport(status="failed", reason=str(state.failed)), 503)
        return _json(HealthReport(status="loading"), 503, headers={"Retry-After": "1"})
    h = model.engine.health()
    if h.ok:
        return _json(HealthReport(status="ok"))
    if h.status == "dead":
        return _json(HealthReport(status="dead", reason=h.reason), 503)
    return _json(HealthReport(status="unhealthy", dead_stages=h.dead_stages), 503)


@router.get("/readyz")
async def readyz(request: Request, state: State) -> JSONResponse:
    if state.several:
        if not state.authorized(request.scope):
            verdict = _several_verdict(state)
            return _json(ReadyVerdict(ready=verdict, draining=state.draining), 200 if verdict else 503)
        return _several_ready(state, await _job_store_status(state))
    model = state.only
    h = state.engine_of(model).health()
    if not state.authorized(request.scope):
        # Open to orchestrators without the key, but only the verdict: the stages, hosts,
        # queues and gateway id are for whoever holds it.
        verdict = h.ok and not state.draining
        return _json(ReadyVerdict(ready=verdict, draining=state.draining), 200 if verdict else 503)
    job_store = await _job_store_status(state)
    ready = h.ok and not state.draining and job_store.ok
    body = ReadyReport(
        ready=ready,
        dead=h.reason if h.status == "dead" else None,
        draining=state.draining,
        model=model.name,
        pending=h.pending,
        max_pending=h.max_pending,
        stages=[ReadyStage.of(s) for s in h.stages],
        remote_replicas=_remote_replicas(h),
        job_store=job_store,
    )
    return _json(body, 200 if ready else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models", dependencies=[AUTH])
async def list_models(state: State) -> JSONResponse:
    cards = [_card(state, m) for m in state.multi.models.values()]
    return SafeJSONResponse(proto.ModelList(data=cards).model_dump())


@router.get("/v1/models/{model_id:path}", dependencies=[AUTH])
async def get_model(model_id: str, state: State) -> JSONResponse:
    model = state.model(model_id)
    if not state.several:  # one model: its card once it serves (503 while loading or failed)
        state.engine_of(model)
    return SafeJSONResponse(_card(state, model).model_dump())


def _card(state: ServerState, model: ServedModel) -> proto.ModelCard:
    caps = model.capabilities
    return proto.ModelCard(
        id=model.name,
        created=state.created,
        kinds=list(caps.kinds),
        tasks=caps.generate_tasks(),
        serves=list(caps.tasks),
        voices=list(caps.voices),
        audio_input=caps.audio_input,
        state=model.status(),
    )


async def _job_store_status(state: ServerState) -> JobStoreStatus:
    if state.jobs is None:
        return JobStoreStatus(backend=None, ok=False)
    store = state.jobs.store
    return JobStoreStatus(
        backend=store.backend, ok=await store.ping(), jobs=store.count(), gateway=state.jobs.gateway_id
    )
