"""The probes and the model list: ``/health`` and ``/readyz`` (open, so that orchestrators need no
key; ``/readyz`` says only its verdict without it), ``/metrics`` (Prometheus), and
``/v1/models`` (behind the key like every /v1 route)."""

from __future__ import annotations

import socket
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from . import protocol as proto
from .dependencies import AUTH, State
from .metrics import CONTENT_TYPE
from .responses import SafeJSONResponse
from .state import ServerState

router = APIRouter()

_HOSTNAME = socket.gethostname()  # the node name of this machine's own replicas

_READYZ_FIELDS = (
    "stage_id",
    "stage_type",
    "replicas",
    "live_replicas",
    "replica_states",
    "replica_nodes",
    "restarts",
    "unresponsive_kills",
    "inflight",
)


@router.get("/health")
async def health(state: State) -> JSONResponse:
    if state.omni is None:
        if state.failed is not None:
            return SafeJSONResponse({"status": "failed", "reason": str(state.failed)}, status_code=503)
        return SafeJSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    h = state.started.health()
    if h.ok:
        return SafeJSONResponse({"status": "ok"})
    if h.status == "dead":
        return SafeJSONResponse({"status": "dead", "reason": h.reason}, status_code=503)
    return SafeJSONResponse({"status": "unhealthy", "dead_stages": h.dead_stages}, status_code=503)


@router.get("/readyz")
async def readyz(request: Request, state: State) -> JSONResponse:
    h = state.started.health()
    if not state.authorized(request.scope):
        # Open to orchestrators without the key, but only the verdict: the stages, hosts,
        # queues and gateway id are for whoever holds it.
        ready = h.ok and not state.draining
        body: dict[str, Any] = {"ready": ready, "draining": state.draining}
        return SafeJSONResponse(body, status_code=200 if ready else 503)
    stages = [
        {k: s.get(k) for k in _READYZ_FIELDS}
        | {"queue_depth": s.get("inflight", 0), "per_replica_inflight": s.get("per_replica_inflight", [])}
        for s in h.stages
    ]
    job_store = await _job_store_status(state)
    ready = h.ok and not state.draining and job_store.get("ok", True)
    body = {
        "ready": ready,
        "dead": h.reason if h.status == "dead" else None,
        "draining": state.draining,
        "model": state.model_name,
        "pending": h.pending,
        "max_pending": h.max_pending,
        "stages": stages,
        # Live replicas that are not this machine's processes (Ray actors, by node id).
        "remote_replicas": sum(
            1
            for s in h.stages
            for node, st in zip(s.get("replica_nodes", []), s.get("replica_states", []), strict=False)
            if node is not None and node != _HOSTNAME and st == "live"
        ),
        "job_store": job_store,
    }
    return SafeJSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models", dependencies=[AUTH])
async def list_models(state: State) -> JSONResponse:
    card = proto.ModelCard(id=state.model_name, created=state.created)
    return SafeJSONResponse(proto.ModelList(data=[card]).model_dump())


@router.get("/v1/models/{model_id:path}", dependencies=[AUTH])
async def get_model(model_id: str, state: State) -> JSONResponse:
    state.check_request(model_id)
    return SafeJSONResponse(proto.ModelCard(id=state.model_name, created=state.created).model_dump())


async def _job_store_status(state: ServerState) -> dict[str, Any]:
    if state.jobs is None:
        return {"backend": None, "ok": False}
    store = state.jobs.store
    return {"backend": store.backend, "ok": await store.ping(), "jobs": store.count(), "gateway": state.jobs.gateway_id}
