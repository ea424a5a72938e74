"""The job routes: ``POST /v1/generate`` and ``/v1/jobs/{id}`` (state, cancel, events as SSE or a
WebSocket, trace). Runs on the server's event loop; the work is :class:`JobManager`'s.

``GET /v1/jobs/{id}/events`` is resumable: each event's SSE ``id`` is its id in the job store, and
a client that reconnects with ``Last-Event-ID`` gets the events after it, none twice, from any
gateway on the same store. The WebSocket sends the same events as JSON messages and takes
``{"type": "cancel"}``.

Every client that waits on events (SSE, WebSocket, ``async_run: false``) takes one of the
gateway's ``--job-streams`` slots for as long as it waits; when none is left it gets a 503 with
``Retry-After`` before anything starts. A store that becomes unreachable mid-stream ends an SSE
stream with an ``error`` event (no id: a reconnect resumes after the last real event) and a
WebSocket with an error message, never a cut body.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from omni_runtime.exceptions import InvalidRequestError, UnavailableError

from ..jobs.store import Event, JobStoreUnavailableError
from ..tasks.render import result_files
from .body import BodyRoute
from .dependencies import AUTH, JSON_BODY, AnyModel, Jobs, State, get_jobs, websocket_subprotocol
from .protocol import ApiError, ClientDisconnected, GenerateRequest, error_body
from .responses import SafeJSONResponse

#: Seconds without an event after which an SSE stream sends a keep-alive comment.
KEEPALIVE_S = 15.0
#: Largest WebSocket message a client may send (it only ever sends ``{"type": "cancel"}``).
MAX_WS_MESSAGE = 4096


def _sse(event: Event) -> str:
    return f"id: {event.id}\nevent: {event.type}\ndata: {json.dumps(event.data, separators=(',', ':'))}\n\n"


def _sse_error(exc: BaseException) -> str:
    """The last frame of a stream whose store went away: no id, and a reconnect delay."""
    _, body = error_body(exc)
    return f"retry: 2000\nevent: error\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


router = APIRouter(prefix="/v1", dependencies=[AUTH], route_class=BodyRoute)


@router.post("/generate", dependencies=[JSON_BODY])
async def generate(body: GenerateRequest, request: Request, state: State, model: AnyModel) -> JSONResponse:
    manager = get_jobs(state)
    base_url = state.public_url or str(request.base_url).rstrip("/")
    traceparent = request.headers.get("traceparent")
    if traceparent is not None and len(traceparent) > 128:
        traceparent = None
    if body.async_run:
        job = await manager.submit(body, base_url, model, traceparent)
        headers = {"X-Request-Id": job["job_id"], "Location": f"/v1/jobs/{job['job_id']}"}
        return SafeJSONResponse(job, status_code=202, headers=headers)
    # The synchronous form: the same job, once it ended. A client that goes away cancels it.
    # Its wait takes a stream slot, before the job exists: no slot, no job (503).
    slot = manager.stream_slot()
    try:
        job = await manager.submit(body, base_url, model, traceparent)
        job_id = job["job_id"]
        headers = {"X-Request-Id": job_id, "Location": f"/v1/jobs/{job_id}"}
        try:
            await state.until_disconnect(request, [], _until_done(manager, job_id))
            done = await manager.get(job_id)
            error = done.get("error") or {}
            if done.get("status") == "failed" and error.get("status") in (429, 503):
                # Refused by a stage after admission (a request shed for its latency target, a
                # replica's full queue): the synchronous answer says so as the other routes do.
                headers["Retry-After"] = str(max(1, round(error.get("retry_after_s", 1.0))))
                return SafeJSONResponse(done, status_code=error["status"], headers=headers)
            return SafeJSONResponse(done, headers=headers)
        except ClientDisconnected:
            await manager.cancel(job_id)
            raise
        except UnavailableError as e:
            # The store went away during the wait: the job goes on and is recorded when the
            # store is back; the client gets its id to poll it then.
            status, error = error_body(e)
            error["error"]["job_id"] = job_id
            headers["Retry-After"] = str(max(1, round(e.retry_after_s)))
            return SafeJSONResponse(error, status_code=status, headers=headers)
    finally:
        slot.release()


@router.post("/jobs")
async def post_jobs() -> JSONResponse:
    raise ApiError(
        405, "jobs are created with POST /v1/generate; /v1/jobs/{id} reads, streams and cancels them",
        type="invalid_request_error", code="method_not_allowed",
    )  # fmt: skip


@router.get("/jobs/{job_id}")
async def get_job(job_id: str, manager: Jobs) -> JSONResponse:
    return SafeJSONResponse(await manager.get(job_id))


@router.delete("/jobs/{job_id}")
async def cancel_job(job_id: str, manager: Jobs) -> JSONResponse:
    return SafeJSONResponse(await manager.cancel(job_id))


@router.get("/jobs/{job_id}/trace")
async def get_trace(job_id: str, manager: Jobs) -> JSONResponse:
    record = await manager.get_record(job_id)
    body = {"job_id": job_id, "status": record.status, "trace_id": record.trace_id, "spans": record.trace or []}
    return SafeJSONResponse(body)


@router.get("/jobs/{job_id}/content")
async def job_content(job_id: str, state: State, manager: Jobs, index: int = Query(0, ge=0, le=1024)) -> Response:
    """The bytes of the job's ``index``-th file (its first image, video or clip), with the media
    type its encoder declares: from the file store (``url`` results) or the result itself
    (``b64_json``). 409 while the job has no result, 404 past its files or once they expired."""
    record = await manager.get_record(job_id)
    result = record.result if record.status == "completed" else None
    if not isinstance(result, dict):
        raise ApiError(
            409, f"job `{job_id}` is {record.status}, not completed: it has no content",
            param="job_id", code="job_not_completed",
        )  # fmt: skip
    renderer, files = result_files(result)
    if index >= len(files):
        raise ApiError(404, f"job `{job_id}` has {len(files)} files; no index {index}", param="index", code="not_found")
    item = files[index]
    if "b64_json" in item and renderer is not None:
        media_type = renderer.media_type(str(result.get("output_format")))
        return Response(base64.b64decode(item["b64_json"]), media_type=media_type)
    file_id = item.get("file_id") or str(item.get("url", "")).rsplit("/", 1)[-1]
    found = await state.files.get(file_id)
    if found is None:
        raise ApiError(404, f"the content of job `{job_id}` has expired", param="job_id", code="not_found")
    media_type, data, left = found
    return Response(data, media_type=media_type, headers={"Cache-Control": f"private, max-age={int(left)}"})


@router.get("/jobs/{job_id}/events")
async def job_events(job_id: str, request: Request, manager: Jobs) -> StreamingResponse:
    await manager.get_record(job_id)  # 404 before the stream starts
    after = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if after is not None:
        after = manager.store.check_event_id(after.strip())
    slot = manager.stream_slot()

    async def stream() -> AsyncIterator[str]:
        try:
            async for event in manager.follow(job_id, after, keepalive_s=KEEPALIVE_S):
                yield ": keep-alive\n\n" if event is None else _sse(event)
        except JobStoreUnavailableError as e:
            yield _sse_error(e)
        finally:
            slot.release()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    # The slot is also released after the response, should the stream never have started.
    return StreamingResponse(
        stream(), media_type="text/event-stream", headers=headers, background=BackgroundTask(slot.release)
    )


@router.websocket("/jobs/{job_id}/stream")
async def job_stream(websocket: WebSocket, job_id: str, state: State) -> None:
    # The key was checked by the router's AUTH dependency, before accepting (a refusal is an
    # error message and close code 4401: see refuse_websocket).
    try:
        manager = get_jobs(state)
        await manager.get_record(job_id)
        after = websocket.query_params.get("last_event_id")
        if after is not None:
            after = manager.store.check_event_id(after)
        slot = manager.stream_slot()
    except (ApiError, InvalidRequestError, UnavailableError) as e:
        await refuse_websocket(websocket, e)
        return
    await websocket.accept()
    sender = asyncio.create_task(_send_events(websocket, manager, job_id, after))
    try:
        while not sender.done():
            receiver = asyncio.ensure_future(websocket.receive())
            await asyncio.wait((receiver, sender), return_when=asyncio.FIRST_COMPLETED)
            if not receiver.done():
                receiver.cancel()
                with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect):
                    await receiver
                break
            message = receiver.result()
            if message["type"] == "websocket.disconnect":
                break
            if _is_cancel(message.get("text")):
                await manager.cancel(job_id)
            else:
                error = {"message": 'the only message taken is {"type": "cancel"}', "code": "invalid_value"}
                await websocket.send_json({"type": "error", "error": error})
    except (WebSocketDisconnect, RuntimeError):
        pass  # the client went away: the job goes on (DELETE or a cancel message stop it)
    finally:
        slot.release()
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender
    with contextlib.suppress(Exception):
        await websocket.close()


async def refuse_websocket(websocket: WebSocket, exc: BaseException) -> None:
    """Refuse a WebSocket before it starts: the error as one JSON message, then close code
    4000 + the HTTP status (4401 without the key, 4404 for an unknown job)."""
    status, body = error_body(exc)
    await websocket.accept(subprotocol=websocket_subprotocol(websocket))
    await websocket.send_json(body | {"type": "error"})
    await websocket.close(code=4000 + status)


async def _until_done(manager: Any, job_id: str) -> None:
    async for _ in manager.follow(job_id, None, keepalive_s=KEEPALIVE_S):
        pass


async def _send_events(websocket: WebSocket, manager: Any, job_id: str, after: str | None) -> None:
    try:
        async for event in manager.follow(job_id, after, keepalive_s=KEEPALIVE_S):
            if event is not None:
                await websocket.send_json(event.to_json())
    except JobStoreUnavailableError as e:
        await websocket.send_json(error_body(e)[1] | {"type": "error"})


def _is_cancel(text: str | None) -> bool:
    if text is None or len(text) > MAX_WS_MESSAGE:
        return False
    try:
        message = json.loads(text)
    except ValueError:
        return False
    return isinstance(message, dict) and message.get("type") == "cancel"
