"""What the routes share (:class:`ServerState`: the models, metrics, files, jobs, in-flight
request ids, drain state) and how a route gets it: :func:`get_state` reads ``app.state.omni``.
Runs on the server's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import HTTPConnection, Request
from starlette.types import Receive, Scope

from omni_runtime.exceptions import (
    ConfigError,
    EngineDeadError,
    EngineError,
    ModelUnavailableError,
    RequestAbortedError,
    UnknownModelError,
)
from omni_runtime.outputs import OmniRequestOutput
from omni_runtime.resolve import ResolvedConfig

from ..async_omni import AsyncOmni, ValidRequest
from ..capabilities import ModelCapabilities
from ..jobs.store import JobStore, MemoryJobStore
from ..jobs.tracing import OtlpExporter
from ..multi_omni import ModelSpec, MultiOmni, ServedModel
from .files import MAX_REDIS_FILE_BYTES, FileStore, RedisFileStore
from .job_manager import JobManager, JobSettings
from .metrics import ServerMetrics
from .model_metrics import ModelCollector
from .protocol import DISCONNECTED, ApiError, ClientDisconnected
from .realtime_session import RealtimeLimits

#: A WebSocket subprotocol that carries the API key after it (``openai-insecure-api-key.<key>``):
#: a browser cannot set a WebSocket's headers, and the key must never be in a URL.
KEY_SUBPROTOCOL = "openai-insecure-api-key."

logger = logging.getLogger(__name__)
T = TypeVar("T")


def get_state(conn: HTTPConnection) -> ServerState:
    """The app's :class:`ServerState` (a route dependency; ``create_app`` puts it in ``app.state``)."""
    return conn.app.state.omni


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


#: The ASGI scope key of an HTTP request's leases (the models it holds until it ends).
LEASES = "omni.leases"
#: The ASGI scope key of the served model an HTTP request named: its HTTP metrics' ``model``.
MODEL = "omni.model"


@dataclass(frozen=True)
class ModelHandle:
    """The model a request runs on, resolved once from what the request names (see
    ``dependencies.model_for``) and passed to whatever serves it: the served model (its name,
    config and :class:`~..capabilities.ModelCapabilities`) and its engine, held for the request."""

    served: ServedModel
    engine: AsyncOmni
    #: When the model was brought back for this request (lazy, or evicted): ``{"model", "from"
    #: (its state before), "loaded_s"}``, what a job's ``loading`` event says; else None.
    loaded: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.served.name

    @property
    def capabilities(self) -> ModelCapabilities:
        return self.served.capabilities

    @property
    def resolved(self) -> ResolvedConfig:
        return self.served.resolved


