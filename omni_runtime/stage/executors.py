"""How a :class:`~omni_runtime.stage.worker.StageWorker` runs what it admitted: two executors
with one small interface. Run on the worker's event loop; each forward runs in the worker's single
forward thread.

* :class:`RequestExecutor` (the default): a :class:`~omni_runtime.stage.scheduler.RequestScheduler`
  forms waves, and each wave is one fused ``runner.execute``.
* :class:`StepExecutor` (``engine_args.step_execution`` with a runner that supports it): a
  :class:`~omni_runtime.stage.step_scheduler.StepScheduler` plans each denoising step (which key
  steps, who joins, who pauses, who is dropped), and each plan runs as one forward-thread call
  (drop, admit, one batched step, decode those done). Requests join and leave between steps.

The worker owns what both share (the runner, the forward thread, sleep, sending) and calls only
:meth:`Executor.add`, :meth:`Executor.abort`, :meth:`Executor.run` and :meth:`Executor.stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import msgspec

from omni_runtime.exceptions import OmniError, StageAsleepError, StageExecutionError
from omni_runtime.messages import Payload, Progress, StageOutput
from omni_runtime.stage.cost_model import key_label
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StepResult
from omni_runtime.stage.scheduler import RequestScheduler, Wave
from omni_runtime.stage.step_scheduler import StepPlan, StepScheduler

if TYPE_CHECKING:
    from omni_runtime.stage.worker import StageWorker

logger = logging.getLogger(__name__)


class Executor(ABC):
    """Admits requests into its scheduler and runs them on the worker's runner, until closed."""

    #: Whether requests run step by step (reported in the worker's stats).
    step_mode: bool = False

    def __init__(self, worker: StageWorker, scheduler: RequestScheduler | StepScheduler) -> None:
        self.worker = worker
        self.stage_id = worker.stage_id
        self.scheduler = scheduler

    @abstractmethod
    def add(self, req: RunnerRequest) -> None:
        """Queue ``req``. Raises OmniError (queue full...) or any error of the runner's key
        function, which the worker answers as this request's bad input."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Drop ``rid`` (its caller was answered upstream: nothing more is sent for it)."""

    @abstractmethod
    async def run(self) -> None:
        """The scheduling loop, until the worker closes."""

    def stats(self) -> dict[str, Any]:
        """This executor's part of the worker's ``get_stats``."""
        return {"step_execution": self.step_mode, "cost_model": self._cost_stats()}

    def _cost_stats(self) -> dict[str, Any]:
        """The learned cost of a batch (per key) and the policy that acts on it."""
        snapshot = msgspec.to_builtins(self.worker.cost_model.snapshot())
        return {"policy": self.worker.stage.engine_args.batch_policy, **snapshot}

    def cost_metrics(self, key: Hashable) -> dict[str, Any]:
        """The fitted cost of ``key`` for a request's output metrics (the server's gauges read it)."""
        fit = self.worker.cost_model.fit(key)
        if fit is None:
            return {}
        return {"cost_key": key_label(key), "cost_fixed_ms": fit.fixed_ms, "cost_per_item_ms": fit.per_item_ms}


