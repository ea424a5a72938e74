"""StageWorker: one replica of a stage. Runs on an asyncio loop in the stage process, or in the
orchestrator's process for ``runtime.process: false`` (the in-process client).

Transport-agnostic: messages come in through :meth:`StageWorker.handle`, and everything it says
goes out through the ``send`` callback. The runner's ``execute`` runs in a single executor
thread, so aborts and control calls are answered while a forward is running.

With ``engine_args.step_execution`` and a runner that supports it, the worker drives the denoising
loop itself: a :class:`~omni_runtime.stage.step_scheduler.StepScheduler` plans each step (which key
steps, who joins, who pauses, who is dropped), and each plan runs as one executor call (drop,
admit, one batched step, decode those done). Between steps the loop answers aborts, control calls
and pings, and new requests join at the next boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from omni_runtime.config import StageConfig, check_control_kwargs
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
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StepResult, runner_class
from omni_runtime.stage.scheduler import RequestScheduler, Wave
from omni_runtime.stage.step_scheduler import ProgressThrottle, StepPlan, StepScheduler
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
        #: Request-level waves (the default), or a StepScheduler once start() finds that the runner
        #: can run step by step and ``step_execution`` asks for it.
        self.scheduler: RequestScheduler | StepScheduler = RequestScheduler(
            max_num_seqs=args.max_num_seqs,
            max_wait_ms=args.request_batch_max_wait_ms,
            max_queue_len=args.max_queue_len,
            policy=args.scheduling_policy,
            stable_window_ms=args.batch_quiet_window_ms,
            priority_aging_s=args.priority_aging_s,
        )
        self._step_mode = False
        self._throttle = ProgressThrottle()
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
        args = self.stage.engine_args
        if args.step_execution:
            reason = self.runner.step_support()
            if reason is None:
                self._step_mode = True
                self.scheduler = StepScheduler(
                    args.max_num_seqs, max_queue_len=args.max_queue_len, priority_aging_s=args.priority_aging_s
                )
            else:
                logger.warning(
                    "stage %d: step_execution is on, but requests run with request-level batching: %s",
                    self.stage_id,
                    reason,
                )
        # A hard cap: neither the config nor a later set_batching can lift it.
        self.scheduler.set_batch_cap(self.runner.max_batch_size)
        run = self._run_steps() if self._step_mode else self._run()
        self._loop_task = asyncio.create_task(run, name=f"stage{self.stage_id}-loop")
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
            request_id=msg.request_id,
            prompt=msg.prompt,
            params=dict(msg.params),
            inputs=dict(msg.inputs),
            priority=msg.priority,
        )
        try:
            if self._asleep:
                raise StageAsleepError(f"stage {self.stage_id} is asleep; call collective_rpc('wake_up')")
            if isinstance(self.scheduler, StepScheduler):
                self.scheduler.add(msg.request_id, self.runner.step_key(req), req, priority=req.priority)
            else:
                self.scheduler.add(msg.request_id, self.runner.batch_key(req), req, priority=req.priority)
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
        if self._step_mode:
            # A running request leaves at the next step boundary and nothing more is sent for it
            # (the caller was already answered upstream); the loop may be idle, waiting for work.
            if where is not None:
                self._wake.set()
            return
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
            if "first_step_ms" in out.metrics:  # a runner that reports when its first step ended
                metrics["time_to_first_step_ms"] = metrics["queue_wait_ms"] + out.metrics["first_step_ms"]
            done.append(self._final_output(rid, out, metrics))
        self._emit_outputs(done)

    def _final_output(self, rid: str, out: RunnerOutput, metrics: dict[str, Any]) -> StageOutput:
        # Wall-clock end of this stage's work on the request: with the durations above, a trace
        # places the stage's spans, and the time from here to the next stage is the hand-off.
        metrics["finished_at"] = time.time()
        if out.error is None:
            self._served += 1
        else:
            self._failed += 1
        return StageOutput(
            request_id=rid,
            payload=Payload(text=out.text, images=out.images, tensors=out.tensors, metrics=metrics),
            error=None if out.error is None else ErrorInfo.from_exception(out.error, self.stage_id),
        )

    def _emit_outputs(self, done: list[StageOutput]) -> None:
        """One message for the outputs of one forward: a frame per wave, not per request."""
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

        def progress(ids: list[str], step: int, steps: int) -> None:
            # In the forward thread, at every step: only a due burst costs a thread hop.
            if self._throttle.claim(time.monotonic()):
                loop.call_soon_threadsafe(self._send_progress, ids, step, steps)

        ctx = ExecuteContext(is_aborted=is_aborted, emit=emit, progress=progress)
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

    # ------------------------------------------------------------------ the step loop

    async def _run_steps(self) -> None:
        """1) ask the step scheduler for a plan  2) none: wait for an arrival or an abort
        3) run the plan (drop, admit, one step) in the forward thread  4) send what it finished."""
        while not self._closed:
            self._wake.clear()
            plan = self.scheduler.schedule()
            if plan is None:
                await self._wake.wait()
                continue
            await self._run_step(plan)

    async def _run_step(self, plan: StepPlan) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        assert isinstance(scheduler, StepScheduler)
        failed: dict[str, RunnerOutput] = {}
        results: dict[str, StepResult] = {}
        start = time.perf_counter()
        try:
            if self._asleep:
                # The model is gone (its states with it): every request with state fails now, and
                # any admitted later, until wake_up; new requests are refused meanwhile.
                err = StageAsleepError(f"stage {self.stage_id} is asleep")
                failed = {rid: RunnerOutput(error=err) for rid in scheduler.running_ids()}
            else:
                ctx = self._step_context()
                self._progress_at = time.monotonic()
                failed, results = await loop.run_in_executor(self._executor, self._step_job, plan, ctx)
        except Exception as e:
            # The runner failed as a whole (asleep under us, or a bug): the plan's requests fail.
            logger.warning("stage %d: step %d failed: %s", self.stage_id, plan.step_id, e)
            err = (
                e
                if isinstance(e, OmniError)
                else StageExecutionError(f"{type(e).__name__}: {e}", stage_id=self.stage_id)
            )
            failed = {rid: RunnerOutput(error=err) for rid in dict.fromkeys([*plan.join, *plan.run])}
            with contextlib.suppress(Exception):
                await loop.run_in_executor(self._executor, self.runner.step_drop, list(failed))
        finally:
            self._progress_at = None
        elapsed = time.perf_counter() - start
        finished = [*failed, *(rid for rid, r in results.items() if r.output is not None)]
        done = scheduler.finish_step(plan.step_id, list(results), finished)
        # 4) Final outputs (errors included) of those that left; nothing for the aborted ones.
        outputs: list[StageOutput] = []
        for rid in finished:
            # A request whose partial output could not be sent was marked released (_emit): its
            # mark goes with it, or every such request would stay in the set for the replica's life.
            self._released.discard(rid)
            metrics = done.get(rid)
            if metrics is None:
                continue
            out = failed[rid] if rid in failed else results[rid].output
            metrics = {**metrics, "admission_wait_ms": 0.0, "replica_id": self.replica_id, **out.metrics}
            outputs.append(self._final_output(rid, out, metrics))
        self._emit_outputs(outputs)
        # 5) Progress of those still running, when a burst is due.
        if plan.run:
            self._throttle.add_step(elapsed)
            self._emit_progress(results)

    def _step_context(self) -> ExecuteContext:
        def is_aborted(rid: str) -> bool:
            self._progress_at = time.monotonic()  # liveness: the step is moving
            return self._closed or self.scheduler.is_aborted(rid)

        return ExecuteContext(is_aborted=is_aborted)

    def _step_job(self, plan: StepPlan, ctx: ExecuteContext) -> tuple[dict[str, RunnerOutput], dict[str, StepResult]]:
        """In the forward thread: 1) free aborted state  2) admit the joiners (batched encode)
        3) one batched step of the plan's key (decoding those done)."""
        self.runner.step_drop(plan.drop)
        failed = self.runner.step_admit([plan.payloads[rid] for rid in plan.join], ctx) if plan.join else {}
        run = [rid for rid in plan.run if rid not in failed]
        results = self.runner.step_run(run, ctx) if run else {}
        # A runner may skip a request aborted meanwhile (it leaves with the next plan); any other
        # it did not step would hold its slot forever.
        for rid in run:
            if rid not in results and not self.scheduler.is_aborted(rid):
                err = StageExecutionError(
                    "the runner returned no result for this request's step", stage_id=self.stage_id
                )
                failed[rid] = RunnerOutput(error=err)
        return failed, results

    def _emit_progress(self, results: dict[str, StepResult]) -> None:
        """``{"progress": {"step": i, "steps": n}}`` partial outputs for every request that just took
        a step and goes on, in one burst, when the throttle says one is due."""
        now = time.monotonic()
        if not self._throttle.due(now):
            return
        live = [(rid, r) for rid, r in results.items() if r.output is None and not self.scheduler.is_aborted(rid)]
        if not live:
            return
        start = time.perf_counter()
        self._emit_outputs([_progress_output(rid, r.step, r.steps) for rid, r in live])
        self._throttle.sent(now, len(live), time.perf_counter() - start)

    def _send_progress(self, ids: list[str], step: int, steps: int) -> None:
        """A request-level wave's progress burst (the forward thread claimed it)."""
        live = [rid for rid in ids if rid not in self._released and not self.scheduler.is_aborted(rid)]
        if live:
            start = time.perf_counter()
            self._emit_outputs([_progress_output(rid, step, steps) for rid in live])
            self._throttle.sent(time.monotonic(), len(live), time.perf_counter() - start)

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
            return self._set_batching(kwargs)
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

    def _set_batching(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        # The bounds of the deploy YAML (config.FIELD_BOUNDS): a control call cannot set what a
        # config file could not. The caller checked already; this holds for any path to the stage.
        checked = check_control_kwargs("set_batching", kwargs)
        max_num_seqs = checked.get("max_num_seqs")
        request_batch_max_wait_ms = checked.get("request_batch_max_wait_ms")
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
        step = {"step_execution": self._step_mode}
        if self._step_mode:
            step.update(steps=s.get("steps", 0), paused=s.get("num_paused", 0), **self._throttle.stats())
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
            **step,
        }


def _progress_output(rid: str, step: int, steps: int) -> StageOutput:
    """A partial output that says only how far a request's denoising got."""
    return StageOutput(
        request_id=rid, finished=False, payload=Payload(metrics={"progress": {"step": step, "steps": steps}})
    )
