"""The probes and the model list: ``/health`` and ``/readyz`` (open, so that orchestrators need no
key; ``/readyz`` says only its verdict without it), ``/metrics`` (Prometheus), and
``/v1/models`` (behind the key like every /v1 route)."""

from __future__ import annotations

import socket
from typing import Literal

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_runtime.engine.status import ReplicaState, StageStatus
from omni_runtime.params import SpeechSamplingParams

from . import protocol as proto
from .dependencies import AUTH, State
from .metrics import CONTENT_TYPE
from .responses import SafeJSONResponse
from .state import ServerState

router = APIRouter()

_HOSTNAME = socket.gethostname()  # the node name of this machine's own replicas

_Body = {"kw_only": True, "frozen": True}


class HealthReport(msgspec.Struct, **_Body):
    """The body of ``/health``: ``status``, and ``reason`` (failed, dead) or ``dead_stages``
    (unhealthy) where it has them; an unset field is left out of the JSON."""

    status: Literal["loading", "failed", "ok", "dead", "unhealthy"]
    reason: str | msgspec.UnsetType | None = msgspec.UNSET
    dead_stages: list[int] | msgspec.UnsetType = msgspec.UNSET


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


@router.get("/health")
async def health(state: State) -> JSONResponse:
    if state.omni is None:
        if state.failed is not None:
            return _json(HealthReport(status="failed", reason=str(state.failed)), 503)
        return _json(HealthReport(status="loading"), 503, headers={"Retry-After": "1"})
    h = state.started.health()
    if h.ok:
        return _json(HealthReport(status="ok"))
    if h.status == "dead":
        return _json(HealthReport(status="dead", reason=h.reason), 503)
    return _json(HealthReport(status="unhealthy", dead_stages=h.dead_stages), 503)


@router.get("/readyz")
async def readyz(request: Request, state: State) -> JSONResponse:
    h = state.started.health()
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
        model=state.model_name,
        pending=h.pending,
        max_pending=h.max_pending,
        stages=[ReadyStage.of(s) for s in h.stages],
        remote_replicas=sum(
            1
            for s in h.stages
            for node, st in zip(s.replica_nodes, s.replica_states, strict=False)
            if node is not None and node != _HOSTNAME and st == "live"
        ),
        job_store=job_store,
    )
    return _json(body, 200 if ready else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models", dependencies=[AUTH])
async def list_models(state: State) -> JSONResponse:
    card = proto.ModelCard(id=state.model_name, created=state.created, kinds=_kinds(state), tasks=_tasks(state))
    return SafeJSONResponse(proto.ModelList(data=[card]).model_dump())


@router.get("/v1/models/{model_id:path}", dependencies=[AUTH])
async def get_model(model_id: str, state: State) -> JSONResponse:
    state.check_request(model_id)
    card = proto.ModelCard(id=state.model_name, created=state.created, kinds=_kinds(state), tasks=_tasks(state))
    return SafeJSONResponse(card.model_dump())


def _kinds(state: ServerState) -> list[str]:
    return sorted({s.final_output_type for s in state.config.stage_args if s.final_output and s.final_output_type})


def _tasks(state: ServerState) -> list[str]:
    """The ``/v1/generate`` tasks the model serves, by its final stages' outputs (image to video
    where the video stage's model has that form: a 400 naming it otherwise)."""
    tasks = []
    if state.image_stage is not None:
        tasks.append("text2image")
    if state.video_stage is not None:
        tasks += ["text2video", "image2video"]
    if state.audio_stage is not None:
        stage = state.resolved.stage(state.audio_stage)
        tasks.append("text2speech" if issubclass(stage.params_cls, SpeechSamplingParams) else "text2audio")
    return tasks


async def _job_store_status(state: ServerState) -> JobStoreStatus:
    if state.jobs is None:
        return JobStoreStatus(backend=None, ok=False)
    store = state.jobs.store
    return JobStoreStatus(
        backend=store.backend, ok=await store.ping(), jobs=store.count(), gateway=state.jobs.gateway_id
    )
