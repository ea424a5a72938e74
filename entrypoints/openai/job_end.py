"""How a job ends (see job_manager.py): its end event and final record fields (status, result or
error, timings, the trace with its root span, exported over OTLP when configured), written once.
An unreachable store does not lose it: the end is kept and retried with backoff, by one recorder
task, until the store takes it (or refuses it for good: the job ended already, or is another
gateway's). Runs on the server's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ..jobs.record import JobRecord
from ..jobs.store import Backoff, Fence, JobFencedError, JobStore
from ..jobs.tracing import OtlpExporter, span
from .protocol import classify_error

logger = logging.getLogger(__name__)

#: Backoff between tries to record a job's end while the store is unreachable, seconds.
RECORD_RETRY_S = (0.25, 5.0)


class JobEnds:
    """The ends of one gateway's (``gateway_id``) jobs; ``on_recorded(status, model)`` once the
    store took each."""

    def __init__(
        self, store: JobStore, gateway_id: str, otlp: OtlpExporter | None, *, on_recorded: Callable[[str, str], None]
    ) -> None:
        self.store, self.gateway_id, self.otlp, self.on_recorded = store, gateway_id, otlp, on_recorded
        #: Job ends the store did not take yet (it was unreachable): job id -> the write.
        self._unrecorded: dict[str, tuple[str, dict[str, Any], dict[str, Any], Fence, str]] = {}
        self._recorder: asyncio.Task | None = None

    async def close(self) -> None:
        """Stop retrying (ends still unrecorded stay so; a shared store's next gateway recovers them)."""
        if self._recorder is not None:
            self._recorder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recorder

    async def end(
        self,
        job: Any,
        record: JobRecord,
        status: str,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        out: Any = None,
    ) -> None:
        """End ``job`` (a job_manager ``_LocalJob``): its record's final fields and the end event,
        written fenced with the job's owner and attempt; ``out``: the last engine output, if any."""
        now = time.time()
        timings = timings_of(record, out, now)
        root = span(
            "job",
            record.created_at,
            now,
            job_id=job.job_id,
            status=status,
            attempt=record.attempts,
            gateway=self.gateway_id,
        )
        trace = [root, *record.trace]
        trace_id = None
        if self.otlp is not None:
            try:
                trace_id = self.otlp.export(root, record.trace, record.traceparent)
            except Exception as e:  # tracing never fails a job
                logger.warning("job %s: trace export failed: %s", job.job_id, e)
        fields = {
            **job.unwritten,
            "status": status,
            "finished_at": now,
            "result": result,
            "error": error,
            "timings": timings,
            "trace": trace,
            "trace_id": trace_id,
        }
        record.update(fields)
        data: dict[str, Any] = {"job_id": job.job_id, "at": now}
        if result is not None:
            data["result"] = result
        if error is not None:
            data["error"] = error
        await self.record(job.job_id, status, data, fields, job.fence, job.model)

    async def record(
        self, job_id: str, status: str, data: dict[str, Any], fields: dict[str, Any], fence: Fence, model: str = ""
    ) -> bool:
        """Write a job's end; True once the store took it or refused it for good (the job ended
        already, or is another gateway's now). An unreachable store keeps it for the recorder,
        which tries again with backoff until the store is back: the end is never lost, and the
        store takes it once (a write to a finished job is refused)."""
        try:
            await self.store.append_event(job_id, status, data, fields, fence=fence)
        except JobFencedError as e:
            logger.warning("job %s ended %s here, not recorded: %s", job_id, status, e)
            self._unrecorded.pop(job_id, None)
            return True
        except Exception as e:  # unreachable (or failing): kept, never lost
            if job_id not in self._unrecorded:
                logger.warning("job %s ended %s; the store is unreachable (%s): recording it when it is back",
                               job_id, status, e)  # fmt: skip
            self._unrecorded[job_id] = (status, data, fields, fence, model)
            if self._recorder is None or self._recorder.done():
                self._recorder = asyncio.create_task(self._record_pending(), name="job-end-recorder")
            return False
        self._unrecorded.pop(job_id, None)
        self.on_recorded(status, model)
        return True

    async def _record_pending(self) -> None:
        """Retry the unrecorded ends, with backoff, until every one is written."""
        backoff = Backoff(*RECORD_RETRY_S)
        while self._unrecorded:
            await backoff.wait()
            for job_id, (status, data, fields, fence, model) in list(self._unrecorded.items()):
                if not await self.record(job_id, status, data, fields, fence, model):
                    break
            else:
                backoff.reset()


def error_of(exc: BaseException) -> dict[str, Any]:
    status, type_, param, code, message = classify_error(exc)
    error: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code, "status": status}
    retry = getattr(exc, "retry_after_s", None)
    if status in (429, 503) and isinstance(retry, int | float) and not isinstance(retry, bool) and 0 <= retry < 1e9:
        # A stage that refused the request once admitted (shed for its latency target) says when
        # to come back: the synchronous answer passes it on as Retry-After.
        error["retry_after_s"] = round(float(retry), 3)
    return error


def timings_of(record: JobRecord, out: Any, now: float) -> dict[str, Any]:
    timings: dict[str, Any] = {"total_ms": round((now - record.created_at) * 1000.0, 3)}
    if record.started_at:
        timings["queued_ms"] = round((record.started_at - record.created_at) * 1000.0, 3)
    if out is not None:
        for sid, r in sorted(out.outputs_by_stage.items()):
            for key in ("queue_wait_ms", "execution_ms", "batch_size", "batch_id"):
                if key in r.metrics:
                    timings.setdefault("stages", {}).setdefault(str(sid), {})[key] = r.metrics[key]
        if isinstance(out.metrics.get("e2e_ms"), int | float):
            timings["engine_e2e_ms"] = out.metrics["e2e_ms"]
    return timings