class RequestExecutor(Executor):
    """Request-level batching: each wave of compatible requests is one fused forward."""

    def __init__(self, worker: StageWorker, scheduler: RequestScheduler) -> None:
        super().__init__(worker, scheduler)
        self.scheduler: RequestScheduler = scheduler

    def add(self, req: RunnerRequest) -> None:
        slo_ms = getattr(req.params, "slo_ms", None)  # a custom runner's own params class may not declare it
        self.scheduler.add(req.request_id, self.worker.runner.batch_key(req), req, priority=req.priority, slo_ms=slo_ms)

    def abort(self, rid: str) -> None:
        where = self.scheduler.abort(rid)
        if where == "running":
            # The forward notices at its next step; the caller was already answered upstream.
            self.worker.released.add(rid)
        elif where == "waiting":
            self.worker.wake.set()

    async def run(self) -> None:
        """1) ask the scheduler  2) wait for an arrival or the admission deadline  3) run a wave."""
        w = self.worker
        while not w.closed:
            w.wake.clear()
            decision = self.scheduler.schedule()
            if isinstance(decision, Wave):
                await self._run_wave(decision)
                continue
            timeout = None if decision is None else max(0.0, decision - time.monotonic())
            try:
                await asyncio.wait_for(w.wake.wait(), timeout)
            except TimeoutError:
                pass

    async def _run_wave(self, wave: Wave) -> None:
        w = self.worker
        loop = asyncio.get_running_loop()
        batch: list[RunnerRequest] = list(wave.payloads)
        start = time.perf_counter()
        try:
            if w.asleep:
                err = StageAsleepError(f"stage {self.stage_id} is asleep")
                outputs = [RunnerOutput(error=err) for _ in batch]
            else:
                outputs = await self._execute(loop, batch)
        finally:
            self.scheduler.finish(wave.batch_id)
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        if not w.asleep and all(out.error is None for out in outputs):
            # A failed wave ran (partly) one by one: its time says nothing of a batch of this size.
            w.cost_model.observe(wave.key, len(batch), elapsed_ms)
        cost = self.cost_metrics(wave.key)
        done: list[StageOutput] = []
        for req, out in zip(batch, outputs, strict=True):
            rid = req.request_id
            if rid in w.released:
                w.released.discard(rid)
                continue
            metrics = {
                "queue_wait_ms": wave.queue_wait_ms.get(rid, 0.0),
                "admission_wait_ms": wave.admission_wait_ms.get(rid, 0.0),
                "batch_size": len(batch),
                "batch_id": wave.batch_id,
                "execution_ms": elapsed_ms,
                "replica_id": w.replica_id,
                **cost,
                **out.metrics,
            }
            if "first_step_ms" in out.metrics:  # a runner that reports when its first step ended
                metrics["time_to_first_step_ms"] = metrics["queue_wait_ms"] + out.metrics["first_step_ms"]
            done.append(w.final_output(rid, out, metrics))
        w.emit_outputs(done)

    async def _execute(self, loop: asyncio.AbstractEventLoop, batch: list[RunnerRequest]) -> list[RunnerOutput]:
        """One fused forward; if it raises, each request again alone so only the culprit fails."""
        w = self.worker

        def is_aborted(rid: str) -> bool:
            # Called between steps: each call is also a sign that the forward is not stuck.
            w.progress_at = time.monotonic()
            # Closing aborts everything: the forward thread must stop for the process to exit,
            # even after close() has cancelled the wave's bookkeeping under it.
            return w.closed or self.scheduler.is_aborted(rid)

        def emit(rid: str, part: RunnerOutput) -> None:
            w.progress_at = time.monotonic()
            loop.call_soon_threadsafe(w.emit_partial, rid, part)

        def progress(ids: list[str], step: int, steps: int) -> None:
            # In the forward thread, at every step: only a due burst costs a thread hop.
            if w.throttle.claim(time.monotonic()):
                loop.call_soon_threadsafe(self._send_progress, ids, step, steps)

        ctx = ExecuteContext(is_aborted=is_aborted, emit=emit, progress=progress)
        w.progress_at = time.monotonic()
        try:
            if w.runner.runs_inline(batch):
                # Cheap enough to run on the loop: saves two thread hops per wave.
                return w.runner.execute(batch, ctx)
            return await loop.run_in_executor(w.forward_thread, w.runner.execute, batch, ctx)
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
            w.progress_at = None
        outputs = []
        for req in batch:
            outputs.extend(await self._execute(loop, [req]))
        return outputs

    def _send_progress(self, ids: list[str], step: int, steps: int) -> None:
        """A wave's progress burst (the forward thread claimed it)."""
        w = self.worker
        live = [rid for rid in ids if rid not in w.released and not self.scheduler.is_aborted(rid)]
        if live:
            start = time.perf_counter()
            w.emit_outputs([progress_output(rid, step, steps) for rid in live])
            w.throttle.sent(time.monotonic(), len(live), time.perf_counter() - start)


