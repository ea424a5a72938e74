"""The OpenAI-style HTTP server: a FastAPI app over :class:`AsyncOmni`. Runs on uvicorn's event loop.

``create_app(model)`` validates the deploy config at once; the engine itself starts in the app's
lifespan (stage processes load their models) and is closed when the app shuts down. Every error,
from pydantic validation to a dead stage, becomes the OpenAI error shape in one place,
:func:`error_response`.

Each image of an ``n``-image request, and each chat completion, is its own engine request, so they
batch with everyone else's. A client that disconnects has its requests aborted at once: the
handler awaits ``http.disconnect`` on the ASGI channel beside the generation (no polling), and a
streaming response is cancelled by Starlette when the peer goes away.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.routing import iter_route_contexts
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketState

from omni_runtime.config import DeployConfig
from omni_runtime.exceptions import OmniError
from omni_runtime.resolve import ResolvedConfig

from ..async_omni import load_resolved
from ..multi_omni import ModelSpec
from . import chat, control, file_routes, health, images, jobs, pages, realtime, speech, status, videos
from .dependencies import guards_of, require_api_key
from .job_manager import JobSettings
from .protocol import DISCONNECTED, ApiError, ClientDisconnected
from .realtime_session import RealtimeLimits
from .responses import SafeJSONResponse, error_response
from .state import LEASES, MODEL, ServerState
from .status_history import StatusHistory

logger = logging.getLogger(__name__)

#: Largest request body; a 1 MB prompt still reaches validation (and gets a 400 naming the field).
MAX_BODY_BYTES = 8 * 1024 * 1024
#: The routers, one per surface; each declares its checks (API key, content type) as dependencies.
ROUTERS = (
    health.router,
    images.router,
    chat.router,
    jobs.router,
    videos.router,
    speech.router,
    realtime.router,
    file_routes.router,
    control.router,
    status.router,
    pages.router,
)


def api_routes(app: FastAPI) -> list[BaseRoute]:
    """Every route of ``app``, those of included routers as the routes they declared (with the
    router's prefix and dependencies)."""
    return [context.original_route for context in iter_route_contexts(app.routes)]


async def _handle(conn: HTTPConnection, exc: Exception) -> JSONResponse | None:
    if isinstance(conn, WebSocket):
        # A WebSocket refused by a route dependency (the API key): an error message and close
        # code 4000 + status, as the route refuses an unknown job.
        if conn.client_state is WebSocketState.CONNECTING:
            await jobs.refuse_websocket(conn, exc)
        return None
    return error_response(exc)


# --------------------------------------------------------------------------- middleware


class _HttpMiddleware:
    """Pure ASGI (so handlers keep the raw ``receive`` for disconnect detection): the checks the
    matched route declares (see dependencies.py), run before its body is read; the body-size
    limit; and per-route request counts and latency."""

    def __init__(self, app: ASGIApp, state: ServerState, routes: Callable[[], list[BaseRoute]]) -> None:
        self.app, self.state, self._routes = app, state, routes
        self.routes: list[BaseRoute] | None = None

    def _match(self, scope: Scope) -> BaseRoute | None:
        if self.routes is None:  # the app's routes, once they are all included
            self.routes = self._routes()
        return next((r for r in self.routes if r.matches(scope)[0] is Match.FULL), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        route = self._match(scope)

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        too_large = ApiError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
        received, over = 0, False

        async def receive_limited() -> Message:
            # A body without Content-Length (chunked) is counted as it arrives: past the limit the
            # app sees a disconnect, and its answer is replaced by the 413 below.
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def send_unless_over(message: Message) -> None:
            if not over:
                await send_and_record(message)

        try:
            try:
                # The checks the matched route declares run here, before its body is read: the
                # key first (an unknown /v1 path without the key is a 401 too, not a 404 that
                # tells which paths exist), then the size, then the content type.
                guards = guards_of(route) if route is not None else []
                if route is None and scope["path"].startswith("/v1/"):
                    guards = [require_api_key]
                conn = HTTPConnection(scope)
                if require_api_key in guards:
                    require_api_key(conn)
                length = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
                if length.isdigit() and int(length) > MAX_BODY_BYTES:
                    raise too_large
                for guard in guards:
                    if guard is not require_api_key:
                        guard(conn)
            except ApiError as e:
                await error_response(e)(scope, receive, send_and_record)
                return
            try:
                async with self.state.holding() as leases:  # the models the request uses, until it ends
                    scope[LEASES] = leases
                    await self.app(scope, receive_limited, send_unless_over)
            except Exception:
                if not over:
                    raise
            if over:
                await error_response(too_large)(scope, receive, send_and_record)
        finally:
            # Requests refused here never reached routing: they count under the route matched above.
            label = getattr(scope.get("route") or route, "path", None) or "unmatched"
            if scope.get(DISCONNECTED):
                status = 499
            m, model = self.state.metrics, scope.get(MODEL, "")
            m.series(m.http_requests, model, label, scope["method"], str(status)).inc()
            m.series(m.http_latency, model, label).observe(time.perf_counter() - start)


# --------------------------------------------------------------------------- the app


def create_app(
    model: str | Path | DeployConfig | Sequence[ModelSpec] = "tiny-sd",
    *,
    api_key: str | None = None,
    max_pending: int | None = None,
    default_timeout: float | None = None,
    engine_args: dict[str, Any] | None = None,
    ray_address: str | None = None,
    allowed_origins: Sequence[str] | None = None,
    file_ttl_s: float = 600.0,
    file_store_bytes: int = 256 * 1024 * 1024,
    jobs: JobSettings | None = None,
    public_url: str | None = None,
    local_url: str | None = None,
    max_loaded_models: int | None = None,
    max_resident_bytes: int | None = None,
    load_timeout: float | None = 300.0,
    realtime: RealtimeLimits | None = None,
) -> FastAPI:
    """The FastAPI app for ``model`` (a config name, YAML path, model dir or DeployConfig), or
    for several models (:class:`ModelSpec` each), routed by the requests' ``model``.

        The config is validated here (ConfigError at once); the engine starts with the app's lifespan.
        ``app.state.omni`` is the :class:`ServerState`. ``public_url``: the base of result URLs
        (else each request's Host); ``local_url``: this server's own address (see ServerState).
        With ``api_key``, the interactive docs and the OpenAPI schema are not served.
        ``max_loaded_models`` / ``max_resident_bytes``: the budget that evicts the least recently
        used idle model; ``load_timeout``: how long a request waits for its model to come back.
        ``realtime``: the bounds of ``WS /v1/realtime`` sessions.
    """
    served: ResolvedConfig | list[ModelSpec]
    if isinstance(model, str | Path | DeployConfig):
        served = load_resolved(model, dict(engine_args or {}), ray_address)
    else:
        served = [
            dataclasses.replace(m, source=load_resolved(m.source, dict(engine_args or {}), ray_address)) for m in model
        ]
        one = served[0]
        if len(served) == 1 and one.name is None and one.max_pending is None and not one.lazy:
            served = served[0].source  # type: ignore[assignment]
    state = ServerState(
        served,
        api_key=api_key,
        max_pending=max_pending,
        default_timeout=default_timeout,
        file_ttl_s=file_ttl_s,
        file_store_bytes=file_store_bytes,
        jobs=jobs,
        public_url=public_url,
        local_url=local_url,
        max_loaded_models=max_loaded_models,
        max_resident_bytes=max_resident_bytes,
        load_timeout=load_timeout,
        realtime=realtime,
    )

    #: The dashboard's charts: every model sampled in the background while the app runs.
    history = StatusHistory(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start_jobs()
        state.start()
        history.start()
        try:
            yield
        finally:
            await history.stop()
            await state.close()

    # The body limit is enforced by _HttpMiddleware, which answers in the OpenAI error shape.
    # redirect_slashes off: `/v1/files/x/` is a JSON 404 like any unknown path, not an empty 307.
    # With a key, the schema and docs pages are off: they list every route and field, and a
    # browser opening /docs sends no Authorization header to check.
    docs: dict[str, Any] = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="omni_runtime",
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
        redirect_slashes=False,
        **docs,
    )
    app.state.omni = state
    app.state.history = history
    app.add_middleware(_HttpMiddleware, state=state, routes=lambda: api_routes(app))
    if allowed_origins:
        # Outermost, so that preflight requests are answered before the API-key check.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    # One handler for HTTP and WebSocket (starlette calls the same one for both), which
    # starlette's types can only declare as two separate kinds of handler.
    for exc_class in (Exception, OmniError, ApiError, ClientDisconnected, RequestValidationError):
        app.add_exception_handler(exc_class, _handle)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _handle)  # type: ignore[arg-type]
    for router in ROUTERS:
        app.include_router(router)
    return app
