"""StageWorker: one replica of a stage. Runs on an asyncio loop in the stage process, or in the
orchestrator's process for ``runtime.process: false`` (the in-process client).

Transport-agnostic: messages come in through :meth:`StageWorker.handle`, and everything it says
goes out through the ``send`` callback. The runner's ``execute`` runs in a single executor
thread, so aborts and control calls are answered while a forward is running.

How admitted requests run is an executor's (:mod:`omni_runtime.stage.executors`): request-level
waves by default, or, with ``engine_args.step_execution`` and a runner that supports it, step by
step, requests joining and leaving a running denoising batch between steps. Either way the loop
answers aborts, control calls and pings while a forward runs.
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
from typing import Any, cast

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
    BatchProfileReport,
    ErrorInfo,
    Payload,
    StageAbort,
    StageConstraints,
    StageMetrics,
    StageOutput,
    StageOutputs,
    StagePing,
    StagePong,
    StageReady,
    StageRequest,
    StageRpc,
    StageRpcResult,
)
from omni_runtime.stage.cost_model import CostModel
from omni_runtime.stage.executors import Executor, RequestExecutor, StepExecutor
from omni_runtime.stage.memory import fix_mmap_threshold
from omni_runtime.stage.profile import profile_batches
from omni_runtime.stage.rank_group import GroupLeader
from omni_runtime.stage.result_cache import ExactResultCache
from omni_runtime.stage.runners.base import RunnerOutput, RunnerRequest, StageRunner, runner_class
from omni_runtime.stage.scheduler import RequestScheduler
from omni_runtime.stage.step_scheduler import ProgressThrottle, StepScheduler
from omni_runtime.tasks import BackgroundTasks

logger = logging.getLogger(__name__)

#: Runner control calls that change nothing a result was made from: every other ``rpc_*`` call
#: (``add_lora``, ``remove_lora``, a runner's own weight update) invalidates the result cache.
READ_ONLY_CALLS = frozenset({"list_loras"})


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
        self.runner: StageRunner | GroupLeader = runner_class(stage.stage_type)(stage)
        self.runner.replica_id = replica_id
        parallel = stage.runtime.parallel
        if parallel is not None and parallel.world_size > 1:
            # Rank 0 of a group of processes that run every model call in lock step.
            self.runner = GroupLeader(self.runner, stage, replica_id)
        args = stage.engine_args
        #: What a batch costs here, learned from every wave or step (reported in get_stats); the
        #: schedulers act on it only with ``batch_policy: learned`` or ``deadline`` (which a runner
        #: that cannot step serves as ``learned``).
        self.cost_model = CostModel()
        policy_model = self.cost_model if args.batch_policy in ("learned", "deadline") else None
        #: Request-level waves (the default), or a StepExecutor once start() finds that the runner
        #: can run step by step and ``step_execution`` asks for it.
        self.executor: Executor = RequestExecutor(
            self,
            RequestScheduler(
                max_num_seqs=args.max_num_seqs,
                max_wait_ms=args.request_batch_max_wait_ms,
                max_queue_len=args.max_queue_len,
                policy=args.scheduling_policy,
                stable_window_ms=args.batch_quiet_window_ms,
                priority_aging_s=args.priority_aging_s,
                cost_model=policy_model,
                slo_ms=args.slo_ms,
                slo_shed=args.slo_shed,
            ),
        )
        # What the executors share, through the worker:
        self.throttle = ProgressThrottle(fixed_interval_s=args.progress_interval_s)
        #: The one forward thread: every runner call that may be slow runs here, in order.
        self.forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{self.stage_id}-forward")
        #: Whether freed activations go back to the system at once (``engine_args.return_freed_memory``):
        #: glibc's mmap threshold fixed in this process, before the first forward.
        self.mmap_threshold_fixed = fix_mmap_threshold() if args.return_freed_memory else False
        #: Set on an arrival, an abort or a config change: the executor's loop looks again.
        self.wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._rpc_tasks = BackgroundTasks()
        self.released: set[str] = set()  # aborted while running: caller already answered
        #: The one truth about sleep: set before the model is freed, cleared once it is back, so
        #: no wave ever runs on a freed model and every request meanwhile gets StageAsleepError.
        self.asleep = False
        self.closed = False
        self._served = 0
        self._failed = 0
        #: When the running forward last made progress (``time.monotonic()``, written by the
        #: forward thread); None while no forward runs. Reported in every pong.
        self.progress_at: float | None = None
        #: What the start-up profile measured (``engine_args.batch_profile``), or None.
        self.batch_profile: BatchProfileReport | None = None
        #: Final outputs of seeded requests, answered again without the model
        #: (``engine_args.result_cache``; None: off).
        bound = args.result_cache
        self.result_cache = ExactResultCache(bound.max_bytes) if bound is not None else None

    @property
    def scheduler(self) -> RequestScheduler | StepScheduler:
        """The executor's scheduler (control calls and stats read and set it)."""
        return self.executor.scheduler

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> StageReady:
        """Load the model (in the forward thread) and start the executor's scheduling loop."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.forward_thread, self.runner.load)
        constraints = self._constraints()  # before the loop starts: a bad one fails the load
        args = self.stage.engine_args
        policy_model = self.cost_model if args.batch_policy in ("learned", "deadline") else None
        if args.step_execution:
            reason = self.runner.step_support()
            if reason is None:
                self.executor = StepExecutor(
                    self,
                    StepScheduler(
                        args.max_num_seqs,
                        max_queue_len=args.max_queue_len,
                        priority_aging_s=args.priority_aging_s,
                        cost_model=policy_model,
                        policy="deadline" if args.batch_policy == "deadline" else "priority",
                        slo_ms=args.slo_ms,
                        slo_shed=args.slo_shed,
                    ),
                )
            else:
                logger.warning(
                    "stage %d: step_execution is on, but requests run with request-level batching: %s",
                    self.stage_id,
                    reason,
                )
        # A hard cap: neither the config nor a later set_batching can lift it.
        self.scheduler.set_batch_cap(self.runner.max_batch_size)
        if args.batch_profile is not None:
            if isinstance(self.executor, StepExecutor):
                # The model of a step executor learns the time of a step, which a whole forward is not.
                self.batch_profile = BatchProfileReport(
                    key="", seconds=0.0, forwards={}, note="not run: step execution learns per-step costs"
                )
            else:
                spec = args.batch_profile
                runner = cast(StageRunner, self.runner)  # a GroupLeader answers as its runner does
                self.batch_profile = await loop.run_in_executor(
                    self.forward_thread, lambda: profile_batches(runner, self.cost_model, spec)
                )
            logger.info("stage %d: batch profile %s", self.stage_id, self.batch_profile)
        self._loop_task = asyncio.create_task(self.executor.run(), name=f"stage{self.stage_id}-loop")
        self._loop_task.add_done_callback(self._on_loop_done)
        compile_s = self.runner.stats().get("compile_warmup_s")
        return StageReady(
            stage_id=self.stage_id,
            replica_id=self.replica_id,
            pid=os.getpid(),
            constraints=constraints,
            batch_profile=self.batch_profile,
            compile_s=float(compile_s) if compile_s is not None else None,
        )

    def _constraints(self) -> StageConstraints:
        """The runner's constraints as the READY struct. A runner written against the older dict
        form is converted, strictly: a field the struct lacks (a misspelt key) fails the load
        instead of disabling a check in silence."""
        found: Any = self.runner.constraints()
        if isinstance(found, StageConstraints):
            return found
        try:
            return msgspec.convert(found, StageConstraints)
        except msgspec.ValidationError as e:
            raise TypeError(f"{type(self.runner).__name__}.constraints(): {e}") from None

    async def close(self) -> None:
        self.closed = True
        self.wake.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass  # a loop that died was reported by _on_loop_done
        if isinstance(self.runner, GroupLeader):
            self.runner.close()  # before the thread its ranks are tied to ends
        self.forward_thread.shutdown(wait=False, cancel_futures=True)

    def _on_loop_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
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
                stalled = None if self.progress_at is None else time.monotonic() - self.progress_at
                self._emit(StagePong(seq=msg.seq, stalled_s=stalled))
            else:  # StageShutdown is the process's to act on, and never reaches here
                logger.warning("stage %d: dropped unexpected message %r", self.stage_id, type(msg).__name__)
        except Exception:
            logger.exception("stage %d: failed to handle %s", self.stage_id, type(msg).__name__)

    def _add(self, msg: StageRequest) -> None:
        req = RunnerRequest(
            request_id=msg.request_id,
            prompt=msg.prompt,
            params=msg.params,
            inputs=dict(msg.inputs),
            priority=msg.priority,
        )
        try:
            if self.asleep:
                raise StageAsleepError(f"stage {self.stage_id} is asleep; call collective_rpc('wake_up')")
            if self.result_cache is not None:
                hit = self.result_cache.lookup(msg.request_id, msg.prompt, msg.params, req.inputs)
                if hit is not None:
                    # Answered now: the request never enters the scheduler.
                    metrics = {"queue_wait_ms": 0.0, "replica_id": self.replica_id, **hit.metrics}
                    metrics.update(self.result_cache.hit_metrics())
                    self.emit_outputs([self.final_output(msg.request_id, hit, metrics)])
                    return
            self.executor.add(req)
        except OmniError as e:
            self._forget(msg.request_id)
            self._emit(StageOutput(request_id=msg.request_id, error=ErrorInfo.from_exception(e, self.stage_id)))
            return
        except Exception as e:  # batch_key choked on the params: this request's bad input
            self._forget(msg.request_id)
            err = InvalidRequestError(f"stage {self.stage_id} cannot take this request: {e}")
            self._emit(StageOutput(request_id=msg.request_id, error=ErrorInfo.from_exception(err, self.stage_id)))
            return
        self.wake.set()

    def _abort(self, rid: str) -> None:
        self._forget(rid)
        self.executor.abort(rid)

    def _forget(self, rid: str) -> None:
        """A request that will send no output of its own here: nothing is stored for it."""
        if self.result_cache is not None:
            self.result_cache.forget(rid)

    # ------------------------------------------------------------------ what the executors send

    def final_output(self, rid: str, out: RunnerOutput, metrics: dict[str, Any]) -> StageOutput:
        # Wall-clock end of this stage's work on the request: with the durations above, a trace
        # places the stage's spans, and the time from here to the next stage is the hand-off.
        metrics["finished_at"] = time.time()
        if self.result_cache is not None:  # a seeded miss is stored now, unless it failed
            metrics.update(self.result_cache.finished(rid, out))
        if out.error is None:
            self._served += 1
        else:
            self._failed += 1
        return StageOutput(
            request_id=rid,
            payload=Payload(text=out.text, media=out.media, tensors=out.tensors, metrics=StageMetrics.of(metrics)),
            error=None if out.error is None else ErrorInfo.from_exception(out.error, self.stage_id),
        )

    def emit_outputs(self, done: list[StageOutput]) -> None:
        """One message for the outputs of one forward: a frame per wave, not per request."""
        if done:
            self._emit(StageOutputs(outputs=done) if len(done) > 1 else done[0])

    def emit_partial(self, rid: str, part: RunnerOutput) -> None:
        partial = self.partial_output(rid, part)
        if partial is not None:
            self._emit(partial)

    def partial_output(self, rid: str, part: RunnerOutput) -> StageOutput | None:
        """The message of a partial output, or None for a request whose caller was answered."""
        if rid in self.released:
            return None
        metrics = StageMetrics.of(part.metrics)
        payload = Payload(text=part.text, media=part.media, tensors=part.tensors, metrics=metrics)
        return StageOutput(request_id=rid, finished=False, payload=payload)

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
                    self.released.add(msg.request_id)  # the rest of this request is not sent
                err = StageExecutionError(f"the stage's output cannot be sent: {e}", stage_id=self.stage_id)
                self._emit(StageOutput(request_id=msg.request_id, error=ErrorInfo.from_exception(err, self.stage_id)))
            elif isinstance(msg, StageRpcResult) and msg.error is None:
                rpc_err = RpcError(f"the result cannot be sent: {e}")
                info = ErrorInfo.from_exception(rpc_err, self.stage_id)
                self._emit(StageRpcResult(call_id=msg.call_id, error=info))
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
            self.asleep = True
            self._invalidate_results()  # the model goes; a later wake_up may load other weights
            result = await loop.run_in_executor(self.forward_thread, self.runner.sleep)
            gc.collect()
            return {"asleep": True, **(result or {})}
        if method == "wake_up":
            # Awake only once the model is back: requests meanwhile still get StageAsleepError.
            result = await loop.run_in_executor(self.forward_thread, self.runner.wake_up)
            self.asleep = False
            self.wake.set()
            return {"asleep": False, **(result or {})}
        handler = getattr(self.runner, f"rpc_{method}", None)
        if handler is None:
            raise RpcError(f"unknown control method {method!r}")
        try:
            return await loop.run_in_executor(self.forward_thread, lambda: handler(*args, **kwargs))
        finally:
            # Once the call is over, failed or not (it may have changed part of the model): what
            # is stored, and what runs now, may have been made by the model as it was.
            if method not in READ_ONLY_CALLS:
                self._invalidate_results()

    def _invalidate_results(self) -> None:
        if self.result_cache is not None:
            self.result_cache.invalidate()

    def _set_batching(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        # The bounds of the deploy YAML (config.FIELD_BOUNDS): a control call cannot set what a
        # config file could not. The caller checked already; this holds for any path to the stage.
        checked = check_control_kwargs("set_batching", kwargs)
        max_num_seqs = checked.get("max_num_seqs")
        self.scheduler.set_config(
            max_num_seqs=max_num_seqs,
            max_wait_ms=checked.get("request_batch_max_wait_ms"),
            stable_window_ms=checked.get("batch_quiet_window_ms"),
        )
        self.wake.set()
        # max_num_seqs as applied: never above what the runner declared it can take.
        return {
            "max_num_seqs": self.scheduler.max_num_seqs,
            "request_batch_max_wait_ms": self.scheduler.max_wait_ms,
            # The window a hold would use now (fixed, or adapted); step execution holds nothing: 0.
            "batch_quiet_window_ms": self.scheduler.stable_window_ms,
            "max_batch_size": self.runner.max_batch_size,
        }

    @staticmethod
    def _profile_stats(report: BatchProfileReport) -> dict[str, Any]:
        # The wire struct is array-like; stats are named fields, with string keys for JSON.
        return {**msgspec.structs.asdict(report), "forwards": {str(n): c for n, c in report.forwards.items()}}

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
            # Learned batching: requests refused for their latency target, waves run to re-explore.
            **{k: s[k] for k in ("slo_shed", "explored_waves") if k in s},
            "asleep": self.asleep,
            # What torch really runs with (OMP_NUM_THREADS set by the stage process); None if unused.
            "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
            **self.executor.stats(),
            "mmap_threshold_fixed": self.mmap_threshold_fixed,
            "result_cache": self.result_cache.stats() if self.result_cache is not None else None,
            **self.runner.stats(),
            **({} if self.batch_profile is None else {"batch_profile": self._profile_stats(self.batch_profile)}),
        }