class ServerState:
    """What the routes share: the models (a :class:`MultiOmni`), metrics, files, in-flight
    request ids, drain state. Which model a request is for is never state here: a route gets it
    as a :class:`ModelHandle` (``dependencies.model_for``), and what iterates models names each."""

    def __init__(
        self,
        resolved: ResolvedConfig | Sequence[ModelSpec],
        *,
        api_key: str | None,
        max_pending: int | None,
        default_timeout: float | None,
        file_ttl_s: float,
        file_store_bytes: int,
        jobs: JobSettings | None = None,
        public_url: str | None = None,
        local_url: str | None = None,
        max_loaded_models: int | None = None,
        max_resident_bytes: int | None = None,
        load_timeout: float | None = None,
        realtime: RealtimeLimits | None = None,
    ) -> None:
        specs = [ModelSpec(source=resolved)] if isinstance(resolved, ResolvedConfig) else list(resolved)
        if len(specs) == 1:  # a lone model is what the server is for: it loads at start
            specs = [dataclasses.replace(specs[0], lazy=False)]
        #: Every served model, each with its own engine, queues and admission limit, and the
        #: budget of loaded models that evicts the least recently used idle one.
        self.multi = MultiOmni(
            specs,
            max_pending=max_pending,
            default_timeout=default_timeout,
            max_loaded_models=max_loaded_models,
            max_resident_bytes=max_resident_bytes,
            load_timeout=load_timeout,
        )
        self.multi.on_dead.append(self._model_died)
        #: Whether several models are served: the bodies then say which, and metrics gain a label.
        self.several = len(self.multi.models) > 1
        #: The base of result URLs when configured (``--public-url``); else the request's Host.
        self.public_url = public_url.rstrip("/") if public_url else None
        #: This gateway's own address (its listening socket), for the results of jobs it took
        #: over from a lost gateway when no public URL is configured.
        self.local_url = local_url.rstrip("/") if local_url else None
        self.job_settings = jobs or JobSettings()
        #: The job manager (/v1/generate, /v1/jobs), once the app has started.
        self.jobs: JobManager | None = None
        self.api_key = api_key.encode() if api_key else None
        self._closed = False
        #: Set when no model can serve any more (one model: its engine died); the server then
        #: stops (non-zero exit) to be restarted.
        self.dead: EngineDeadError | None = None
        #: Called (on the server's loop) when the engine dies or fails to start (with several
        #: models: when none is left serving): the CLI's server stops itself.
        self.on_dead: list[Callable[[EngineError], None]] = []
        self._starting: asyncio.Task | None = None
        self.metrics = ServerMetrics(
            (lambda: self.multi.health()) if self.several else (lambda: self.only.health()), labelled=self.several
        )
        self.metrics.registry.register(ModelCollector(self.multi))
        self.files: FileStore | RedisFileStore
        if self.job_settings.redis_url:
            # Every gateway on the same Redis serves every file (a job's result outlives its gateway).
            limit = min(file_store_bytes, MAX_REDIS_FILE_BYTES)
            self.files = RedisFileStore(
                self.job_settings.redis_url, file_ttl_s, limit, timeout_s=self.job_settings.redis_timeout_s
            )
        else:
            self.files = FileStore(file_ttl_s, file_store_bytes)
        #: The engine requests running for HTTP requests: request id -> its model's name.
        self.inflight: dict[str, str] = {}
        self.draining = False
        self.created = int(time.time())
        #: The bounds of realtime sessions, and how many are open (``WS /v1/realtime``).
        self.realtime = realtime or RealtimeLimits()
        self.realtime_sessions = 0

    # ------------------------------------------------------------------ the served models

    @property
    def only(self) -> ServedModel:
        """The first served model: the model, when only one is served."""
        return next(iter(self.multi.models.values()))

    @property
    def failed(self) -> BaseException | None:
        """Why the models could not start when none did (the server then stops, non-zero), or None.
        One model: its load error."""
        failed = [m for m in self.multi.models.values() if m.state == "failed"]
        if not failed or len(failed) < len(self.multi.models):
            return None
        if len(failed) == 1:
            return failed[0].error
        return EngineError("; ".join(f"`{m.name}`: {m.error}" for m in failed))

    @property
    def serving(self) -> bool:
        """Whether any model has an engine (loaded, or dead since)."""
        return any(m.engine is not None for m in self.multi.models.values())

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the engines in the background: the server answers at once (503 ``loading`` until
        a model is loaded, so a probe sees the difference between loading and gone)."""
        self._starting = asyncio.ensure_future(self._start())

    async def start_jobs(self) -> None:
        """Connect the job store (an unreachable Redis stops the server here, saying so)."""
        settings = self.job_settings
        store: JobStore
        if settings.redis_url:
            from ..jobs.redis_store import RedisJobStore  # lazy: the Redis job store, only with --redis-url

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
        started = time.monotonic()
        for model in self.multi.models.values():
            stages = ", ".join(f"{s.stage_type} ({s.model or 'no model'})" for s in model.config.stage_args)
            logger.info("loading %s: %s", model.name, stages)
        # Stage processes load their models off the loop (all models at once), which keeps serving.
        await self.multi.start()
        # What exists now (imports, configs, engines) lives as long as the server: out of the
        # collector's generations, a full collection during traffic does not walk it (tens of
        # milliseconds on this heap: long enough to split arrivals meant for one wave).
        gc.collect()
        gc.freeze()
        for model in self.multi.models.values():
            if model.state == "failed":
                logger.critical("%s failed to start: %s", model.name, model.error)
            elif model.state == "loaded":
                logger.info("%s is ready (%.1f s)", model.name, time.monotonic() - started)
        failed = self.failed
        if failed is not None:
            for callback in self.on_dead:
                callback(EngineError(f"the engine failed to start: {failed}"))

    def _model_died(self, model: ServedModel, error: EngineDeadError) -> None:
        logger.critical("the engine of %s is dead and will not recover: %s", model.name, error)
        if all(m.state in ("dead", "failed") for m in self.multi.models.values()):
            self.dead = error
            for callback in self.on_dead:
                callback(error)

    async def close(self) -> None:
        """Close the engines (idempotent): stage processes exit, pending requests end with 503.
        An engine still loading is closed as soon as it has started."""
        if self._closed:
            return
        self._closed = True
        if self.jobs is not None:
            await self.jobs.close()
        # Loaded engines close now; one still loading closes as soon as it has started.
        await asyncio.get_running_loop().run_in_executor(None, self.multi.close)
        if self._starting is not None and not self._starting.done():
            await asyncio.gather(self._starting, return_exceptions=True)
        await self.files.close()

    def abort(self, request_id: str | Sequence[str], reason: BaseException | None = None) -> None:
        """Abort requests of any model (each engine ignores the ids it does not hold)."""
        self.multi.abort(request_id, reason)

    def abort_all(self, reason: str) -> None:
        """Abort every in-flight engine request; their handlers answer 503 with ``reason``.
        Runs on the server's loop (from a timer or a signal)."""
        ids = list(self.inflight)
        if ids and self.serving:
            self.count_aborted("shutdown", ids)
            self.abort(ids, RequestAbortedError(reason))

    def count_aborted(self, reason: str, ids: Iterable[str]) -> None:
        """Count the aborts of the in-flight requests ``ids``, each under its model."""
        for rid in ids:
            if (model := self.inflight.get(rid)) is not None:
                self.metrics.series(self.metrics.aborted, model, reason).inc()

    def engine_of(self, model: ServedModel) -> AsyncOmni:
        """``model``'s engine, or a 503 saying why there is none (still loading, failed, evicted,
        unplaced)."""
        if model.engine is None:
            if model.state == "failed" and not self.several:
                raise EngineError(f"the engine failed to start: {model.error}")
            if model.state == "loading":
                raise ApiError(
                    503, f"{model.name} is loading; retry shortly", type="service_unavailable", code="loading"
                )
            raise model.unavailable()
        unplaced = model.unplaced() if self.several else None
        if unplaced is not None:  # no node can host one of its stages now: fail at once, naming it
            raise ModelUnavailableError(model.name, "unplaced", unplaced)
        return model.engine

    def model(self, name: str | None) -> ServedModel:
        """The served model named ``name`` (any state): a 404 naming the served models for an
        unknown one; a 400 naming ``model`` when several are served and none is named."""
        try:
            return self.multi.model(name)
        except UnknownModelError as e:
            raise ApiError(404, str(e), param="model", code="model_not_found") from None

    def check_draining(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")

    async def serve(self, model: ServedModel, leases: list[ServedModel] | None) -> ModelHandle:
        """``model`` ready to run a request: its handle, with the engine held in ``leases`` (the
        HTTP request's: given back when it ends, see :meth:`holding`) so that the budget does not
        evict it meanwhile; None holds it only while the engine has the request. A model declared
        lazy, or evicted, is brought back first (waiting at most the load timeout); one still in
        its first load at start is a 503 ``loading``."""
        was, waited = model.state, time.time()
        if not model.starting and was in ("unloaded", "asleep", "loading", "loaded"):
            held = await self.multi.acquire(model.name)
            if leases is not None:
                leases.append(held)
            else:  # nothing would give it back: the engine's own pending count guards it from here
                self.multi.release(held)
        loaded = None
        if was in ("unloaded", "asleep"):
            loaded = {"model": model.name, "from": was, "loaded_s": round(time.time() - waited, 3)}
        return ModelHandle(model, self.engine_of(model), loaded)

    @contextlib.asynccontextmanager
    async def holding(self) -> AsyncIterator[list[ServedModel]]:
        """The leases of one HTTP request (the middleware puts them in its scope as
        :data:`LEASES`): the models :meth:`serve` held for it are given back when the block ends."""
        leases: list[ServedModel] = []
        try:
            yield leases
        finally:
            for model in leases:
                self.multi.release(model)

    async def job_model(self, name: str | None) -> ModelHandle:
        """The model a job recorded for ``name`` runs on when taken over: with one model served,
        that one (a job store shared by gateways of one model under other names)."""
        return await self.serve(self.model(name if self.several else None), None)

    def authorized(self, scope: Scope) -> bool:
        """Whether the request carries the API key (always, when none is set): an
        ``Authorization: Bearer`` header, or, for a WebSocket (a browser's cannot set that header),
        a subprotocol it offers of :data:`KEY_SUBPROTOCOL` then the key (OpenAI Realtime's way)."""
        if self.api_key is None:
            return True
        offered: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
            if name == b"sec-websocket-protocol" and scope["type"] == "websocket":
                offered += [p.strip() for p in value.split(b",")]
        prefix = KEY_SUBPROTOCOL.encode()
        return any(p.startswith(prefix) and hmac.compare_digest(p[len(prefix) :], self.api_key) for p in offered)

    def check_auth(self, scope: Scope) -> None:
        if self.authorized(scope):
            return
        raise ApiError(
            401, "a valid API key is required: send 'Authorization: Bearer <key>'",
            type="authentication_error", code="invalid_api_key",
        )  # fmt: skip

    # ------------------------------------------------------------------ running requests

    async def collect(self, model: ModelHandle, request: ValidRequest, request_id: str) -> OmniRequestOutput:
        """Run one validated engine request on ``model`` to its end; its metrics go to Prometheus."""
        last = None
        self.inflight[request_id] = model.name
        try:
            async for out in model.engine.generate(request, request_id=request_id):
                last = out
        finally:
            self.inflight.pop(request_id, None)
        self.metrics.observe_output(last, model.name)
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
            self.count_aborted("client_disconnect", live)
            self.abort(live)  # no engine holds them before the engines started
            raise ClientDisconnected()
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                # Let the generators run their clean-up before the caller moves on.
                await asyncio.wait((task,))
