"""The control route: ``POST /v1/omni/collective_rpc`` calls a method on every replica of the
chosen stages and answers each one's result or error."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from . import protocol as proto
from .dependencies import AUTH, JSON_BODY, State
from .responses import SafeJSONResponse

router = APIRouter(prefix="/v1/omni", dependencies=[AUTH])

#: Seconds a call waits for its replicas when the request names no timeout: a hung replica
#: cannot hold an HTTP request forever.
DEFAULT_TIMEOUT_S = 30.0


@router.post("/collective_rpc", dependencies=[JSON_BODY])
async def collective_rpc(body: proto.CollectiveRpcRequest, state: State) -> JSONResponse:
    omni = state.check_request(None)
    timeout = body.timeout if body.timeout is not None else DEFAULT_TIMEOUT_S
    results = await omni.collective_rpc(body.method, body.args, body.kwargs, body.stage_ids, timeout)
    out = [
        proto.ReplicaResult(
            stage_id=r.stage_id,
            replica_id=r.replica_id,
            ok=r.ok,
            result=msgspec.to_builtins(r.result, enc_hook=repr),
            error=r.error,
        ).model_dump()
        for r in results
    ]
    return SafeJSONResponse(out)
