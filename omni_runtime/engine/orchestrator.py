"""Orchestrator: runs in its own thread, on its own uvloop event loop.

It awaits two things and nothing else: the janus request queue from the callers, and the stage
replicas (through their clients). No polling loops, no sleeps: an idle engine sleeps in
``epoll``. It routes each request through the stage graph (``engine_input_source``), builds each
stage's input from its upstream outputs (:mod:`.stage_graph`; a chunked stage's a chunk at a time,
sequenced by :mod:`.sequencer`), delivers final outputs to the caller's output queue, and runs
control calls as tasks of their own so they never hold up request intake.

It only routes. Where replicas run, how messages reach them and how an output's arrays reach the
next stage are the business of the stage backends (:mod:`omni_runtime.engine.backends`); all they
hold is registered with :attr:`Orchestrator.resources`, which the thread releases on every exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import janus
import msgspec

from omni_runtime.checks import link_constraints
from omni_runtime.config import DeployConfig
from omni_runtime.engine.backends import EngineResources, StageBackend, make_backends
from omni_runtime.engine.chunking import Chunk
from omni_runtime.engine.sequencer import ChunkSequencer
from omni_runtime.engine.stage_graph import StageGraph
from omni_runtime.engine.stage_pool import StagePool
from omni_runtime.engine.status import StageStatus
from omni_runtime.exceptions import (
    EngineClosedError,
    EngineDeadError,
    OmniError,
    RequestAbortedError,
    RequestTimeoutError,
    StageExecutionError,
    StageStartupError,
)
from omni_runtime.messages import (
    EngineAbort,
    EngineOutput,
    EngineRequest,
    EngineRpc,
    EngineRpcResult,
    EngineShutdown,
    EngineUpdate,
    ErrorInfo,
    Payload,
    StageConstraints,
    StageMetrics,
    StageOutput,
    StageRequest,
)
from omni_runtime.resolve import ResolvedConfig
from omni_runtime.tasks import BackgroundTasks

logger = logging.getLogger(__name__)

#: What runs once an output is settled (its arrays ready for where it goes).
_Then = Callable[[StageOutput], None]

#: Seconds a failed start waits for the orchestrator thread to release what it made (each
#: release is bounded on its own; this only keeps a wedged one from hanging the caller).
_RELEASE_WAIT_S = 90.0


class _Request:
    """Routing state of one request inside the orchestrator."""

    __slots__ = ("done", "finals_left", "msg", "running", "settling", "timer")

    def __init__(self, msg: EngineRequest, finals: set[int]) -> None:
        self.msg = msg
        self.finals_left = set(finals)
        self.done: dict[int, StageOutput] = {}
        self.running: set[int] = set()
        self.timer: asyncio.TimerHandle | None = None
        #: The last of this request's outputs whose arrays a backend is still fetching.
        self.settling: asyncio.Task | None = None


class Orchestrator:
    """Owns the stage pools; moves requests through the stage graph."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        *,
        request_queue_size: int = 0,
        on_dead: Callable[[EngineDeadError], None] | None = None,
        make_backends: Callable[[DeployConfig, EngineResources], dict[str, StageBackend]] = make_backends,
    ) -> None:
        self.config = resolved.config
        self.request_queue: janus.Queue = janus.Queue(maxsize=request_queue_size)
        #: Output queues by channel id, one per caller event loop; the caller registers and
        #: unregisters them (a dict write is atomic), this thread only reads.
        self.channels: dict[int, janus.Queue] = {}
        #: Called (from this thread) once when the engine can no longer serve: the thread died,
        #: or a stage lost every replica for good.
        self._on_dead = on_dead
        #: Set once the engine is dead; every request is then refused with it.
        self.dead: EngineDeadError | None = None
        self.pools: dict[int, StagePool] = {}
        self.constraints: dict[int, StageConstraints] = {}
        self._requests: dict[str, _Request] = {}
        #: Which stage feeds which, and how a stage's input is made from its upstream outputs.
        self.graph = StageGraph(resolved)
        #: The chunked hand-off (``input_chunking``, streaming input): every request's feeds and
        #: the chunks it has out.
        self.chunks = ChunkSequencer(
            self.graph.chunked,
            submit=self._submit_chunk,
            deliver=self._on_delta,
            finish=self._on_chunks_joined,
            fail=self._finish_with_error,
            settle=self._settle,
        )
        self._thread: threading.Thread | None = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks = BackgroundTasks()  # control calls in progress
        #: Everything the engine holds outside Python objects; made before any of it exists.
        self.resources = EngineResources()
        self.backends: dict[str, StageBackend] = {}
        self._make_backends = make_backends  # a test gives fakes here
        self._backend_of: dict[int, StageBackend] = {}
        self._stopping = False  # EngineShutdown received: the thread's end is asked for
        self._pools_closing: asyncio.Future | None = None

    # ------------------------------------------------------------------ lifecycle (caller thread)

    def start(self, timeout: float | None = None) -> None:
        """Start the thread and block until every stage said READY (or raise why not)."""
        self._thread = threading.Thread(target=self._thread_main, name="omni-orchestrator", daemon=True)
        self._thread.start()
        try:
            self._ready.result(timeout)
        except BaseException:
            if self._ready.done():
                # A failed start: the thread ends as soon as it released what it made. Wait for
                # that, so the caller's next start finds nothing of this one (a Ray connection
                # given back, a cluster stopped).
                self._thread.join(_RELEASE_WAIT_S)
            raise

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> dict[int, StageStatus]:
        """A snapshot of every stage's replicas and queue depth (safe from any thread)."""
        # Read from the caller's thread: the pools' counters are plain ints and sets (read without
        # iterating them), and a snapshot a few microseconds stale is fine for health and metrics.
        return {sid: p.status() for sid, p in list(self.pools.items())}

    def _thread_main(self) -> None:
        import uvloop

        try:
            uvloop.run(self._main())
        except BaseException as e:  # never let the thread die silently
            logger.critical("the orchestrator thread died", exc_info=e)
            if not self._ready.done():
                self._ready.set_exception(e)
            else:
                self._die(f"the orchestrator thread died: {type(e).__name__}: {e}")
        else:
            if not self._stopping and self._ready.done() and self._ready.exception() is None:
                self._die("the orchestrator thread stopped without being asked to")
        finally:
            # Whatever ended the loop, and however far _main got: nothing outlives the engine.
            self.resources.release()

    def _die(self, reason: str) -> None:
        """The engine cannot serve any more: say so once, to the caller's side."""
        if self.dead is not None:
            return
        self.dead = EngineDeadError(reason)
        logger.critical("engine dead: %s", reason)
        if self._on_dead is not None:
            try:
                self._on_dead(self.dead)
            except Exception:
                logger.exception("on_dead callback failed")

    # ------------------------------------------------------------------ the loop (orchestrator thread)

    async def _main(self) -> None:
        try:
            # 1) the backends set up what their replicas share (registered with self.resources)
            # 2) every stage's replicas start concurrently; any failure fails start()
            try:
                self.backends = self._make_backends(self.config, self.resources)
                for backend in self.backends.values():
                    await backend.open()
                await self._start_pools()
            except BaseException as e:
                await self._close_pools()
                self._ready.set_exception(e)
                return
            self._ready.set_result(None)
            # 3) serve the request queue until shutdown.
            await self._serve()
        finally:
            if not self._stopping and self._ready.done() and self._ready.exception() is None:
                self._die("the orchestrator's event loop stopped unexpectedly")
            self._fail_all(self.dead or EngineClosedError("engine closed"))
            await self._close_pools()
            self.request_queue.shutdown(immediate=True)

    async def _start_pools(self) -> None:
        for stage in self.config.stage_args:
            backend = self._backend_of[stage.stage_id] = self.backends[stage.runtime.backend_name]
            self.pools[stage.stage_id] = StagePool(
                stage, backend, self._on_stage_output, self._on_requests_lost, self._on_stage_gone
            )
        # Every start runs to its end (each pool closes what it started if one replica failed),
        # so nothing is still starting when the caller closes the pools after a failure.
        results = await asyncio.gather(*(p.start() for p in self.pools.values()), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                if isinstance(res, OmniError | asyncio.CancelledError):
                    raise res
                raise StageStartupError(f"a stage failed to start: {type(res).__name__}: {res}") from res
        # What a stage takes bounds what its upstream stages make (a talker's codes; params.py).
        reported = {sid: p.constraints for sid, p in self.pools.items()}
        self.constraints = link_constraints(self.config.stage_args, reported)

    async def _close_pools(self) -> None:
        # Once, whoever asks first (a death, a failed start, the thread's end); the others wait.
        if self._pools_closing is None:
            pools = asyncio.gather(*(p.close() for p in self.pools.values()), return_exceptions=True)
            self._pools_closing = pools
        await asyncio.shield(self._pools_closing)

    async def _release_dead(self) -> None:
        """A dead engine never serves again: its replicas close now, none restarts, and each
        backend frees what only new replicas would have used (the stage launcher), not at close."""
        await self._close_pools()
        for backend in self.backends.values():
            try:
                await backend.release_spare()
            except Exception:
                logger.exception("could not release what the %s backend holds", backend.name)

    async def _serve(self) -> None:
        queue = self.request_queue.async_q
        while True:
            msg = await queue.get()
            if isinstance(msg, EngineShutdown):
                self._stopping = True
                return
            # Total: whatever one message makes go wrong ends that message's request or call with
            # an error; the loop that serves everyone goes on.
            try:
                self._handle(msg)
            except Exception as e:
                logger.exception("failed to handle %s", type(msg).__name__)
                self._fail_message(msg, e)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, EngineRequest):
            self._add(msg)
        elif isinstance(msg, EngineUpdate):
            self._update(msg)
        elif isinstance(msg, EngineAbort):
            reason = msg.reason.to_exception() if msg.reason else RequestAbortedError("aborted")
            for rid in msg.request_ids:
                self._finish_with_error(rid, reason, stage_id=None)
        elif isinstance(msg, EngineRpc):
            self._tasks.spawn(self._rpc(msg), name=f"rpc-{msg.call_id}")
        else:
            logger.warning("dropped unexpected %s", type(msg).__name__)

    def _fail_message(self, msg: Any, exc: Exception) -> None:
        err = exc if isinstance(exc, OmniError) else StageExecutionError(f"internal error: {type(exc).__name__}: {exc}")
        if isinstance(msg, EngineRequest):
            if msg.request_id in self._requests:
                self._finish_with_error(msg.request_id, err, None)
            else:
                stage_id = msg.final_stage_ids[0] if msg.final_stage_ids else -1
                self._emit(msg.channel, _error_output(msg.request_id, stage_id, err))
        elif isinstance(msg, EngineRpc):
            self._emit(msg.channel, EngineRpcResult(call_id=msg.call_id, error=ErrorInfo.from_exception(err)))

    def _emit(self, channel: int, msg: Any) -> None:
        """Put a message on a caller's output queue; one whose loop has gone is dropped."""
        queue = self.channels.get(channel)
        if queue is None:
            return
        try:
            queue.sync_q.put_nowait(msg)
        except (janus.SyncQueueShutDown, RuntimeError):
            pass  # that caller closed its side: nobody is waiting

    # ------------------------------------------------------------------ routing

    def _add(self, msg: EngineRequest) -> None:
        if self.dead is not None:
            self._emit(msg.channel, _error_output(msg.request_id, msg.final_stage_ids[0], self.dead))
            return
        state = _Request(msg, set(msg.final_stage_ids))
        self._requests[msg.request_id] = state
        if msg.deadline is not None:
            state.timer = asyncio.get_running_loop().call_later(
                max(0.0, msg.deadline - time.monotonic()), self._on_deadline, msg.request_id
            )
        sources = msg.entry_stage_ids or self.graph.sources(self.graph.needed(state.finals_left))
        if msg.streaming_input:  # the prompt is the input's first piece
            self.chunks.open_input(msg.request_id, sources)
            self.chunks.on_input(msg.request_id, msg.prompt, {}, final=False)
            return
        for stage_id in sources:
            self._submit(state, stage_id, msg.prompt, {})

    def _update(self, msg: EngineUpdate) -> None:
        """More input for a streaming-input request: into each source stage's chunker."""
        state = self._requests.get(msg.request_id)
        if state is None or not state.msg.streaming_input:
            return  # it ended meanwhile (the caller checked the rest)
        self.chunks.on_input(msg.request_id, msg.text, msg.inputs, final=msg.final)

    def _submit(self, state: _Request, stage_id: int, prompt: Any, inputs: dict[str, Any]) -> None:
        try:
            self._send(state, stage_id, state.msg.request_id, prompt, inputs)
        except Exception as e:  # no live replica, or a value no message can carry
            self._finish_with_error(state.msg.request_id, e, stage_id)

    def _send(self, state: _Request, stage_id: int, request_id: str, prompt: Any, inputs: dict[str, Any]) -> None:
        """Submit the request (or one of its chunks, ``request_id``) to a stage; raises if it cannot."""
        msg = state.msg
        self.pools[stage_id].submit(
            StageRequest(
                request_id=request_id,
                prompt=prompt,
                params=msg.params[stage_id],
                inputs=inputs,
                arrival_time=msg.arrival_time,
                priority=msg.priority,
            )
        )
        state.running.add(stage_id)

    def _on_stage_output(self, stage_id: int, out: StageOutput) -> None:
        try:
            self._route_output(stage_id, out)
        except Exception as e:  # a routing bug ends this request, never the stage's socket reader
            logger.exception("stage %d: failed to route the output of %s", stage_id, out.request_id)
            self.pools[stage_id].done(out.request_id)
            err = StageExecutionError(f"internal error routing the output: {type(e).__name__}: {e}", stage_id=stage_id)
            self._finish_with_error(out.request_id, err, stage_id)
        except BaseException as e:
            # SystemExit or KeyboardInterrupt from user code (an input function) ends this thread:
            # say why before the loop unwinds, so every caller hears it at once.
            self._die(f"the orchestrator thread died: {type(e).__name__}: {e}")
            raise

    def _route_output(self, stage_id: int, out: StageOutput) -> None:
        if self.chunks.owner(out.request_id) is not None:
            # A chunk's sub-request: its own streamed pieces are not passed on, its whole output is.
            if out.finished:
                self.pools[stage_id].done(out.request_id)
                self.chunks.on_output(stage_id, out)
            return
        state = self._requests.get(out.request_id)
        if state is None:
            return  # aborted, timed out or failed meanwhile: drop it
        if out.error is not None:
            self.pools[stage_id].done(out.request_id)
            self._finish_with_error(out.request_id, out.error.to_exception(), stage_id)
            return
        if not out.finished:  # a streamed delta: pass it on to the caller and to chunked stages
            if stage_id in state.msg.final_stage_ids or self.graph.chunk_consumers(stage_id, state.finals_left):
                self._settle(out.request_id, stage_id, out, lambda o: self._on_delta(out.request_id, stage_id, o))
            elif out.payload.progress is not None:  # an inner stage's progress: the caller sees it too
                self._deliver(state, stage_id, out, finished=False, stage_finished=False)
            return
        self.pools[stage_id].done(out.request_id)
        deliver, consumers, needed = self._stage_done(state, stage_id)
        # The output goes on as it is only to a single consumer that takes it unchanged (no input
        # function); the caller, several stages or a function get plain values.
        only = None if deliver else self.graph.sole_taker(consumers)
        self._settle(
            out.request_id, stage_id, out, lambda o: self._forward(state, stage_id, o, deliver, consumers, needed), only
        )

    def _stage_done(self, state: _Request, stage_id: int) -> tuple[bool, list[int], set[int]]:
        """A stage finished with a request: whether the caller gets its output, the needed stages
        it feeds, and every stage still needed."""
        state.running.discard(stage_id)
        deliver = stage_id in state.finals_left
        state.finals_left.discard(stage_id)
        needed = self.graph.needed(state.finals_left)
        return deliver, [d for d in self.graph.downstream[stage_id] if d in needed], needed

    def _settle(self, request_id: str, stage_id: int, out: StageOutput, then: _Then, to: int | None = None) -> None:
        """``then(output)`` once the stage's backend made ``out`` ready for stage ``to`` (None: as
        plain values): now, or, when it must fetch the output's arrays first, once it has, after
        every earlier output of the same request, which keeps their order."""
        state = self._requests.get(request_id)
        if state is None:
            return
        settled = self._backend_of[stage_id].settle(out, None if to is None else self.graph.stage(to))
        if not inspect.isawaitable(settled) and state.settling is None:
            then(settled)
            return
        previous = state.settling
        rid = state.msg.request_id

        async def in_order() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            try:
                out = await settled if inspect.isawaitable(settled) else settled
                if self._requests.get(rid) is state:
                    then(out)
            except Exception as e:
                logger.warning("request %s: %s", rid, e)
                self._finish_with_error(rid, e, None)
            finally:
                if state.settling is task:
                    state.settling = None

        task = self._tasks.spawn(in_order(), name=f"settle-{rid}")
        state.settling = task

    def _forward(
        self, state: _Request, stage_id: int, out: StageOutput, deliver: bool, consumers: list[int], needed: set[int]
    ) -> None:
        """A stage finished with a request: deliver its output if the caller asked for it, and
        submit the request to each needed downstream stage whose inputs are all here."""
        state.done[stage_id] = out
        if deliver:
            finished = not state.finals_left
            self._deliver(state, stage_id, out, finished=finished, stage_finished=True)
            if finished:
                self._forget(out.request_id)
                return
        else:
            # An inner stage is done: the caller hears of it (and of its timings), not its data.
            notice = Payload(metrics=out.payload.metrics, stage_done=True)
            self._deliver(
                state,
                stage_id,
                StageOutput(request_id=out.request_id, finished=False, payload=notice),
                finished=False,
                stage_finished=False,
            )
        # Forward to each needed downstream stage whose inputs are all here; a chunked one gets
        # the rest of its chunks.
        for down in consumers:
            if down in self.graph.chunked:
                self.chunks.on_end(out.request_id, down, out)
                if self._requests.get(out.request_id) is not state:
                    return  # its last chunks could not go
                continue
            stage = self.graph.stage(down)
            if (
                down in needed
                and down not in state.running
                and down not in state.done
                and all(src in state.done for src in stage.engine_input_source)
            ):
                try:
                    upstream = {sid: state.done[sid] for sid in stage.engine_input_source}
                    prompt, inputs = self.graph.input(down, state.msg.prompt, upstream)
                except Exception as e:
                    self._finish_with_error(out.request_id, e, down)
                    return
                self._submit(state, down, prompt, inputs)

    # ------------------------------------------------------------------ chunked hand-off (callbacks)

    def _on_delta(self, request_id: str, stage_id: int, out: StageOutput) -> None:
        """A streamed delta of ``stage_id`` (arrays as plain values), or a chunked stage's next partial
        output: to the caller if it asked for the stage, and into the chunked stages it feeds."""
        state = self._requests.get(request_id)
        if state is None:
            return
        if stage_id in state.msg.final_stage_ids:
            self._deliver(state, stage_id, out, finished=False, stage_finished=False)
        self.chunks.on_delta(request_id, self.graph.chunk_consumers(stage_id, state.finals_left), out)

    def _submit_chunk(self, rid: str, stage_id: int, chunk_id: str, chunk: Chunk, inputs: dict[str, Any]) -> None:
        """A chunk to its stage as a sub-request: the stage's input made from it as from any
        upstream output, or for a source stage of a streaming-input request, the caller's text."""
        state = self._requests[rid]
        sources = self.graph.stage(stage_id).engine_input_source
        if sources:
            piece = StageOutput(request_id=rid, payload=Payload(text=chunk.text, tensors=chunk.tensors))
            prompt, made = self.graph.input(stage_id, state.msg.prompt, {sources[0]: piece})
        else:
            prompt, made = chunk.text or "", {}
        self._send(state, stage_id, chunk_id, prompt, made | inputs)

    def _on_chunks_joined(self, request_id: str, stage_id: int, whole: StageOutput) -> None:
        """Every chunk is in: the stage's output (their join) goes on as any finished stage's."""
        state = self._requests.get(request_id)
        if state is not None:
            self._forward(state, stage_id, whole, *self._stage_done(state, stage_id))

    def _deliver(
        self, state: _Request, stage_id: int, out: StageOutput, *, finished: bool, stage_finished: bool
    ) -> None:
        payload = out.payload
        if stage_finished:
            e2e_ms = (time.time() - state.msg.arrival_time) * 1000.0
            metrics = msgspec.structs.replace(payload.metrics, e2e_ms=e2e_ms)
            payload = msgspec.structs.replace(payload, metrics=metrics)
        self._emit(
            state.msg.channel,
            EngineOutput(
                request_id=out.request_id,
                stage_id=stage_id,
                finished=finished,
                stage_finished=stage_finished,
                payload=payload,
            ),
        )

    def _finish_with_error(self, request_id: str, exc: BaseException, stage_id: int | None) -> None:
        """End a request with an error: abort it wherever it still runs, tell the caller once."""
        state = self._requests.get(request_id)
        if state is None:
            return
        for sid in list(state.running):
            self.pools[sid].abort(request_id)
        for sid, sub in self.chunks.forget(request_id):  # every chunk still running, in every stage
            self.pools[sid].abort(sub)
        self._forget(request_id)
        if stage_id is None:
            stage_id = next(iter(state.running), state.msg.final_stage_ids[0])
        e2e_ms = (time.time() - state.msg.arrival_time) * 1000.0
        self._emit(state.msg.channel, _error_output(request_id, stage_id, exc, StageMetrics(e2e_ms=e2e_ms)))

    def _forget(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None and state.timer is not None:
            state.timer.cancel()
        self.chunks.forget(request_id)  # every chunk is done (an error aborted those still out)

    def _on_deadline(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None:
            self._finish_with_error(
                request_id, RequestTimeoutError("request did not finish before its deadline"), stage_id=None
            )

    def _on_requests_lost(self, stage_id: int, request_ids: list[str], error: OmniError) -> None:
        for rid in request_ids:
            owner = self.chunks.owner(rid)  # a chunk's loss is its request's
            self._finish_with_error(rid if owner is None else owner, error, stage_id)

    def _on_stage_gone(self, stage_id: int, reason: str) -> None:
        """A stage has no live replica and no restart left: no request can be served any more."""
        self._die(f"stage {stage_id} has no live replica and no restart left ({reason})")
        assert self.dead is not None  # set by _die
        self._fail_all(self.dead)
        self._tasks.spawn(self._release_dead(), name="release-dead")

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._requests):
            self._finish_with_error(rid, exc, None)

    # ------------------------------------------------------------------ control calls

    async def _rpc(self, msg: EngineRpc) -> None:
        stage_ids = msg.stage_ids if msg.stage_ids is not None else list(self.pools)
        try:
            results = []
            for res in await asyncio.gather(
                *(
                    self.pools[sid].rpc(msg.method, list(msg.args), dict(msg.kwargs), msg.timeout)
                    for sid in stage_ids
                    if sid in self.pools
                )
            ):
                results.extend(res)
            reply = EngineRpcResult(call_id=msg.call_id, results=results)
        except Exception as e:  # the caller gets an answer whatever went wrong
            logger.exception("control call %r failed", msg.method)
            reply = EngineRpcResult(call_id=msg.call_id, error=ErrorInfo.from_exception(e))
        self._emit(msg.channel, reply)


def _error_output(
    request_id: str, stage_id: int, exc: BaseException, metrics: StageMetrics | None = None
) -> EngineOutput:
    sid = getattr(exc, "stage_id", None)
    return EngineOutput(
        request_id=request_id,
        stage_id=stage_id,
        finished=True,
        error=ErrorInfo.from_exception(exc, stage_id if sid is None else sid),
        payload=Payload() if metrics is None else Payload(metrics=metrics),
    )
