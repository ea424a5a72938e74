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

import asyncio
import hmac
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_runtime.config import DeployConfig
from omni_runtime.exceptions import (
    ConfigError,
    EngineDeadError,
    EngineError,
    OmniError,
    QueueFullError,
    RequestAbortedError,
    UnavailableError,
)
from omni_runtime.outputs import OmniRequestOutput
from omni_runtime.resolve import ResolvedConfig

from ..async_omni import AsyncOmni, ValidRequest, load_resolved
from ..jobs.store import JobStore, MemoryJobStore
from . import protocol as proto
from .chat import chat_completion
from .files import FILE_ID, MAX_REDIS_FILE_BYTES, FileStore, RedisFileStore
from .images import images_engine, run_images, validate_images
from .job_manager import JobManager, JobSettings
from .jobs import add_job_routes
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import DISCONNECTED, ApiError, ClientDisconnected, error_body
from .uploads import image_params, read_image_form

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Largest request body; a 1 MB prompt still reaches validation (and gets a 400 naming the field).
MAX_BODY_BYTES = 8 * 1024 * 1024
_HOSTNAME = socket.gethostname()  # the node name of this machine's own replicas
#: Scope key set when the client went away, so the request is counted as status 499.


class SafeJSONResponse(JSONResponse):
    """JSON that always renders: a string UTF-8 cannot encode (a lone surrogate quoted from the
    request, say) goes out as its ``\\udXXX`` JSON escape instead of failing the response."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace"
        )


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    headers = {}
    if isinstance(exc, QueueFullError | UnavailableError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    elif isinstance(exc, ApiError) and exc.code == "loading":
        headers["Retry-After"] = "1"
    elif status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return SafeJSONResponse(body, status_code=status, headers=headers)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


# --------------------------------------------------------------------------- server state


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ServerState:
    """What the routes share: the engine, metrics, files, in-flight request ids, drain state."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        *,
        api_key: str | None,
        max_pending: int | None,
        default_timeout: float | None,
        file_ttl_s: float,
        file_store_bytes: int,
        jobs: JobSettings | None = None,
        public_url: str | None = None,
        local_url: str | None = None,
    ) -> None:
        self.resolved = resolved
        #: The base of result URLs when configured (``--public-url``); else the request's Host.
        self.public_url = public_url.rstrip("/") if public_url else None
        #: This gateway's own address (its listening socket), for the results of jobs it took
        #: over from a lost gateway when no public URL is configured.
        self.local_url = local_url.rstrip("/") if local_url else None
        self.job_settings = jobs or JobSettings()
        #: The job manager (/v1/generate, /v1/jobs), once the app has started.
        self.jobs: JobManager | None = None
        self.config = config = resolved.config
        self.api_key = api_key.encode() if api_key else None
        self._engine_kwargs = {"max_pending": max_pending, "default_timeout": default_timeout}
        self.omni: AsyncOmni | None = None
        self._closed = False
        #: Set when the engine died for good; the server then stops (non-zero exit) to be restarted.
        self.dead: EngineDeadError | None = None
        #: Called (on the server's loop) when the engine dies or fails to start: the CLI's server
        #: stops itself.
        self.on_dead: list[Callable[[EngineError], None]] = []
        #: Why the engine could not start (the server then stops, non-zero), or None.
        self.failed: BaseException | None = None
        self._starting: asyncio.Task | None = None
        self.metrics = ServerMetrics(lambda: self.omni.health() if self.omni is not None else None)
        self.files: FileStore | RedisFileStore
        if self.job_settings.redis_url:
            # Every gateway on the same Redis serves every file (a job's result outlives its gateway).
            limit = min(file_store_bytes, MAX_REDIS_FILE_BYTES)
            self.files = RedisFileStore(
                self.job_settings.redis_url, file_ttl_s, limit, timeout_s=self.job_settings.redis_timeout_s
            )
        else:
            self.files = FileStore(file_ttl_s, file_store_bytes)
        self.inflight: set[str] = set()
        self.draining = False
        self.created = int(time.time())
        self.model_name = config.model or "omni"
        finals = [s for s in config.stage_args if s.final_output]
        self.image_stage = next((s.stage_id for s in finals if s.final_output_type == "image"), None)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the engine in the background: the server answers at once (503 ``loading`` until
        the models are loaded, so a probe sees the difference between loading and gone)."""
        self._starting = asyncio.ensure_future(self._start())

    async def start_jobs(self) -> None:
        """Connect the job store (an unreachable Redis stops the server here, saying so)."""
        settings = self.job_settings
        store: JobStore
        if settings.redis_url:
            from ..jobs.redis_store import RedisJobStore

            store = RedisJobStore(
                settings.redis_url,
                ttl_s=settings.ttl_s,
                lease_s=settings.lease_s,
                connections=settings.redis_connections,
                timeout_s=settings.redis_timeout_s,
            )
        else:
            store = MemoryJobStore(max_jobs=settings.max_jobs, ttl_s=settings.ttl_s)
        otlp = None
        if settings.otlp_endpoint:
            from ..jobs.tracing import OtlpExporter

            otlp = OtlpExporter(settings.otlp_endpoint)
        manager = JobManager(self, store, lease_s=settings.lease_s, otlp=otlp, max_streams=settings.max_streams)
        try:
            await manager.start()
        except ConfigError:  # a Redis user without the commands the store needs: it says which
            await store.close()
            raise
        except Exception as e:
            await store.close()
            raise EngineError(f"the job store ({store.backend}) cannot be reached: {e}") from e
        self.jobs = manager

    async def _start(self) -> None:
        stages = ", ".join(f"{s.stage_type} ({s.model or 'no model'})" for s in self.config.stage_args)
        logger.info("loading %s: %s", self.model_name, stages)
        started = time.monotonic()
        try:
            # Stage processes load their models here: off the loop, which keeps serving.
            omni = await asyncio.get_running_loop().run_in_executor(
                None, lambda: AsyncOmni(self.resolved, **self._engine_kwargs)
            )
        except Exception as e:
            self.failed = e
            logger.critical("the engine failed to start: %s", e)
            for callback in self.on_dead:
                callback(EngineError(f"the engine failed to start: {e}"))
            return
        if self._closed:  # shut down while loading
            await asyncio.get_running_loop().run_in_executor(None, omni.close)
            return
        self.omni = omni
        self.model_name = omni.model_name
        omni.on_dead(self._engine_died)
        logger.info("%s is ready (%.1f s)", self.model_name, time.monotonic() - started)

    def _engine_died(self, error: EngineDeadError) -> None:
        self.dead = error
        logger.critical("the engine is dead and will not recover: %s", error)
        for callback in self.on_dead:
            callback(error)

    async def close(self) -> None:
        """Close the engine (idempotent): stage processes exit, pending requests end with 503.
        An engine still loading is closed as soon as it has started."""
        if self._closed:
            return
        self._closed = True
        if self.jobs is not None:
            await self.jobs.close()
        if self._starting is not None and not self._starting.done():
            await asyncio.gather(self._starting, return_exceptions=True)
        if self.omni is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.omni.close)
        await self.files.close()

    def abort_all(self, reason: str) -> None:
        """Abort every in-flight engine request; their handlers answer 503 with ``reason``.
        Runs on the server's loop (from a timer or a signal)."""
        ids = list(self.inflight)
        if ids and self.omni is not None:
            self.metrics.aborted.labels("shutdown").inc(len(ids))
            self.omni.abort(ids, RequestAbortedError(reason))

    @property
    def started(self) -> AsyncOmni:
        """The engine, or a 503 saying why there is none (still loading, or failed)."""
        if self.omni is None:
            if self.failed is not None:
                raise EngineError(f"the engine failed to start: {self.failed}")
            raise ApiError(
                503, f"{self.model_name} is loading; retry shortly", type="service_unavailable", code="loading"
            )
        return self.omni

    def check_request(self, model: str | None) -> AsyncOmni:
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        if model is not None and model != self.model_name:
            raise ApiError(
                404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model", code="model_not_found",
            )  # fmt: skip
        return self.started

    def authorized(self, scope: Scope) -> bool:
        """Whether the request carries the API key (always, when none is set)."""
        if self.api_key is None:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False

    def check_auth(self, scope: Scope) -> None:
        if self.authorized(scope):
            return
        raise ApiError(
            401, "a valid API key is required: send 'Authorization: Bearer <key>'",
            type="authentication_error", code="invalid_api_key",
        )  # fmt: skip

    # ------------------------------------------------------------------ running requests

    async def collect(self, omni: AsyncOmni, request: ValidRequest, request_id: str) -> OmniRequestOutput:
        """Run one validated engine request to its end; its metrics go to Prometheus."""
        last = None
        self.inflight.add(request_id)
        try:
            async for out in omni.generate(request, request_id=request_id):
                last = out
        finally:
            self.inflight.discard(request_id)
        self.metrics.observe_output(last)
        assert last is not None  # generate always yields a finished output or raises
        return last

    async def until_disconnect(self, request: Request, ids: Sequence[str], work: Awaitable[T]) -> T:
        """Await ``work``; if the client disconnects first, abort ``ids`` and raise ClientDisconnected."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            request.scope[DISCONNECTED] = True
            live = [rid for rid in ids if rid in self.inflight]
            self.metrics.aborted.labels("client_disconnect").inc(len(live))
            self.omni.abort(live)
            raise ClientDisconnected()
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                # Let the generators run their clean-up before the caller moves on.
                await asyncio.wait((task,))


# --------------------------------------------------------------------------- middleware

#: Routes whose body is JSON: another content type is a 415 that says so (form-encoded is what
#: `curl -d` sends, and FastAPI would read it as a missing body).
JSON_ROUTES = frozenset({"/v1/chat/completions", "/v1/images/generations", "/v1/omni/collective_rpc", "/v1/generate"})
#: Routes whose body is multipart/form-data (file uploads), as the openai client sends them.
MULTIPART_ROUTES = frozenset({"/v1/images/edits", "/v1/images/variations"})


def _content_type(scope: Scope) -> bytes:
    return next((v for k, v in scope["headers"] if k == b"content-type"), b"").split(b";")[0].strip().lower()


#: What a POST route's body must be sent as, and how the 415 says it.
_JSON = (b"application/json", "JSON sent with 'Content-Type: application/json'")
_MULTIPART = (b"multipart/form-data", "multipart/form-data with the image as a file part")


def _check_content_type(scope: Scope, expected: tuple[bytes, str]) -> None:
    kind = _content_type(scope)
    if kind != expected[0]:
        shown = kind.decode("latin-1") or "none"
        raise ApiError(415, f"the request body must be {expected[1]} (got {shown})", code="unsupported_media_type")


class _HttpMiddleware:
    """Pure ASGI (so handlers keep the raw ``receive`` for disconnect detection): the API key on
    /v1 routes, the body-size limit, and per-route request counts and latency."""

    def __init__(self, app: ASGIApp, state: ServerState, routes: Sequence[BaseRoute]) -> None:
        self.app, self.state, self.routes = app, state, routes

    def _match(self, scope: Scope) -> BaseRoute | None:
        return next((r for r in self.routes if r.matches(scope)[0] is Match.FULL), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

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
                if scope["path"].startswith("/v1/"):
                    self.state.check_auth(scope)
                length = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
                if length.isdigit() and int(length) > MAX_BODY_BYTES:
                    raise too_large
                if scope["method"] == "POST" and scope["path"] in JSON_ROUTES:
                    _check_content_type(scope, _JSON)
                elif scope["method"] == "POST" and scope["path"] in MULTIPART_ROUTES:
                    _check_content_type(scope, _MULTIPART)
            except ApiError as e:
                await error_response(e)(scope, receive, send_and_record)
                return
            try:
                await self.app(scope, receive_limited, send_unless_over)
            except Exception:
                if not over:
                    raise
            if over:
                await error_response(too_large)(scope, receive, send_and_record)
        finally:
            route = scope.get("route") or self._match(scope)  # requests refused here never reached routing
            label = getattr(route, "path", None) or "unmatched"
            if scope.get(DISCONNECTED):
                status = 499
            m = self.state.metrics
            m.http_requests.labels(label, scope["method"], str(status)).inc()
            m.http_latency.labels(label).observe(time.perf_counter() - start)


# --------------------------------------------------------------------------- the app


def create_app(
    model: str | Path | DeployConfig = "tiny-sd",
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
) -> FastAPI:
    """The FastAPI app for ``model`` (a config name, YAML path, model dir or DeployConfig).

    The config is validated here (ConfigError at once); the engine starts with the app's lifespan.
    ``app.state.omni`` is the :class:`ServerState`. ``public_url``: the base of result URLs
    (else each request's Host); ``local_url``: this server's own address (see ServerState).
    With ``api_key``, the interactive docs and the OpenAPI schema are not served.
    """
    resolved = load_resolved(model, dict(engine_args or {}), ray_address)
    state = ServerState(
        resolved,
        api_key=api_key,
        max_pending=max_pending,
        default_timeout=default_timeout,
        file_ttl_s=file_ttl_s,
        file_store_bytes=file_store_bytes,
        jobs=jobs,
        public_url=public_url,
        local_url=local_url,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start_jobs()
        state.start()
        try:
            yield
        finally:
            await state.close()

    # The body limit is enforced by _HttpMiddleware, which answers in the OpenAI error shape.
    # redirect_slashes off: `/v1/files/x/` is a JSON 404 like any unknown path, not an empty 307.
    # With a key, the schema and docs pages are off: they list every route and field, and a
    # browser opening /docs sends no Authorization header to check.
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="omni_runtime",
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
        redirect_slashes=False,
        **docs,
    )
    app.state.omni = state
    app.add_middleware(_HttpMiddleware, state=state, routes=app.router.routes)
    if allowed_origins:
        # Outermost, so that preflight requests are answered before the API-key check.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    for exc_class in (Exception, OmniError, ApiError, ClientDisconnected, RequestValidationError):
        app.add_exception_handler(exc_class, _handle)
    app.add_exception_handler(HTTPException, _handle)
    _add_routes(app, state)
    add_job_routes(app, state, SafeJSONResponse)
    return app


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


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
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

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        h = state.started.health()
        if not state.authorized(request.scope):
            # Open to orchestrators without the key, but only the verdict: the stages, hosts,
            # queues and gateway id are for whoever holds it.
            ready = h.ok and not state.draining
            body = {"ready": ready, "draining": state.draining}
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

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = proto.ModelCard(id=state.model_name, created=state.created)
        return SafeJSONResponse(proto.ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        state.check_request(model_id)
        return SafeJSONResponse(proto.ModelCard(id=state.model_name, created=state.created).model_dump())

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> Response:
        found = await state.files.get(file_id) if FILE_ID.fullmatch(file_id) else None
        if found is None:
            shown = file_id if len(file_id) <= 64 else f"{file_id[:64]}... ({len(file_id)} characters)"
            raise ApiError(404, f"file `{shown}` does not exist or has expired", param="file_id", code="not_found")
        media_type, data, left = found
        return Response(data, media_type=media_type, headers={"Cache-Control": f"private, max-age={int(left)}"})

    @app.post("/v1/images/generations")
    async def create_images(body: proto.ImageGenerationRequest, request: Request) -> JSONResponse:
        omni = images_engine(state, body.model, body.n)
        size = body.dimensions()
        image: dict[str, Any] = {
            "negative_prompt": body.negative_prompt,
            "num_inference_steps": body.num_inference_steps,
            "guidance_scale": body.guidance_scale,
            "timeout": body.timeout,
            "lora": body.lora.params() if body.lora else None,
            "priority": body.priority,
        }
        if size is not None:
            image["width"], image["height"] = size
        image = {k: v for k, v in image.items() if v is not None}
        valid = validate_images(omni, body.prompt, image, body.n, body.seed)
        return _json_with_id(await run_images(state, omni, request, valid, body))

    @app.post("/v1/images/edits")
    async def edit_images(request: Request) -> JSONResponse:
        body, files = await read_image_form(request, proto.ImageEditForm)
        omni = images_engine(state, body.model, body.n)
        # Without a mask, the image's own transparent pixels are the region to edit (as OpenAI's
        # edits take it); an opaque image without a mask is redrawn as a whole (img2img).
        params = await image_params(body, files, body.strength, alpha_as_mask=True, limit=omni.max_input_pixels())
        valid = validate_images(omni, body.prompt, params, body.n, body.seed)
        return _json_with_id(await run_images(state, omni, request, valid, body))

    @app.post("/v1/images/variations")
    async def image_variations(request: Request) -> JSONResponse:
        body, files = await read_image_form(request, proto.ImageVariationForm)
        omni = images_engine(state, body.model, body.n)
        strength = body.strength if body.strength is not None else proto.VARIATION_STRENGTH
        params = await image_params(body, files, strength, alpha_as_mask=False, limit=omni.max_input_pixels())
        valid = validate_images(omni, "", params, body.n, body.seed)
        return _json_with_id(await run_images(state, omni, request, valid, body))

    @app.post("/v1/chat/completions")
    async def chat(body: proto.ChatCompletionRequest, request: Request) -> Response:
        answer = await chat_completion(state, body, request)
        return answer if isinstance(answer, Response) else _json_with_id(answer)

    @app.post("/v1/omni/collective_rpc")
    async def collective_rpc(body: proto.CollectiveRpcRequest) -> JSONResponse:
        omni = state.check_request(None)
        # A default deadline, so a hung replica cannot hold an HTTP request forever.
        timeout = body.timeout if body.timeout is not None else 30.0
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


def _json_with_id(result: tuple[dict[str, Any], str]) -> JSONResponse:
    """A route's JSON body and its request id (the ``X-Request-Id`` header)."""
    body, request_id = result
    return SafeJSONResponse(body, headers={"X-Request-Id": request_id})


async def _job_store_status(state: ServerState) -> dict[str, Any]:
    if state.jobs is None:
        return {"backend": None, "ok": False}
    store = state.jobs.store
    return {"backend": store.backend, "ok": await store.ping(), "jobs": store.count(), "gateway": state.jobs.gateway_id}
