"""The control route: ``POST /v1/omni/collective_rpc`` calls a method on every replica of the
chosen stages and answers each one's result or error. With several models served, the body's
``model`` picks one; without it the call goes to every loaded model and each result names its
model."""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omni_runtime.messages import RpcReplicaResult

from ..async_omni import AsyncOmni
from . import protocol as proto
from .body import BodyRoute
from .dependencies import AUTH, JSON_BODY, State
from .responses import SafeJSONResponse
from .state import LEASES, MODEL

router = APIRouter(prefix="/v1/omni", dependencies=[AUTH], route_class=BodyRoute)

#: Seconds a call waits for its replicas when the request names no timeout: a hung replica
#: cannot hold an HTTP request forever.
DEFAULT_TIMEOUT_S = 30.0


@router.post("/collective_rpc", dependencies=[JSON_BODY])
async def collective_rpc(body: proto.CollectiveRpcRequest, request: Request, state: State) -> JSONResponse:
    timeout = body.timeout if body.timeout is not None else DEFAULT_TIMEOUT_S
    targets: list[tuple[str | None, AsyncOmni]]
    state.check_draining()
    if body.model is not None or not state.several:
        served = state.model(body.model)
        request.scope[MODEL] = served.name
        model = await state.serve(served, request.scope.get(LEASES))
        targets = [(model.name if state.several else None, model.engine)]
    else:
        # Every loaded model, not those evicted or loading: a control call brings none back.
        targets = [(m.name, m.engine) for m in state.multi.models.values() if m.state == "loaded" and m.engine]

    async def call(engine: AsyncOmni) -> list[RpcReplicaResult]:
        return await engine.collective_rpc(body.method, body.args, body.kwargs, body.stage_ids, timeout)

    answers = await asyncio.gather(*(call(engine) for _, engine in targets))
    out = [
        proto.ReplicaResult(
            model=name,
            stage_id=r.stage_id,
            replica_id=r.replica_id,
            ok=r.ok,
            result=msgspec.to_builtins(r.result, enc_hook=repr),
            error=r.error,
        ).model_dump(exclude={"model"} if name is None else None)
        for (name, _), results in zip(targets, answers, strict=True)
        for r in results
    ]
    return SafeJSONResponse(out)
