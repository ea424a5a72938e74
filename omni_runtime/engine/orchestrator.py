"""Orchestrator: runs in its own thread, on its own uvloop event loop.

It awaits two things and nothing else: the janus request queue from the callers, and the stage
replicas (through their clients). No polling loops, no sleeps: an idle engine sleeps in
``epoll``. It routes each request through the stage graph (``engine_input_source``), builds each
stage's input from its upstream outputs, delivers final outputs to the caller's output queue, and
runs control calls as tasks of their own so they never hold up request intake.

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
from collections import deque
from collections.abc import Callable
from typing import Any

import janus
import msgspec

from omni_runtime.config import DeployConfig, InputChunking, StageConfig
from omni_runtime.engine.backends import EngineResources, StageBackend, make_backends
from omni_runtime.engine.chunking import Chunk, Chunker, join_outputs
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
from omni_runtime.media import MediaItem, items_of
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

#: How a source stage takes a streaming-input request (the caller is its upstream): a sentence
#: at a time, or 32 words where no sentence ends sooner.
STREAMING_INPUT_CHUNKING = InputChunking(policy="sentence", size=32, max_buffered=2)

#: Seconds a failed start waits for the orchestrator thread to release what it made (each
#: release is bounded on its own; this only keeps a wedged one from hanging the caller).
_RELEASE_WAIT_S = 90.0


class _Request:
    """Routing state of one request inside the orchestrator."""

    __slots__ = ("done", "feeds", "finals_left", "msg", "running", "settling", "timer")

    def __init__(self, msg: EngineRequest, finals: set[int]) -> None:
        self.msg = msg
        self.finals_left = set(finals)
        self.done: dict[int, StageOutput] = {}
        self.running: set[int] = set()
        self.timer: asyncio.TimerHandle | None = None
        #: The last of this request's outputs whose arrays a backend is still fetching.
        self.settling: asyncio.Task | None = None
        #: Chunked stages (``input_chunking``) by id: this request's hand-off into each.
        self.feeds: dict[int, _Feed] = {}


class _Feed:
    """One request's chunked hand-off into one stage: chunks cut and not yet sent, chunks sent
    and not yet done (at most ``max_buffered``), outputs waiting for an earlier chunk's."""

    __slots__ = ("chunker", "extras", "fed", "last_index", "next_out", "outputs", "outstanding", "ready", "results")

    def __init__(self, chunker: Chunker) -> None:
        self.chunker = chunker
        self.fed = False  # the upstream streamed something into it
        self.ready: deque[Chunk] = deque()
        self.outstanding: dict[str, int] = {}  # sub-request id -> chunk index
        self.results: dict[int, StageOutput] = {}  # done out of order, by chunk index
        self.next_out = 0  # the chunk whose output goes on next
        self.outputs: list[StageOutput] = []  # gone on, in chunk order
        self.last_index: int | None = None  # known once the last chunk is cut
        self.extras: dict[str, Any] = {}  # streaming updates' inputs, for the next chunk sent


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
        self.config = config = resolved.config
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
        self._downstream: dict[int, list[int]] = {s.stage_id: [] for s in config.stage_args}
        for s in config.stage_args:
            for src in s.engine_input_source:
                self._downstream[src].append(s.stage_id)
        self._input_funcs = {s.stage_id: s.input_func for s in resolved.stages if s.input_func is not None}
        #: The chunked stages; a chunk's sub-request id -> (its request's id, the stage's id).
        self._chunked = {s.stage_id: s.input_chunking for s in config.stage_args if s.input_chunking is not None}
        self._subs: dict[str, tuple[str, int]] = {}
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
        self.constraints = {sid: p.constraints for sid, p in self.pools.items()}

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
        needed = self._needed_stages(state.finals_left)
        for stage in self.config.stage_args:
            if stage.stage_id in needed and not stage.engine_input_source:
                if msg.streaming_input:  # the prompt is the input's first piece
                    state.feeds[stage.stage_id] = _Feed(Chunker(STREAMING_INPUT_CHUNKING))
                    self._update(EngineUpdate(request_id=msg.request_id, text=msg.prompt))
                else:
                    self._submit(state, stage.stage_id, msg.prompt, {})

    def _update(self, msg: EngineUpdate) -> None:
        """More input for a streaming-input request: into each source stage's chunker."""
        state = self._requests.get(msg.request_id)
        if state is None or not state.msg.streaming_input:
            return  # it ended meanwhile (the caller checked the rest)
        for stage_id, feed in list(state.feeds.items()):
            if self.config.stage(stage_id).engine_input_source or feed.chunker.finished:
                continue
            feed.extras.update(msg.inputs)
            feed.fed = True
            feed.ready.extend(feed.chunker.feed(msg.text))
            if msg.final:
                feed.ready.extend(feed.chunker.finish())
                feed.last_index = feed.chunker.chunks_made - 1
            self._pump(state, stage_id)
            if self._requests.get(msg.request_id) is not state:
                return

    def _needed_stages(self, finals: set[int]) -> set[int]:
        needed, todo = set(), list(finals)
        while todo:
            sid = todo.pop()
            if sid not in needed:
                needed.add(sid)
                todo.extend(self.config.stage(sid).engine_input_source)
        return needed

    def _submit(self, state: _Request, stage_id: int, prompt: Any, inputs: dict[str, Any]) -> None:
        msg = state.msg
        try:
            self.pools[stage_id].submit(
                StageRequest(
                    request_id=msg.request_id,
                    prompt=prompt,
                    params=msg.params.get(stage_id, {}),
                    inputs=inputs,
                    arrival_time=msg.arrival_time,
                    priority=msg.priority,
                )
            )
        except Exception as e:  # no live replica, or a value no message can carry
            self._finish_with_error(msg.request_id, e, stage_id)
            return
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
        owner = self._subs.get(out.request_id)
        if owner is not None:
            self._route_chunk_output(stage_id, owner[0], out)
            return
        state = self._requests.get(out.request_id)
        if state is None:
            return  # aborted, timed out or failed meanwhile: drop it
        if out.error is not None:
            self.pools[stage_id].done(out.request_id)
            self._finish_with_error(out.request_id, out.error.to_exception(), stage_id)
            return
        backend = self._backend_of[stage_id]
        if not out.finished:  # a streamed delta: pass it on to the caller and to chunked stages
            if stage_id in state.msg.final_stage_ids or self._chunk_consumers(state, stage_id):
                self._after_settle(state, backend.settle(out, None), lambda o: self._on_delta(state, stage_id, o))
            elif out.payload.progress is not None:  # an inner stage's progress: the caller sees it too
                self._deliver(state, stage_id, out, finished=False, stage_finished=False)
            return
        self.pools[stage_id].done(out.request_id)
        state.running.discard(stage_id)
        deliver = stage_id in state.finals_left
        state.finals_left.discard(stage_id)
        needed = self._needed_stages(state.finals_left)
        consumers = [d for d in self._downstream[stage_id] if d in needed]
        # The output goes on as it is only to a single consumer that takes it unchanged (no input
        # function); the caller, several stages or a function get plain values.
        only = (
            consumers[0]
            if len(consumers) == 1
            and not deliver
            and consumers[0] not in self._input_funcs
            and consumers[0] not in self._chunked
            else None
        )
        settled = backend.settle(out, None if only is None else self.config.stage(only))
        self._after_settle(state, settled, lambda o: self._forward(state, stage_id, o, deliver, consumers, needed))

    def _after_settle(self, state: _Request, settled: Any, then: Callable[[StageOutput], None]) -> None:
        """``then(output)`` now, or, when a backend must fetch the output's arrays first, once it
        has: after every earlier output of the same request, which keeps their order."""
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
            if down in self._chunked:
                self._end_feed(state, stage_id, down, out)
                continue
            stage = self.config.stage(down)
            if (
                down in needed
                and down not in state.running
                and down not in state.done
                and all(src in state.done for src in stage.engine_input_source)
            ):
                try:
                    prompt, inputs = self._stage_input(stage, state)
                except Exception as e:
                    self._finish_with_error(out.request_id, e, down)
                    return
                self._submit(state, down, prompt, inputs)

    def _stage_input(
        self, stage: StageConfig, state: _Request, upstream: dict[int, StageOutput] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Map upstream outputs (and the original prompt) to this stage's (prompt, inputs)."""
        if upstream is None:
            upstream = {sid: state.done[sid] for sid in stage.engine_input_source}
        func = self._input_funcs.get(stage.stage_id)
        if func is not None:
            result = func(
                state.msg.prompt,
                {
                    sid: {"text": o.payload.text, "images": _arrays(o.payload.media), "tensors": o.payload.tensors}
                    for sid, o in upstream.items()
                },
            )
            return result.get("prompt", state.msg.prompt), dict(result.get("inputs", {}))
        # Default: upstream text becomes the prompt; tensors pass through by name.
        inputs: dict[str, Any] = {}
        texts = []
        for o in upstream.values():
            inputs.update(o.payload.tensors)
            images = _arrays(o.payload.media)
            if images:
                inputs["images"] = images
            if o.payload.text is not None:
                texts.append(o.payload.text)
        if texts:
            inputs["text"] = "\n".join(texts)
            return inputs["text"], inputs
        return state.msg.prompt, inputs

    # ------------------------------------------------------------------ chunked hand-off

    def _chunk_consumers(self, state: _Request, stage_id: int) -> list[int]:
        """The chunked stages this request needs that take ``stage_id``'s streamed output."""
        downs = [d for d in self._downstream[stage_id] if d in self._chunked]
        if not downs:
            return []
        needed = self._needed_stages(state.finals_left)
        return [d for d in downs if d in needed]

    def _feed(self, state: _Request, down: int) -> _Feed:
        feed = state.feeds.get(down)
        if feed is None:  # only chunked stages get one here (a source stage's is made at _add)
            feed = state.feeds[down] = _Feed(Chunker(self._chunked[down]))
        return feed

    def _on_delta(self, state: _Request, stage_id: int, out: StageOutput) -> None:
        """A streamed delta of ``stage_id`` (its arrays plain values): to the caller if it asked
        for the stage, and into the chunker of each chunked stage it feeds."""
        if self._requests.get(out.request_id) is not state:
            return
        if stage_id in state.msg.final_stage_ids:
            self._deliver(state, stage_id, out, finished=False, stage_finished=False)
        for down in self._chunk_consumers(state, stage_id):
            feed = self._feed(state, down)
            if feed.chunker.finished:
                continue
            if out.payload.text or out.payload.tensors:
                feed.fed = True
            feed.ready.extend(feed.chunker.feed(out.payload.text, out.payload.tensors))
            self._pump(state, down)

    def _end_feed(self, state: _Request, stage_id: int, down: int, out: StageOutput) -> None:
        """The upstream finished: the chunker's last chunks go. An upstream that streamed nothing
        (a runner that does not stream) is fed its whole output first, so it is chunked too."""
        feed = self._feed(state, down)
        if not feed.fed:
            feed.ready.extend(feed.chunker.feed(out.payload.text, out.payload.tensors))
        feed.ready.extend(feed.chunker.finish())
        feed.last_index = feed.chunker.chunks_made - 1
        self._pump(state, down)

    def _pump(self, state: _Request, down: int) -> None:
        """Submit ready chunks to ``down`` in order while fewer than ``max_buffered`` run there."""
        feed = state.feeds[down]
        policy = self._chunked.get(down)
        limit = (policy or STREAMING_INPUT_CHUNKING).max_buffered
        rid = state.msg.request_id
        stage = self.config.stage(down)
        while feed.ready and len(feed.outstanding) < limit:
            chunk = feed.ready.popleft()
            if stage.engine_input_source:
                src = stage.engine_input_source[0]
                piece = StageOutput(request_id=rid, payload=Payload(text=chunk.text, tensors=chunk.tensors))
                try:
                    prompt, inputs = self._stage_input(stage, state, {src: piece})
                except Exception as e:
                    self._finish_with_error(rid, e, down)
                    return
            else:  # a source stage of a streaming-input request: the caller's text
                prompt, inputs = chunk.text or "", {}
            inputs |= {**feed.extras, **chunk.tensors, "chunk_index": chunk.index, "last_chunk": chunk.last}
            feed.extras = {}
            sub = f"{rid}#chunk{chunk.index}"
            try:
                self.pools[down].submit(
                    StageRequest(
                        request_id=sub,
                        prompt=prompt,
                        params=state.msg.params.get(down, {}),
                        inputs=inputs,
                        arrival_time=state.msg.arrival_time,
                        priority=state.msg.priority,
                    )
                )
            except Exception as e:  # no live replica, or a value no message can carry
                self._finish_with_error(rid, e, down)
                return
            feed.outstanding[sub] = chunk.index
            self._subs[sub] = (rid, down)
            state.running.add(down)

    def _route_chunk_output(self, stage_id: int, rid: str, out: StageOutput) -> None:
        """An output of one chunk's sub-request: its request's next partial output, in chunk
        order; the stage's output once the last chunk is in."""
        if not out.finished:
            return  # a chunk's own streamed pieces: the chunk's whole output goes on instead
        self.pools[stage_id].done(out.request_id)
        self._subs.pop(out.request_id, None)
        state = self._requests.get(rid)
        feed = state.feeds.get(stage_id) if state is not None else None
        if state is None or feed is None or out.request_id not in feed.outstanding:
            return
        index = feed.outstanding.pop(out.request_id)
        if out.error is not None:
            self._finish_with_error(rid, out.error.to_exception(), stage_id)
            return
        self._pump(state, stage_id)  # room for the next chunk
        settled = self._backend_of[stage_id].settle(out, None)
        self._after_settle(state, settled, lambda o: self._chunk_done(state, stage_id, index, o))

    def _chunk_done(self, state: _Request, stage_id: int, index: int, out: StageOutput) -> None:
        feed = state.feeds[stage_id]
        feed.results[index] = out
        while feed.next_out in feed.results:
            piece = feed.results.pop(feed.next_out)
            feed.next_out += 1
            feed.outputs.append(piece)
            delta = msgspec.structs.replace(piece, request_id=state.msg.request_id, finished=False)
            self._on_delta(state, stage_id, delta)
            if self._requests.get(state.msg.request_id) is not state:
                return  # the delta ended the request (an error downstream)
        if feed.last_index is None or feed.next_out <= feed.last_index:
            return
        # 1) every chunk is in: the stage's output is their concatenation
        # 2) then as any stage that finished: delivered if asked for, forwarded downstream
        whole = StageOutput(request_id=state.msg.request_id, payload=join_outputs([o.payload for o in feed.outputs]))
        state.running.discard(stage_id)
        deliver = stage_id in state.finals_left
        state.finals_left.discard(stage_id)
        needed = self._needed_stages(state.finals_left)
        consumers = [d for d in self._downstream[stage_id] if d in needed]
        self._forward(state, stage_id, whole, deliver, consumers, needed)

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
        for sid, feed in state.feeds.items():  # every chunk still running, in every stage
            for sub in feed.outstanding:
                self._subs.pop(sub, None)
                self.pools[sid].abort(sub)
            feed.outstanding.clear()
        self._forget(request_id)
        if stage_id is None:
            stage_id = next(iter(state.running), state.msg.final_stage_ids[0])
        e2e_ms = (time.time() - state.msg.arrival_time) * 1000.0
        self._emit(state.msg.channel, _error_output(request_id, stage_id, exc, StageMetrics(e2e_ms=e2e_ms)))

    def _forget(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None and state.timer is not None:
            state.timer.cancel()

    def _on_deadline(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None:
            self._finish_with_error(
                request_id, RequestTimeoutError("request did not finish before its deadline"), stage_id=None
            )

    def _on_requests_lost(self, stage_id: int, request_ids: list[str], error: OmniError) -> None:
        for rid in request_ids:
            owner = self._subs.get(rid)  # a chunk's loss is its request's
            self._finish_with_error(rid if owner is None else owner[0], error, stage_id)

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


def _arrays(media: list[MediaItem]) -> list[Any]:
    """The arrays of the images among ``media``: what a downstream stage and an input function
    get as ``inputs["images"]`` / ``upstream[sid]["images"]``."""
    return [m.data for m in items_of(media, "image")]
