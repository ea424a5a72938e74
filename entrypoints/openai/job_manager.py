"""The job manager: runs ``/v1/generate`` jobs on the engine and records what happens to them.
Runs on the server's event loop.

A job is one engine request. It is admitted into the engine before the job is stored (so a full
engine is a 429 at once, not a job that fails later), and a task per job then follows the engine's
outputs, read as typed events (``omni_runtime.events``): ``Progress`` becomes a ``step`` event, each
``StageDone`` a ``stage_done`` event and two trace spans, ``Final``'s output the result. ``queued``
and ``started`` frame it; ``completed``, ``failed`` or ``cancelled`` end it. Every event goes to the
job store, which also holds the record (status, progress, result, error, timings, trace), so any
gateway on the same store can answer.

Ownership (a shared store): the gateway that runs a job owns it. A cancel from another gateway is
a signal to the owner (the store's cancel channel). A gateway that died (its lease ran out) has its
unfinished jobs claimed by a live one, which re-queues each once (``requeued`` event); a job
whose second run is lost too fails with ``gateway_lost``. Every write of a running job is fenced
with (this gateway, the job's attempt): once another gateway claimed the job, this one's writes
are refused and it drops the job quietly (aborts its engine request, writes nothing).

Outages: a progress event that cannot be written is dropped (the next write carries the record's
state); a job's end is kept until the store takes it, retried with backoff, and written once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omni_runtime.events import Event as EngineEvent
from omni_runtime.events import Final, Progress, StageDone, events_of
from omni_runtime.exceptions import RequestAbortedError, UnavailableError

from ..async_omni import ValidRequest
from ..jobs.record import JobRecord
from ..jobs.store import (
    TERMINAL,
    Backoff,
    Event,
    Fence,
    JobFencedError,
    JobStore,
    JobStoreUnavailableError,
    StreamBudgetError,
)
from ..jobs.tracing import OtlpExporter, span, stage_spans
from ..tasks import TASKS, FileSink, kind_of
from ..tasks.generate import job_result, renderer_of, validate_job
from .job_end import RECORD_RETRY_S, JobEnds, error_of
from .protocol import ApiError, GenerateRequest

if TYPE_CHECKING:
    from .state import ModelHandle, ServerState

logger = logging.getLogger(__name__)

#: How many times a job lost with its gateway runs again (then it fails with ``gateway_lost``).
MAX_REQUEUES = 1
#: How long ``DELETE`` waits for the job to end before answering with it as it is.
CANCEL_WAIT_S = 10.0

#: A job id: ``job-`` and the 24 characters of ``secrets.token_urlsafe(18)`` (see ``submit``).
_JOB_ID = re.compile(r"job-[A-Za-z0-9_-]{24}")


@dataclass(frozen=True)
class JobSettings:
    """The job options of ``serve`` (docs/jobs.md)."""

    #: ``redis://...``: the Redis job store (gateways share jobs); None: in memory.
    redis_url: str | None = None
    #: How long a finished job (record, events, result) is kept, seconds.
    ttl_s: float = 3600.0
    #: Most jobs the in-memory store holds (finished ones are dropped oldest first).
    max_jobs: int = 10_000
    #: A gateway's lease in the Redis store: this long after its last heartbeat it counts as dead.
    lease_s: float = 10.0
    #: OTLP/HTTP traces endpoint (``http://host:4318`` or ``.../v1/traces``); None: no export.
    otlp_endpoint: str | None = None
    #: Clients that may wait on job events at once (SSE, WebSocket, ``async_run: false``); past
    #: it a new one is a 503 with ``Retry-After``.
    max_streams: int = 256
    #: Connections of each Redis pool (client reads; job-state writes). Blocking reads use one
    #: more connection, shared by every waiting client.
    redis_connections: int = 16
    #: Timeout of every Redis call, seconds (connect, read, waiting for a pooled connection).
    redis_timeout_s: float = 2.0


class _LocalJob:
    """A job this gateway runs: its engine request, the fence of its writes (this gateway, its
    attempt), whether a cancel was asked for, and whether it was dropped (claimed elsewhere)."""

    __slots__ = ("cancelled", "dropped", "fence", "job_id", "model", "request_id", "started", "task", "unwritten")

    def __init__(self, job_id: str, fence: Fence, model: str = "") -> None:
        self.job_id, self.fence, self.model = job_id, fence, model
        self.request_id = f"{job_id}-{fence[1]}"
        self.cancelled = False
        self.dropped = False
        self.started = False
        self.task: asyncio.Task | None = None
        #: Record fields of progress events the store did not take (it was unreachable): the
        #: next write carries them, so a dropped ``started`` does not leave the job ``queued``.
        self.unwritten: dict[str, Any] = {}


class _StreamSlot:
    """One of the gateway's ``max_streams`` event waiters; released once, however often asked."""

    __slots__ = ("_manager",)

    def __init__(self, manager: JobManager) -> None:
        self._manager: JobManager | None = manager

    def release(self) -> None:
        if self._manager is not None:
            self._manager.streams -= 1
            self._manager = None


