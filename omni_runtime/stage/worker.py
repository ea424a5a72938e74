"""StageWorker: one replica of a stage. Runs on an asyncio loop in the stage process, or in the
orchestrator's process for ``runtime.process: false`` (the in-process client).

Transport-agnostic: messages come in through :meth:`StageWorker.handle`, and everything it says
goes out through the ``send`` callback. The runner's ``execute`` runs in a single executor
thread, so aborts and control calls are answered while a forward is running.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import (
    InvalidRequestError,
    OmniError,
    RpcError,
    StageAsleepError,
    StageExecutionError,
)
from omni_runtime.messages import (
    ErrorInfo,
    Payload,
    StageAbort,
    StageOutput,
    StageOutputs,
    StagePing,
    StagePong,
    StageReady,
    StageRequest,
    StageRpc,
    StageRpcResult,
)
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, runner_class
from omni_runtime.stage.scheduler import RequestScheduler, Wave
from omni_runtime.tasks import BackgroundTasks

logger = logging.getLogger(__name__)


class StageWorker:
    """Owns a runner and a scheduler; turns stage messages into fused forwards."""

    def __init__(
        self,
        stage: StageConfig,
        replica_id: int,
        send: Callable[[Any], None],
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.stage = stage
        self.stage_id = stage.stage_id
        self.replica_id = replica_id
        self._send = send
        #: Called if the scheduling loop dies (a bug, e.g. a runner returning too few outputs):
        #: a replica that still answers pings but never runs a wave again must be replaced.
        self._on_fatal = on_fatal
        self.runner = runner_class(stage.stage_type)(stage)
        self.runner.replica_id = replica_id
        args = stage.engine_args
        self.scheduler = RequestScheduler(
            max_num_seqs=args.max_num_seqs,
            max_wait_ms=args.request_batch_max_wait_ms,
            max_queue_len=args.max_queue_len,
            policy=args.scheduling_policy,
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{self.stage_id}-forward")
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._rpc_tasks = BackgroundTasks()
        self._released: set[str] = set()  # aborted while running: caller already answered
        #: The one truth about sleep: set before the model is freed, cleared once it is back, so
        #: no wave ever runs on a freed model and every request meanwhile gets StageAsleepError.
        self._asleep = False
        self._closed = False
        self._served = 0
        self._failed = 0
        #: When the running forward last made progress (``time.monotonic()``, written by the
        #: forward thread); None while no forward runs. Reported in every pong.
        self._progress_at: float | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> StageReady:
        """Load the model (in the executor thread) and start the scheduling loop."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.runner.load)
        # A hard cap: neither the config nor a later set_batching can lift it.
        self.scheduler.set_batch_cap(self.runner.max_batch_size)
        self._loop_task = asyncio.create_task(self._run(), name=f"stage{self.stage_id}-loop")
        self._loop_task.add_done_callback(self._on_loop_done)
        return StageReady(
            stage_id=self.stage_id, replica_id=self.replica_id, pid=os.getpid(), constraints=self.runner.constraints()
        )

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass  # a loop that died was reported by _on_loop_done
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _on_loop_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        logger.critical("stage %d: the scheduling loop died", self.stage_id, exc_info=exc)
        if self._on_fatal is not None:
            self._on_fatal(exc)

    # ------------------------------------------------------------------ inbound

    def handle(self, msg: Any) -> None:
        """Dispatch one inbound message. Never raises: a bad message is logged and dropped."""
        try:
            if isinstance(msg, StageRequest):
                self._add(msg)
            elif isinstance(msg, StageAbort):
                for rid in msg.request_ids:
                    self._abort(rid)
            elif isinstance(msg, StageRpc):
                self._rpc_tasks.spawn(self._rpc(msg))
            elif isinstance(msg, StagePing):
                stalled = None if self._progress_at is None else time.monotonic() - self._progress_at
                self._emit(StagePong(seq=msg.seq, stalled_s=stalled))
            else:  # StageShutdown is the process's to act on, and never reaches here
                logger.warning("stage %d: dropped unexpected message %r", self.stage_id, type(msg).__name__)
        except Exception:
            logger.exception("stage %d: failed to handle %s", self.stage_id, type(msg).__name__)

    def _add(self, msg: StageRequest) -> None:
        req = RunnerRequest(
            request_id=msg.request_id, prompt=msg.prompt, params=dict(msg.params), inputs=dict(msg.inputs)
        )
        try:
            if self._asleep:
                raise StageAsleepError(f"stage {self.stage_id} is asleep; call collective_rpc('wake_up')")
            key = self.runner.batch_key(req)
            self.scheduler.add(msg.request_id, key, req)
        except OmniError as e:
            self._emit(StageOutput(request_id=msg.request_id, error=ErrorInfo.from_exception(e, self.stage_id)))
            return
        except Exception as e:  # batch_key choked on the params: this request's bad input
            err = InvalidRequestError(f"stage {self.stage_id} cannot take this request: {e}")
            self._emit(StageOutput(request_id=msg.request_id, error=ErrorInfo.from_exception(err, self.stage_id)))
            return
        self._wake.set()

    def _abort(self, rid: str) -> None:
        where = self.scheduler.abort(rid)
        if where == "running":
            # The forward notices at its next step; the caller was already answered upstream.
            self._released.add(rid)
        elif where == "waiting":
            self._wake.set()

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        """1) ask the scheduler  2) wait for an arrival or the admission deadline  3) run a wave."""
        while not self._closed:
            self._wake.clear()
            decision = self.scheduler.schedule()
            if isinstance(decision, Wave):
                await self._run_wave(decision)
                continue
            timeout = None if decision is None else max(0.0, decision - time.monotonic())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    async def _run_wave(self, wave: Wave) -> None:
        loop = asyncio.get_running_loop()
        batch: list[RunnerRequest] = list(wave.payloads)
        start = time.perf_counter()
        try:
            if self._asleep:
                err = StageAsleepError(f"stage {self.stage_id} is asleep")
                outputs = [RunnerOutput(error=err) for _ in batch]
            else:
                outputs = await self._execute(loop, batch)
        finally:
            self.scheduler.finish(wave.batch_id)
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        done: list[StageOutput] = []
        for req, out in zip(batch, outputs, strict=True):
            rid = req.request_id
            if rid in self._released:
                self._released.discard(rid)
                continue
            metrics = {
                "queue_wait_ms": wave.queue_wait_ms.get(rid, 0.0),
                "admission_wait_ms": wave.admission_wait_ms.get(rid, 0.0),
                "batch_size": len(batch),
                "batch_id": wave.batch_id,
                "execution_ms": elapsed_ms,
                "replica_id": self.replica_id,
                **out.metrics,
            }
            if out.error is None:
                self._served += 1
            else:
                self._failed += 1
            done.append(
                StageOutput(
                    request_id=rid,
                    payload=Payload(text=out.text, images=out.images, tensors=out.tensors, metrics=metrics),
                    error=None if out.error is None else ErrorInfo.from_exception(out.error, self.stage_id),
                )
            )
        if done:
            self._emit(StageOutputs(outputs=done) if len(done) > 1 else done[0])

    async def _execute(self, loop: asyncio.AbstractEventLoop, batch: list[RunnerRequest]) -> list[RunnerOutput]:
        """One fused forward; if it raises, each request again alone so only the culprit fails."""

        def is_aborted(rid: str) -> bool:
            # Called between steps: each call is also a sign that the forward is not stuck.
            self._progress_at = time.monotonic()
            # Closing aborts everything: the forward thread must stop for the process to exit,
            # even after close() has cancelled the wave's bookkeeping under it.
            return self._closed or self.scheduler.is_aborted(rid)

        def emit(rid: str, part: RunnerOutput) -> None:
            self._progress_at = time.monotonic()
            loop.call_soon_threadsafe(self._emit_partial, rid, part)

        ctx = ExecuteContext(is_aborted=is_aborted, emit=emit)
        self._progress_at = time.monotonic()
        try:
            if self.runner.runs_inline(batch):
                # Cheap enough to run on the loop: saves two thread hops per wave.
                return self.runner.execute(batch, ctx)
            return await loop.run_in_executor(self._executor, self.runner.execute, batch, ctx)
        except Exception as e:
            if len(batch) == 1:
                logger.warning("stage %d: request %s failed: %s", self.stage_id, batch[0].request_id, e)
                if not isinstance(e, OmniError):  # a typed error (asleep, bad input) keeps its type
                    e = StageExecutionError(f"{type(e).__name__}: {e}", stage_id=self.stage_id)
                return [RunnerOutput(error=e)]
            logger.warning(
                "stage %d: fused forward of %d failed (%s); retrying one by one", self.stage_id, len(batch), e
            )
        finally:
            self._progress_at = None
        outputs = []
        for req in batch:
            outputs.extend(await self._execute(loop, [req]))
        return outputs

    def _emit_partial(self, rid: str, part: RunnerOutput) -> None:
        if rid not in self._released:
            payload = Payload(text=part.text, images=part.images, tensors=part.tensors, metrics=part.metrics)
            self._emit(StageOutput(request_id=rid, finished=False, payload=payload))

    def _emit(self, msg: Any) -> None:
        """Send ``msg``. One that cannot be encoded (a runner's text with a lone surrogate, an int
        past 64 bits in its metrics) becomes an error for its request or call, so nothing waits
        for an answer that was never sent."""
        try:
            self._send(msg)
        except msgspec.EncodeError as e:
            if isinstance(msg, StageOutputs):
                for out in msg.outputs:  # find the one that cannot travel; the rest go on
                    self._emit(out)
                return
            logger.error("stage %d: cannot send %s: %s", self.stage_id, type(msg).__name__, e)
            if isinstance(msg, StageOutput) and msg.error is None:
                if not msg.finished:
                    self._released.add(msg.request_id)  # the rest of this request is not sent
                err = StageExecutionError(f"the stage's output cannot be sent: {e}", stage_id=self.stage_id)
                self._emit(StageOutput(request_id=msg.request_id, error=ErrorInfo.from_exception(err, self.stage_id)))
            elif isinstance(msg, StageRpcResult) and msg.error is None:
                err = RpcError(f"the result cannot be sent: {e}")
                self._emit(StageRpcResult(call_id=msg.call_id, error=ErrorInfo.from_exception(err, self.stage_id)))
        except Exception:
            logger.exception("stage %d: could not send %s", self.stage_id, type(msg).__name__)

    # ------------------------------------------------------------------ control calls

    async def _rpc(self, msg: StageRpc) -> None:
        try:
            result = await self._call(msg.method, list(msg.args), dict(msg.kwargs))
            reply = StageRpcResult(call_id=msg.call_id, result=result)
        except Exception as e:
            err = e if isinstance(e, OmniError) else RpcError(f"{type(e).__name__}: {e}")
            reply = StageRpcResult(call_id=msg.call_id, error=ErrorInfo.from_exception(err, self.stage_id))
        self._emit(reply)

    async def _call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        loop = asyncio.get_running_loop()
        if method == "ping":
            return {"pid": os.getpid(), "stage_id": self.stage_id, "replica_id": self.replica_id}
        if method == "get_stats":
            return self.stats()
        if method == "set_batching":
            return self._set_batching(**kwargs)
        if method == "sleep":
            # Asleep first: from now on requests are refused and waves not yet begun fail with
            # StageAsleepError. The release runs on the forward thread, after the running wave.
            self._asleep = True
            result = await loop.run_in_executor(self._executor, self.runner.sleep)
            gc.collect()
            return {"asleep": True, **(result or {})}
        if method == "wake_up":
            # Awake only once the model is back: requests meanwhile still get StageAsleepError.
            result = await loop.run_in_executor(self._executor, self.runner.wake_up)
            self._asleep = False
            self._wake.set()
            return {"asleep": False, **(result or {})}
        handler = getattr(self.runner, f"rpc_{method}", None)
        if handler is None:
            raise RpcError(f"unknown control method {method!r}")
        return await loop.run_in_executor(self._executor, lambda: handler(*args, **kwargs))

    def _set_batching(
        self, max_num_seqs: int | None = None, request_batch_max_wait_ms: float | None = None
    ) -> dict[str, Any]:
        if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
            raise InvalidRequestError(f"max_num_seqs: expected int >= 1, got {max_num_seqs!r}", param="max_num_seqs")
        if request_batch_max_wait_ms is not None and (
            not isinstance(request_batch_max_wait_ms, int | float) or request_batch_max_wait_ms < 0
        ):
            raise InvalidRequestError(
                f"request_batch_max_wait_ms: expected a number >= 0, got {request_batch_max_wait_ms!r}",
                param="request_batch_max_wait_ms",
            )
        self.scheduler.set_config(max_num_seqs=max_num_seqs, max_wait_ms=request_batch_max_wait_ms)
        self._wake.set()
        # max_num_seqs as applied: never above what the runner declared it can take.
        return {
            "max_num_seqs": self.scheduler.max_num_seqs,
            "request_batch_max_wait_ms": self.scheduler.max_wait_ms,
            "max_batch_size": self.runner.max_batch_size,
        }

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        return {
            "stage_id": self.stage_id,
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "requests_served": self._served,
            "requests_failed": self._failed,
            "queue_len": s.get("num_waiting", 0),
            "running": s.get("num_running", 0),
            "batch_size_histogram": {str(k): v for k, v in s.get("batch_size_histogram", {}).items()},
            "waves": s.get("waves", 0),
            "asleep": self._asleep,
            # What torch really runs with (OMP_NUM_THREADS set by the stage process); None if unused.
            "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
        }
