"""The checks a route declares with ``Depends``: the API key and the body's content type, the
shared state a route reads (:data:`State`), and the model a request runs on (:func:`model_for`:
resolved once per request from what it names, and checked to serve the route's task).

A router declares :data:`AUTH` for all its routes and a POST route declares one of
:data:`JSON_BODY`, :data:`MULTIPART_BODY` or :data:`JSON_OR_MULTIPART_BODY`;
``tests/entrypoints/openai/test_routes.py`` walks ``app.routes`` and fails for a route that
forgets one. The HTTP middleware runs the :data:`GUARDS` a matched route declares
before its body is read (so an unauthorized client's body is never parsed, and a 401 comes before
a 413 and a 415), and they run again as the route's dependencies."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import HTTPConnection, Request
from starlette.websockets import WebSocket

from ..tasks import TaskName
from ..tasks.inputs import require
from .body import requested_model
from .job_manager import JobManager
from .protocol import ApiError
from .realtime_session import SessionModel
from .state import LEASES, MODEL, ModelHandle, ServerState, get_state

#: The shared state, as a handler parameter: ``state: State``.
State = Annotated[ServerState, Depends(get_state)]


def require_api_key(conn: HTTPConnection) -> None:
    """A 401 unless the request carries the API key (always passes when none is set)."""
    get_state(conn).check_auth(conn.scope)


def _content_type(conn: HTTPConnection) -> str:
    return conn.headers.get("content-type", "").split(";")[0].strip().lower()


def _check_content_type(conn: HTTPConnection, expected: str, described: str) -> None:
    kind = _content_type(conn)
    if kind != expected:
        shown = kind or "none"
        raise ApiError(415, f"the request body must be {described} (got {shown})", code="unsupported_media_type")


def require_json(conn: HTTPConnection) -> None:
    """A 415 unless the body is declared JSON (form-encoded is what ``curl -d`` sends, and would
    read as a missing body)."""
    _check_content_type(conn, "application/json", "JSON sent with 'Content-Type: application/json'")


def require_multipart(conn: HTTPConnection) -> None:
    """A 415 unless the body is multipart/form-data (file uploads, as the openai client sends them)."""
    _check_content_type(conn, "multipart/form-data", "multipart/form-data with the image as a file part")


def require_json_or_multipart(conn: HTTPConnection) -> None:
    """A 415 unless the body is JSON or multipart/form-data (a route that takes the same fields
    either way, as ``POST /v1/videos`` does for the openai client's form)."""
    if _content_type(conn) != "multipart/form-data":
        _check_content_type(conn, "application/json", "JSON ('Content-Type: application/json') or multipart/form-data")


def get_jobs(state: State) -> JobManager:
    """The job manager, or a 503 while it is not running."""
    if state.jobs is None:
        raise ApiError(503, "the job manager is not running", type="service_unavailable", code="loading")
    return state.jobs


Jobs = Annotated[JobManager, Depends(get_jobs)]


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate: no name, and nothing a message can carry
        return False
    return True


def model_for(task: TaskName | None) -> Callable[[Request, ServerState], Awaitable[ModelHandle]]:
    """The dependency that resolves the model a request runs on, once: the name its body (or
    form, or query) gives as ``model`` (the only model when one is served and none is named);
    404 ``model_not_found`` for an unknown name, 400 naming ``model`` when several are served and
    none is named or when the model cannot do ``task`` (None: the route checks the task it reads
    from the body); 503 while draining or while the model cannot serve. The model is held until
    the HTTP request ends."""

    async def resolve(request: Request, state: State) -> ModelHandle:
        state.check_draining()
        name = await requested_model(request)
        if name is not None and (not isinstance(name, str) or not _encodable(name)):
            raise ApiError(400, "`model` must be the name of a served model", param="model", code="invalid_value")
        served = state.model(name)
        request.scope[MODEL] = served.name
        if task is not None:
            require(served, task)
        return await state.serve(served, request.scope.get(LEASES))

    return resolve


#: The subprotocol a browser's realtime session offers beside its key (``state.KEY_SUBPROTOCOL``).
REALTIME_SUBPROTOCOL = "realtime"


def websocket_subprotocol(websocket: WebSocket) -> str | None:
    """The subprotocol to accept the socket with: ``realtime`` when the client offered it (a
    browser fails a connection whose server picks none of the subprotocols it offered), else
    none."""
    return REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in websocket.scope.get("subprotocols", ()) else None


async def realtime_model(websocket: WebSocket, state: State) -> AsyncIterator[ModelHandle]:
    """The model of a realtime session: the one its query names as ``model`` (the only model when
    one is served), resolved and checked as :func:`model_for` does (404, 400, 503), and one that
    answers with text or speech (400 ``no_speech``); held for as long as the session lasts."""
    state.check_draining()
    name = websocket.query_params.get("model")
    if name is not None and not _encodable(name):
        raise ApiError(400, "`model` must be the name of a served model", param="model", code="invalid_value")
    served = state.model(name)
    SessionModel.of(served.name, served.capabilities)
    async with state.holding() as leases:
        yield await state.serve(served, leases)


#: A route's model, as a handler parameter (``model: ImageModel``), for each task.
ImageModel = Annotated[ModelHandle, Depends(model_for("text2image"))]
EditModel = Annotated[ModelHandle, Depends(model_for("image_edit"))]
VariationModel = Annotated[ModelHandle, Depends(model_for("image_variation"))]
VideoModel = Annotated[ModelHandle, Depends(model_for("text2video"))]
SpeechModel = Annotated[ModelHandle, Depends(model_for("text2speech"))]
ChatModel = Annotated[ModelHandle, Depends(model_for("chat"))]
#: A model for a task the route reads from its body (``/v1/generate``).
AnyModel = Annotated[ModelHandle, Depends(model_for(None))]
#: A realtime session's model (``WS /v1/realtime?model=``).
RealtimeModel = Annotated[ModelHandle, Depends(realtime_model)]

AUTH = Depends(require_api_key)
JSON_BODY = Depends(require_json)
MULTIPART_BODY = Depends(require_multipart)
JSON_OR_MULTIPART_BODY = Depends(require_json_or_multipart)
#: The checks the middleware runs early for the route that matched, in this order.
GUARDS: tuple[Callable[[HTTPConnection], None], ...] = (
    require_api_key,
    require_json,
    require_multipart,
    require_json_or_multipart,
)
#: The guards of which a POST route with a body declares one.
BODY_GUARDS = (require_json, require_multipart, require_json_or_multipart)


def _calls(dependant: Any) -> Iterator[Callable[..., Any]]:
    for dep in dependant.dependencies:
        yield dep.call
        yield from _calls(dep)


def guards_of(route: Any) -> list[Callable[[HTTPConnection], None]]:
    """The :data:`GUARDS` a route declares (directly, through its router, or nested), in
    :data:`GUARDS` order; none for a route without dependencies (a mounted app, say)."""
    dependant = getattr(route, "dependant", None)
    declared = set(_calls(dependant)) if dependant is not None else set()
    return [g for g in GUARDS if g in declared]