class JobManager:
    """Jobs of one gateway (``gateway_id``) over ``store``; see the module docstring."""

    def __init__(
        self,
        state: ServerState,
        store: JobStore,
        *,
        lease_s: float = 10.0,
        otlp: OtlpExporter | None = None,
        max_streams: int = 256,
    ) -> None:
        self.state, self.store, self.lease_s, self.otlp = state, store, lease_s, otlp
        self.gateway_id = "gw-" + secrets.token_urlsafe(9)
        self.max_streams, self.streams = max_streams, 0
        self._local: dict[str, _LocalJob] = {}
        self._background: asyncio.Task | None = None
        self._closing = False
        #: How jobs end: their end written once, kept through store outages.
        self.ends = JobEnds(store, self.gateway_id, otlp, on_recorded=self._count)

    def _count(self, status: str, model: str) -> None:
        """One more job of ``model`` reached ``status`` (``omni_runtime_jobs_total``)."""
        self.state.metrics.series(self.state.metrics.jobs, model, status).inc()

    def active(self) -> dict[str, int]:
        """The jobs this gateway runs now: ``queued`` (waiting for their first stage) and ``running``."""
        running = sum(1 for job in self._local.values() if job.started)
        return {"queued": len(self._local) - running, "running": running}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.store.start(self.gateway_id, self._remote_cancel)
        if self.store.backend != "memory":
            self._background = asyncio.create_task(self._keep_lease(), name="job-lease")

    async def _keep_lease(self) -> None:
        """1) renew the lease, and drop jobs claimed elsewhere if it had run out (this process
        was paused, or the store was unreachable, past the lease)  2) renew the TTL of running
        jobs  3) recover dead gateways' jobs, once the store has answered for a whole lease.

        After an outage longer than the lease every gateway's lease has run out, the live ones'
        too: a gateway claims nothing until the store has answered its heartbeats for one lease
        since, so each live gateway has renewed its own lease by then and keeps its jobs."""
        beats = 0
        last = time.monotonic()
        reachable_since: float | None = last - self.lease_s  # at start: recover at once
        while True:
            try:
                now = time.monotonic()
                paused = now - last > self.lease_s
                last = now
                if not await self.store.heartbeat() or paused:
                    await self._drop_claimed_elsewhere()
                if reachable_since is None:
                    reachable_since = now
                if beats % 3 == 0:
                    keep_alive = getattr(self.store, "keep_alive", None)
                    if keep_alive is not None:
                        await keep_alive(list(self._local))
                    # Recovered jobs need a running engine.
                    if self.state.serving and now - reachable_since >= self.lease_s:
                        for job_id in await self.store.claim_orphans():
                            await self._recover(job_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                reachable_since = None
                logger.warning("job store heartbeat failed: %s", e)
            beats += 1
            await asyncio.sleep(self.lease_s / 3)

    async def _drop_claimed_elsewhere(self) -> None:
        """Jobs this gateway runs whose record names another owner or attempt: drop each."""
        for job in list(self._local.values()):
            record = await self.store.get(job.job_id)
            if record is None or (record.get("owner"), record.get("attempts")) != job.fence:
                self._drop(job)

    def _drop(self, job: _LocalJob) -> None:
        """Stop running a job another gateway now owns, writing nothing."""
        if not job.dropped:
            job.dropped = True
            logger.warning("job %s is owned elsewhere now; dropping this gateway's run", job.job_id)
            self.state.abort(job.request_id, RequestAbortedError(f"job {job.job_id} was claimed elsewhere"))

    def stream_slot(self) -> _StreamSlot:
        """A place for one more client waiting on events, or StreamBudgetError (503)."""
        if self.streams >= self.max_streams:
            raise StreamBudgetError(
                f"this gateway serves {self.max_streams} event streams already; retry later", retry_after_s=2.0
            )
        self.streams += 1
        return _StreamSlot(self)

    async def close(self) -> None:
        """Stop following jobs. In memory, unfinished jobs fail (``shutdown``); in a shared store
        they stay owned by this gateway, whose lease is dropped: the next gateway recovers them."""
        self._closing = True
        if self._background is not None:
            self._background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._background
        await self.ends.close()
        jobs = list(self._local.values())
        for job in jobs:
            if job.task is not None:
                job.task.cancel()
        await asyncio.gather(*(j.task for j in jobs if j.task is not None), return_exceptions=True)
        if self.otlp is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.otlp.close)
        await self.store.close()

    # ------------------------------------------------------------------ submit

    async def submit(
        self, body: GenerateRequest, base_url: str, model: ModelHandle, traceparent: str | None = None
    ) -> dict[str, Any]:
        """Admit a job on ``model`` and store it; returns its record (``queued``). Raises the
        engine's admission errors (400, 429, 503) before anything is stored. A model that was not
        loaded (lazy, or evicted by the budget) when the request came was brought back by its
        route's dependency: ``model.loaded`` says from what and how long it took (the job's
        ``loading`` event)."""
        valid = await validate_job(model, body)
        job_id = "job-" + secrets.token_urlsafe(18)
        now = time.time()
        record = JobRecord(
            job_id=job_id,
            task=body.task,
            model=model.name,
            priority=body.priority,
            created_at=now,
            owner=self.gateway_id,
            request=body.model_dump(mode="json", exclude={"async_run"}),
            base_url=base_url,
            traceparent=traceparent,
        )
        await self._launch(record, model, valid, new=True, loading=model.loaded)
        return record.public()

    async def _launch(
        self,
        record: JobRecord,
        model: ModelHandle,
        valid: ValidRequest,
        *,
        new: bool,
        loading: dict[str, Any] | None = None,
    ) -> None:
        job_id = record.job_id
        job = _LocalJob(job_id, (self.gateway_id, record.attempts), model.name)
        omni = model.engine
        agen = omni.generate(valid, request_id=job.request_id)
        first = asyncio.ensure_future(agen.__anext__())
        # The engine admits the request in the generator's first step, which runs now: a full
        # engine or a bad request fails here, before the job exists anywhere.
        await asyncio.sleep(0)
        if first.done() and first.exception() is not None:
            await _close(agen, first)
            raise first.exception()  # type: ignore[misc]
        self._local[job_id] = job
        admitted = time.time()
        record.trace = [span("admission", record.created_at, admitted, job_id=job_id)]
        try:
            event = {"job_id": job_id, "priority": record.priority, "attempt": record.attempts, "at": time.time()}
            if new:
                await self.store.create(record.to_store(), ("queued", event), kind=kind_of(record.task))
            else:
                await self.store.append_event(
                    job_id, "queued", event, {"status": "queued", "trace": record.trace}, fence=job.fence
                )
        except Exception:
            self._local.pop(job_id, None)
            omni.abort(job.request_id)
            await _close(agen, first)
            raise
        self._count("queued", job.model)
        if loading is not None:
            await self._emit(job, "loading", loading)
        job.task = asyncio.create_task(self._follow(job, record, agen, first), name=f"job-{job_id}")

    # ------------------------------------------------------------------ following a job

    async def _emit(
        self, job: _LocalJob, type: str, data: dict[str, Any], fields: dict[str, Any] | None = None
    ) -> None:
        """Append a progress event stamped with the gateway's clock (``at``, epoch seconds),
        fenced with the job's owner and attempt. An unreachable store drops it (the job's end is
        what must be recorded); a refused write (JobFencedError) is raised: the job is not ours."""
        fields = {**job.unwritten, **(fields or {})}
        try:
            await self.store.append_event(job.job_id, type, {**data, "at": time.time()}, fields, fence=job.fence)
        except JobStoreUnavailableError as e:
            logger.debug("job %s: %s event dropped: %s", job.job_id, type, e)
            job.unwritten = fields
        else:
            job.unwritten = {}

    async def _follow(self, job: _LocalJob, record: JobRecord, agen: AsyncIterator[Any], first: Any) -> None:
        job_id = job.job_id
        seen: set[int] = set()
        last = None  # the latest output: a failed job's timings read what it had delivered
        try:
            out = await first
            while True:
                last = out
                events = events_of(out)
                for event in events:
                    await self._observe(job, record, event, seen)
                match events:
                    case (*_, Final(output=final)):  # the request's end is its output's last event
                        break
                out = await agen.__anext__()
            self.state.metrics.observe_output(final, job.model)
            result = await self._result(record, final)
            await self.ends.end(job, record, "completed", result=result, out=final)
        except JobFencedError as e:
            # Claimed by another gateway (this one was paused or cut off past its lease), or ended
            # already: nothing of this run is written.
            logger.warning("job %s: %s; dropping this gateway's run", job_id, e)
            self._drop(job)
        except asyncio.CancelledError:
            # The gateway is stopping. In memory nobody could finish the job later.
            if self.store.backend == "memory" and self.state.serving:
                self.state.abort(job.request_id)
                with contextlib.suppress(Exception):
                    error = {"message": "the server shut down before the job finished", "code": "shutdown"}
                    await asyncio.shield(self.ends.end(job, record, "failed", error=error))
            raise
        except Exception as e:
            if job.dropped:
                return
            status = "cancelled" if job.cancelled and isinstance(e, RequestAbortedError) else "failed"
            await self.ends.end(job, record, status, error=None if status == "cancelled" else error_of(e), out=last)
        finally:
            self._local.pop(job_id, None)
            with contextlib.suppress(Exception):
                await agen.aclose()  # type: ignore[attr-defined]

    async def _started(
        self, job: _LocalJob, record: JobRecord, batch_id: Any, batch_size: Any, at: float | None = None
    ) -> None:
        job.started = True
        record.started_at = max(record.created_at, at or time.time())
        record.status = "running"
        await self._emit(
            job,
            "started",
            {"batch_id": batch_id, "batch_size": batch_size},
            {"status": "running", "started_at": record.started_at},
        )
        self._count("running", job.model)

    async def _observe(self, job: _LocalJob, record: JobRecord, event: EngineEvent, seen: set[int]) -> None:
        """One engine event: a denoising step (a ``step`` event), or a stage done, an inner one or
        a final one with its result (a ``stage_done`` event); streamed pieces say nothing here."""
        match event:
            case Progress(stage=sid, step=n, steps=steps):
                if not job.started:
                    # A progress event says nothing of its wave (its batch comes with the result).
                    await self._started(job, record, None, None)
                step = {"stage_id": sid, "step": n, "steps": steps}
                record.progress = step
                await self._emit(job, "step", step, {"progress": step})
                return
            case StageDone(stage=sid, metrics=m, result=result) if result is None or m:
                inner = result is None
            case _:
                return
        if sid in seen:
            return
        seen.add(sid)
        now = time.time()
        if not job.started:
            # No progress output came first (a stage that reports no steps): the wave began
            # execution_ms before its output arrived.
            ran = m.get("execution_ms")
            at = now - ran / 1000.0 if isinstance(ran, int | float) else None
            await self._started(job, record, m.get("batch_id"), m.get("batch_size"), at)
        spans = stage_spans(sid, now, m)
        for s in spans:  # clocks: never before the job existed
            s["start"] = max(s["start"], record.created_at)
        record.trace.extend(spans)
        done = {
            "stage_id": sid,
            "batch_id": m.get("batch_id"),
            "batch_size": m.get("batch_size"),
            "queue_wait_ms": m.get("queue_wait_ms"),
            "execution_ms": m.get("execution_ms"),
        }
        if inner:
            self.state.metrics.observe_stage(sid, m, job.model)  # final stages are observed with the result
        await self._emit(job, "stage_done", done, {"trace": record.trace})

    def _files_base(self, record: JobRecord) -> str:
        """The URL of the gateway that stores a job's files: the configured public URL, else the
        one the job was submitted through, unless another gateway took the job over (its own)."""
        if self.state.public_url is not None:
            return self.state.public_url
        local = self.state.local_url
        return local if record.attempts > 1 and local is not None else record.base_url.rstrip("/")

    async def _result(self, record: JobRecord, out: Any) -> dict[str, Any]:
        """The job's result, rendered by its task (tasks/generate.py); its files go to the file
        store through :meth:`_put_file` and are served under :meth:`_files_base`."""
        request = GenerateRequest.model_validate(record.request | {"async_run": True})
        task = TASKS[request.task]
        start = time.time()
        sink = FileSink(functools.partial(self._put_file, record.job_id), self._files_base(record))
        result = await job_result(task, out, request, sink)
        key = renderer_of(task).key
        made = len(result[key])
        if task.kind == "image":
            self.state.metrics.series(self.state.metrics.images, record.model or "").inc(made)
        record.trace.append(span("encode", start, time.time(), **{key: made}, format=result["output_format"]))
        return result

    async def _put_file(self, job_id: str, blob: bytes, media_type: str) -> str:
        """Store a result file, waiting out an unreachable file store (Redis) with backoff: the
        job's result is kept until it can be stored, like its end (job_end.py), never
        turned into a failure by an outage."""
        backoff = Backoff(*RECORD_RETRY_S)
        while True:
            try:
                return await self.state.files.put(blob, media_type)
            except UnavailableError as e:
                if backoff.delay == backoff.first:
                    logger.warning("job %s: its result waits for the file store (%s)", job_id, e)
                await backoff.wait()

    # ------------------------------------------------------------------ cancel

    def _cancel_local(self, job: _LocalJob) -> None:
        if not job.cancelled and self.state.serving:
            job.cancelled = True
            self.state.metrics.series(self.state.metrics.aborted, job.model, "job_cancel").inc()
            self.state.abort(job.request_id, RequestAbortedError(f"job {job.job_id} was cancelled"))

    def _remote_cancel(self, job_id: str) -> None:
        job = self._local.get(job_id)
        if job is not None:
            self._cancel_local(job)

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job wherever it runs; the job as it is once it ended (or after CANCEL_WAIT_S).
        A finished job is returned as it is: cancelling it again is no error."""
        record = await self.get_record(job_id)
        if record.status in TERMINAL:
            return record.public()
        job = self._local.get(job_id)
        if job is not None:
            self._cancel_local(job)
        else:
            await self.store.signal_cancel(record.to_store())
        deadline = time.monotonic() + CANCEL_WAIT_S
        async for _ in self.follow(job_id, None, keepalive_s=max(0.05, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                break
        return await self.get(job_id)

    # ------------------------------------------------------------------ reading

    async def get_record(self, job_id: str) -> JobRecord:
        # Only the form ``submit`` makes reaches the store: another key of the store (the job's
        # ``...:events`` stream, say) is not a job.
        if not _JOB_ID.fullmatch(job_id):
            raise _not_found(job_id)
        stored = await self.store.get(job_id)
        if stored is None:
            raise _not_found(job_id)
        return JobRecord.from_store(stored)

    async def get(self, job_id: str) -> dict[str, Any]:
        return (await self.get_record(job_id)).public()

    async def follow(self, job_id: str, after: str | None, *, keepalive_s: float = 15.0) -> AsyncIterator[Event | None]:
        """The job's events after ``after`` (None: all), then new ones as they come, until the job
        ends or disappears; ``None`` after ``keepalive_s`` without one (a keep-alive is due)."""
        if after is not None:
            after = self.store.check_event_id(after)
        while True:
            events = await self.store.events(job_id, after)
            if not events:
                record = await self.store.get(job_id)
                if record is None or record["status"] in TERMINAL:
                    # A finished record has its final event already (both are written in one
                    # step), possibly written since the read above: read once more, and that is
                    # all there will be. An expired job has no more events either.
                    events = [] if record is None else await self.store.events(job_id, after)
                    if not events:
                        return
                else:
                    events = await self.store.wait_events(job_id, after, keepalive_s)
                    if not events:
                        yield None
                        continue
            for event in events:
                yield event
                after = event.id
                if event.type in TERMINAL:
                    return

    # ------------------------------------------------------------------ recovery

    async def _recover(self, job_id: str) -> None:
        """A job whose gateway died: run it again here once, else fail it with ``gateway_lost``."""
        stored = await self.store.get(job_id)
        if stored is None or stored["status"] in TERMINAL:
            return
        record = JobRecord.from_store(stored)
        lost = {"message": "the gateway running this job was lost", "code": "gateway_lost"}
        job = _LocalJob(job_id, (self.gateway_id, record.attempts), record.model or "")
        if record.cancel_requested or record.attempts > MAX_REQUEUES:
            status = "cancelled" if record.cancel_requested else "failed"
            await self.ends.end(job, record, status, error=None if status == "cancelled" else lost)
            return
        record.attempts += 1
        record.owner = self.gateway_id
        await self._emit(
            job,
            "requeued",
            {"reason": "gateway_lost", "attempt": record.attempts},
            {"attempts": record.attempts, "status": "queued", "progress": None},
        )
        self._count("requeued", job.model)
        try:
            model = await self.state.job_model(record.model)
            body = GenerateRequest.model_validate(record.request | {"async_run": True})
            valid = await validate_job(model, body)
            await self._launch(record, model, valid, new=False)
        except Exception as e:
            await self.ends.end(job, record, "failed", error=error_of(e))


async def _close(agen: Any, first: asyncio.Future) -> None:
    """Close an engine generator whose first step (``first``) may still run: that step is
    cancelled and awaited first (closing a generator that another task awaits is a RuntimeError)."""
    if not first.done():
        first.cancel()
        await asyncio.wait((first,))
    if not first.cancelled():
        first.exception()  # retrieved: the caller raises it where it is the answer
    with contextlib.suppress(Exception):
        await agen.aclose()


def _not_found(job_id: str) -> ApiError:
    shown = job_id[:64]
    return ApiError(404, f"job `{shown}` does not exist or has expired", param="job_id", code="not_found")
