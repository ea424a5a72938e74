"""What the routes share (:class:`ServerState`: the engine, metrics, files, jobs, in-flight
request ids, drain state) and how a route gets it: :func:`get_state` reads ``app.state.omni``.
Runs on the server's event loop."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from starlette.requests import HTTPConnection, Request
from starlette.types import Receive, Scope

from omni_runtime.exceptions import ConfigError, EngineDeadError, EngineError, RequestAbortedError
from omni_runtime.outputs import OmniRequestOutput
from omni_runtime.resolve import ResolvedConfig

from ..async_omni import AsyncOmni, ValidRequest
from ..jobs.store import JobStore, MemoryJobStore
from .files import MAX_REDIS_FILE_BYTES, FileStore, RedisFileStore
from .job_manager import JobManager, JobSettings
from .metrics import ServerMetrics
from .protocol import DISCONNECTED, ApiError, ClientDisconnected

logger = logging.getLogger(__name__)
T = TypeVar("T")


def get_state(conn: HTTPConnection) -> ServerState:
    """The app's :class:`ServerState` (a route dependency; ``create_app`` puts it in ``app.state``)."""
    return conn.app.state.omni


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
        self._max_pending, self._default_timeout = max_pending, default_timeout
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
        self.video_stage = next((s.stage_id for s in finals if s.final_output_type == "video"), None)
        self.audio_stage = next((s.stage_id for s in finals if s.final_output_type == "audio"), None)

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
                None,
                lambda: AsyncOmni(self.resolved, max_pending=self._max_pending, default_timeout=self._default_timeout),
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
            if self.omni is not None:  # None only before the engine started, when nothing runs
                self.omni.abort(live)
            raise ClientDisconnected()
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                # Let the generators run their clean-up before the caller moves on.
                await asyncio.wait((task,))