class StepExecutor(Executor):
    """Step-level (continuous) batching: the worker drives the denoising loop step by step."""

    step_mode = True

    def __init__(self, worker: StageWorker, scheduler: StepScheduler) -> None:
        super().__init__(worker, scheduler)
        self.scheduler: StepScheduler = scheduler

    def add(self, req: RunnerRequest) -> None:
        runner = self.worker.runner
        cap = runner.step_batch_cap(req)
        slo_ms = getattr(req.params, "slo_ms", None)  # a custom runner's own params class may not declare it
        self.scheduler.add(
            req.request_id, runner.step_key(req), req, priority=req.priority, max_batch=cap,
            slo_ms=slo_ms, steps=runner.step_count(req),
        )  # fmt: skip

    def abort(self, rid: str) -> None:
        # A running request leaves at the next step boundary and nothing more is sent for it
        # (the caller was already answered upstream); the loop may be idle, waiting for work.
        if self.scheduler.abort(rid) is not None:
            self.worker.wake.set()

    async def run(self) -> None:
        """1) ask the step scheduler for a plan  2) none: wait for an arrival or an abort
        3) run the plan (drop, admit, one step) in the forward thread  4) send what it finished."""
        w = self.worker
        while not w.closed:
            w.wake.clear()
            plan = self.scheduler.schedule()
            if plan is None:
                await w.wake.wait()
                continue
            await self._run_step(plan)

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        return {
            "step_execution": True,
            "cost_model": self._cost_stats(),
            "steps": s.get("steps", 0),
            "paused": s.get("num_paused", 0),
            **self.worker.throttle.stats(),
        }

    async def _run_step(self, plan: StepPlan) -> None:
        w = self.worker
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        failed: dict[str, RunnerOutput] = {}
        results: dict[str, StepResult] = {}
        #: Partial outputs the step emitted (a text stage's token deltas), sent with its final outputs.
        partials: list[tuple[str, RunnerOutput]] = []
        start = time.perf_counter()
        try:
            if w.asleep:
                # The model is gone (its states with it): every request with state fails now, and
                # any admitted later, until wake_up; new requests are refused meanwhile.
                err = StageAsleepError(f"stage {self.stage_id} is asleep")
                failed = {rid: RunnerOutput(error=err) for rid in scheduler.running_ids()}
            else:
                ctx = self._step_context(partials)
                w.progress_at = time.monotonic()
                failed, results, step_ms = await loop.run_in_executor(w.forward_thread, self._step_job, plan, ctx)
                if results and not failed and plan.key is not None:
                    w.cost_model.observe(plan.key, len(results), step_ms)
        except Exception as e:
            # The runner failed as a whole (asleep under us, or a bug): the plan's requests fail.
            logger.warning("stage %d: step %d failed: %s", self.stage_id, plan.step_id, e)
            error: OmniError = (
                e
                if isinstance(e, OmniError)
                else StageExecutionError(f"{type(e).__name__}: {e}", stage_id=self.stage_id)
            )
            failed = {rid: RunnerOutput(error=error) for rid in dict.fromkeys([*plan.join, *plan.run])}
            with contextlib.suppress(Exception):
                await loop.run_in_executor(w.forward_thread, w.runner.step_drop, list(failed))
        finally:
            w.progress_at = None
        elapsed = time.perf_counter() - start
        finished = [*failed, *(rid for rid, r in results.items() if r.output is not None)]
        silenced = {rid for rid, _ in partials if scheduler.is_aborted(rid)}  # before they leave
        done = scheduler.finish_step(plan.step_id, list(results), finished)
        # 4) The step's partial outputs, then the final outputs (errors included) of those that
        #    left, in one frame; nothing for the aborted ones.
        cost = {} if plan.key is None else self.cost_metrics(plan.key)
        outputs: list[StageOutput] = []
        for rid, part in partials:
            partial = None if rid in silenced else w.partial_output(rid, part)
            if partial is not None:
                outputs.append(partial)
        for rid in finished:
            # A request whose partial output could not be sent was marked released (emit): its
            # mark goes with it, or every such request would stay in the set for the replica's life.
            w.released.discard(rid)
            metrics = done.get(rid)
            if metrics is None:
                continue
            out = failed[rid] if rid in failed else results[rid].output
            assert out is not None  # finished: failed, or its step result has an output
            metrics = {**metrics, "admission_wait_ms": 0.0, "replica_id": w.replica_id, **cost, **out.metrics}
            outputs.append(w.final_output(rid, out, metrics))
        w.emit_outputs(outputs)
        # 5) Progress of those still running, when a burst is due.
        if plan.run:
            w.throttle.add_step(elapsed)
            self._emit_progress(results)

    def _step_context(self, partials: list[tuple[str, RunnerOutput]]) -> ExecuteContext:
        w = self.worker

        def is_aborted(rid: str) -> bool:
            w.progress_at = time.monotonic()  # liveness: the step is moving
            return w.closed or self.scheduler.is_aborted(rid)

        def emit(rid: str, part: RunnerOutput) -> None:
            # Held until the step ends, then sent with its final outputs in one frame: a step is
            # short (a text stage's is one token), and a wake-up of the event loop per partial
            # output would cost more than the step itself on a busy machine.
            partials.append((rid, part))

        return ExecuteContext(is_aborted=is_aborted, emit=emit)

    def _step_job(
        self, plan: StepPlan, ctx: ExecuteContext
    ) -> tuple[dict[str, RunnerOutput], dict[str, StepResult], float]:
        """In the forward thread: 1) free aborted state  2) admit the joiners (batched encode)
        3) one batched step of the plan's key (decoding those done). Also returns the step's own
        time (ms), without the admission: what the cost model learns from."""
        runner = self.worker.runner
        runner.step_drop(plan.drop)
        failed = runner.step_admit([plan.payloads[rid] for rid in plan.join], ctx) if plan.join else {}
        run = [rid for rid in plan.run if rid not in failed]
        start = time.perf_counter()
        results = runner.step_run(run, ctx) if run else {}
        step_ms = (time.perf_counter() - start) * 1000.0
        # A runner may skip a request aborted meanwhile (it leaves with the next plan); any other
        # it did not step would hold its slot forever.
        for rid in run:
            if rid not in results and not self.scheduler.is_aborted(rid):
                err = StageExecutionError(
                    "the runner returned no result for this request's step", stage_id=self.stage_id
                )
                failed[rid] = RunnerOutput(error=err)
        return failed, results, step_ms

    def _emit_progress(self, results: dict[str, StepResult]) -> None:
        """:class:`Progress` partial outputs for every request that just took
        a step and goes on, in one burst, when the throttle says one is due."""
        w = self.worker
        now = time.monotonic()
        if not w.throttle.due(now):
            return
        live = [(rid, r) for rid, r in results.items() if r.output is None and not self.scheduler.is_aborted(rid)]
        if not live:
            return
        start = time.perf_counter()
        w.emit_outputs([progress_output(rid, r.step, r.steps) for rid, r in live])
        w.throttle.sent(now, len(live), time.perf_counter() - start)


def progress_output(rid: str, step: int, steps: int) -> StageOutput:
    """A partial output that says only how far a request's denoising got."""
    return StageOutput(request_id=rid, finished=False, payload=Payload(progress=Progress(step=step, steps=steps)))
