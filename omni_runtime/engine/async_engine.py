"""AsyncOmniEngine: the thin caller-side proxy. Lives in the callers' threads and event loops.

It validates and normalises input here, before anything is queued, so bad input is a typed error
at the call site: that includes anything no message could carry (a lone surrogate, an integer
past 64 bits), which would otherwise fail inside the orchestrator thread that serves everyone. It
puts messages on the janus request queue with ``put_nowait`` (a full queue is an immediate
:class:`QueueFullError`, never a wait).

One engine serves any number of event loops, one after another or at once (threads, a server and
a script): each loop that uses it gets a *channel*, a janus output queue of its own drained by a
dispatcher task on that loop, and every request and control call names the channel its answer
goes to. The shared bookkeeping (which requests are pending, on which loop) is guarded by a lock.

Supervision: when the engine can no longer serve (the orchestrator thread died, or a stage lost
every replica for good) every pending request and control call ends at once with
:class:`EngineDeadError`, on its own loop, and so does every later call. A request's deadline also
has a backstop here, on the caller's loop: if the engine has not answered shortly after it, the
caller is released with :class:`RequestTimeoutError` whatever happened inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import janus
import msgspec

from omni_runtime.checks import (
    MAX_IMAGE_PIXELS,
    bounded_defaults,
    check_constraints,
    check_speech_length,
    check_text_length,
)
from omni_runtime.config import check_control_kwargs
from omni_runtime.engine.orchestrator import Orchestrator
from omni_runtime.engine.status import EngineHealth, EngineState, StageStatus
from omni_runtime.exceptions import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
    StreamClosedError,
    UnknownRequestError,
)
from omni_runtime.media import output_type
from omni_runtime.messages import (
    EngineAbort,
    EngineDead,
    EngineOutput,
    EngineRequest,
    EngineRpc,
    EngineRpcResult,
    EngineShutdown,
    EngineUpdate,
    ErrorInfo,
    RpcReplicaResult,
    StageConstraints,
)
from omni_runtime.params import MAX_PROMPT_CHARS, params_to_dict, resolve_params
from omni_runtime.resolve import ResolvedConfig
from omni_runtime.serialization import check_encodable

logger = logging.getLogger(__name__)

#: Longest request id accepted, in characters.
MAX_REQUEST_ID_CHARS = 256
#: Longest control-call timeout accepted, in seconds.
MAX_RPC_TIMEOUT_S = 86_400.0
#: How long after a request's deadline the caller is released even if the engine said nothing.
DEADLINE_GRACE_S = 2.0
#: The constraints of a stage that reported none (checks nothing).
_NO_CONSTRAINTS = StageConstraints()


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validation (:meth:`AsyncOmniEngine.validate`): generate it without
    checking it again. Valid for the engine that made it only."""

    prompt: str
    #: Resolved params per stage id (defaults applied, validated, encodable), as dicts of the
    #: fields that are set (``params_to_dict`` of ``typed``): what a caller reads of them.
    params: dict[int, dict[str, Any]]
    final_stage_ids: list[int]
    #: The request's deadline in seconds, or None.
    timeout: float | None
    engine_id: str
    #: Higher is served first by every stage's scheduler.
    priority: int = 0
    #: The same params as each stage's runner gets them: its params struct, sent as it is.
    typed: dict[int, Any] = field(default_factory=dict)


class _Channel:
    """The outputs for what one event loop asked: a janus queue and the task that drains it."""

    __slots__ = ("dispatcher", "id", "loop", "queue")

    def __init__(self, channel_id: int, loop: asyncio.AbstractEventLoop) -> None:
        self.id = channel_id
        self.loop = loop
        self.queue: janus.Queue = janus.Queue()
        self.dispatcher: asyncio.Task | None = None


class PendingRequest:
    """One admitted request: its outputs arrive on ``stream`` (an asyncio.Queue of EngineOutput)
    on the loop that admitted it; the last one has ``finished=True``."""

    __slots__ = ("channel", "open_input", "request_id", "stream", "timer", "wire_id")

    def __init__(self, request_id: str, wire_id: str, channel: _Channel, open_input: bool = False) -> None:
        self.request_id = request_id
        #: Opened with ``streaming_input`` and its final update not sent yet.
        self.open_input = open_input
        #: Its id inside the engine, unique per admission (see ``AsyncOmniEngine._pending``).
        self.wire_id = wire_id
        self.channel = channel
        self.stream: asyncio.Queue = asyncio.Queue()
        self.timer: asyncio.TimerHandle | None = None


class AsyncOmniEngine:
    """Starts the orchestrator thread and proxies requests, aborts and control calls to it."""

    def __init__(
        self, resolved: ResolvedConfig, *, max_pending: int | None = None, default_timeout: float | None = None
    ) -> None:
        self.resolved = resolved
        self.config = config = resolved.config
        self.max_pending = max_pending or config.max_pending
        self.default_timeout = default_timeout if default_timeout is not None else config.default_timeout_s
        self._lock = threading.Lock()
        # Caller's request id -> its pending request. Inside the engine each admission has an id of
        # its own, so a caller may reuse an id once its request ended (aborted, timed out) and a
        # late output of the old one neither reaches the new one nor collides in a stage's queue.
        self._pending: dict[str, PendingRequest] = {}
        self._rpcs: dict[int, tuple[_Channel, asyncio.Future]] = {}
        self._channels: dict[asyncio.AbstractEventLoop, _Channel] = {}
        self._channel_ids = itertools.count(1)
        self._admissions = itertools.count(1)
        self._rpc_ids = itertools.count(1)
        self._id_prefix = uuid.uuid4().hex[:12]
        self._auto_ids = itertools.count(1)
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._dead_callbacks: list[tuple[asyncio.AbstractEventLoop | None, Callable[[EngineDeadError], Any]]] = []
        # Room for every admitted request plus the aborts and control calls about them.
        self._orchestrator = Orchestrator(
            resolved, request_queue_size=2 * self.max_pending + 256, on_dead=self._on_engine_dead
        )
        self._orchestrator.start()
        self._finalizer = weakref.finalize(self, _stop_orchestrator, self._orchestrator)

    # ------------------------------------------------------------------ state

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def health(self) -> EngineHealth:
        """Whether the engine serves, and each stage's replicas and queues (any thread)."""
        stages = [status for _, status in sorted(self._orchestrator.status().items())]
        dead_stages = [s.stage_id for s in stages if s.live_replicas == 0]
        state: EngineState
        if self._dead is not None:
            state, reason = "dead", str(self._dead)
        elif self._closed or not self._orchestrator.alive:
            state, reason = "closed", "the engine is closed"
        elif dead_stages:
            state, reason = "unhealthy", f"no live replica in stage(s) {dead_stages}"
        else:
            state, reason = "ok", None
        return EngineHealth(
            status=state,
            reason=reason,
            pending=len(self._pending),
            max_pending=self.max_pending,
            stages=stages,
            dead_stages=dead_stages,
        )

    def stage_status(self) -> dict[int, StageStatus]:
        return self._orchestrator.status()

    def max_input_pixels(self) -> int:
        """The most pixels an input image may have: the smallest ``max_pixels`` that a stage taking
        image params reported in its READY message (the process-wide limit when none did). The
        HTTP server checks an upload's header against it before decoding a pixel."""
        limits = [
            limit
            for stage in self.resolved.stages
            if stage.takes_image_params
            and (limit := self._orchestrator.constraints.get(stage.stage_id, _NO_CONSTRAINTS).max_pixels) is not None
        ]
        return min([MAX_IMAGE_PIXELS, *limits])

    def constraints(self) -> dict[int, StageConstraints]:
        """What each loaded stage allows, as its replicas reported it in READY (by stage id)."""
        return dict(self._orchestrator.constraints)

    def frames_step(self) -> int | None:
        """A video model's frame step (it makes ``step * k + 1`` frames), as its stages reported
        it in their READY messages; None when no stage makes videos."""
        steps = [c.frames_step for c in self._orchestrator.constraints.values() if c.frames_step is not None]
        return max(steps) if steps else None

    @property
    def is_running(self) -> bool:
        return not self._closed and self._dead is None and self._orchestrator.alive

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine can no longer serve, or None while it can."""
        return self._dead

    def on_dead(self, callback: Callable[[EngineDeadError], Any]) -> None:
        """Call ``callback(error)`` once when the engine dies: on the calling thread's running
        event loop if there is one, else in the thread that noticed. At once if already dead."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            dead = self._dead
            if dead is None:
                self._dead_callbacks.append((loop, callback))
        if dead is not None:
            callback(dead)

    # ------------------------------------------------------------------ input

    def resolve_params(self, sampling_params: Any) -> dict[int, Any]:
        """Per-stage params structs, validated, defaults applied (the stage's, then its params
        class's fallbacks), checked against each stage's constraints.

        Accepts None, one params object or dict (for a one-stage pipeline, or a typed object for
        the stages of its type), or a list with one entry per stage in ``stage_args`` order.
        """
        stages = self.resolved.stages
        if sampling_params is None:
            given: list[Any] = [None] * len(stages)
        elif isinstance(sampling_params, list | tuple):
            if len(sampling_params) != len(stages):
                raise InvalidRequestError(
                    f"sampling_params_list has {len(sampling_params)} entries; this pipeline has "
                    f"{len(stages)} stages (one entry per stage, None for defaults)",
                    param="sampling_params_list",
                )
            given = list(sampling_params)
        elif len(stages) == 1:
            given = [sampling_params]
        elif isinstance(sampling_params, msgspec.Struct):
            given = [sampling_params if isinstance(sampling_params, s.params_cls) else None for s in stages]
            if not any(g is not None for g in given):
                raise InvalidRequestError(
                    f"no stage of this pipeline takes {type(sampling_params).__name__}", param="sampling_params"
                )
        else:
            raise InvalidRequestError(
                "this pipeline has several stages: pass sampling_params_list with one entry per stage",
                param="sampling_params_list",
            )
        resolved = {}
        for stage, params in zip(stages, given, strict=True):
            constraints = self._orchestrator.constraints.get(stage.stage_id, _NO_CONSTRAINTS)
            # A length the request leaves to the stage is the stage's default within its bounds.
            defaults = bounded_defaults(stage.params_cls, stage.defaults, constraints)
            typed = resolve_params(stage.params_cls, defaults, params)
            check_constraints(typed, constraints)
            resolved[stage.stage_id] = typed
        return resolved

    def final_stages(self, modalities: Sequence[str] | None) -> list[int]:
        """Final stage ids for the requested output modalities (None = all final outputs)."""
        finals = [s for s in self.config.stage_args if s.final_output]
        if modalities is None:
            return [s.stage_id for s in finals]
        if isinstance(modalities, str) or not isinstance(modalities, Sequence):
            raise InvalidRequestError("modalities must be a list of strings", param="modalities")
        if not all(isinstance(m, str) for m in modalities):
            raise InvalidRequestError("modalities must be a list of strings", param="modalities")
        wanted = {output_type(m) for m in modalities}
        chosen = [s.stage_id for s in finals if s.final_output_type in wanted]
        if not chosen:
            # A final stage has a type (checked at load).
            available = sorted({s.final_output_type for s in finals if s.final_output_type is not None})
            check_encodable(sorted(wanted), "modalities")
            raise InvalidRequestError(
                f"no final stage produces {sorted(wanted)}; this pipeline offers {available}", param="modalities"
            )
        return chosen

    # ------------------------------------------------------------------ requests

    def validate(
        self, prompt: Any, sampling_params: Any = None, modalities: Sequence[str] | None = None
    ) -> ValidRequest:
        """Check a request once, completely, before anything is queued: the prompt, every stage's
        params (defaults applied, model constraints), the requested outputs, and that all of it can
        travel. Raises InvalidRequestError naming the field."""
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(
                f"prompt is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}", param="prompt"
            )
        check_encodable(prompt, "prompt")
        typed = self.resolve_params(sampling_params)
        params = {stage_id: params_to_dict(p) for stage_id, p in typed.items()}
        for stage in self.resolved.stages:
            if not stage.config.engine_input_source:  # the stages that take the prompt itself
                constraints = self._orchestrator.constraints.get(stage.stage_id, _NO_CONSTRAINTS)
                check_speech_length(prompt, params[stage.stage_id], constraints)
                check_text_length(prompt, params[stage.stage_id], constraints)
        finals = self.final_stages(modalities)
        timeout = next((p["timeout"] for p in params.values() if p.get("timeout")), self.default_timeout)
        priority = next((p["priority"] for p in params.values() if p.get("priority") is not None), 0)
        return ValidRequest(prompt, params, finals, timeout, self._id_prefix, priority, typed)

    def add_request(
        self,
        request: ValidRequest | Any,
        sampling_params: Any = None,
        request_id: str | None = None,
        modalities: Sequence[str] | None = None,
        streaming_input: bool = False,
    ) -> PendingRequest:
        """Enqueue one request (a prompt, validated here, or a :class:`ValidRequest`); its outputs
        arrive on the returned request's stream. With ``streaming_input`` the prompt is only the
        first piece of the input: :meth:`add_streaming_update` appends more, and the final one
        ends it.

        Must be called on a running event loop (any loop: each gets its own output channel).
        Raises InvalidRequestError, DuplicateRequestError, QueueFullError, EngineClosedError or
        EngineDeadError at once.
        """
        self._ensure_open()
        if isinstance(request, ValidRequest):
            if request.engine_id != self._id_prefix:
                raise InvalidRequestError("this request was validated by another engine", param="request")
            valid = request
        else:
            valid = self.validate(request, sampling_params, modalities)
        if request_id is None:
            # Unique per engine without a system call per request (uuid4 reads os.urandom).
            request_id = f"{self._id_prefix}-{next(self._auto_ids)}"
        elif not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(
                f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} characters",
                param="request_id",
            )
        else:
            check_encodable(request_id, "request_id")
        timeout = valid.timeout
        channel = self._channel()
        with self._lock:
            self._ensure_open()
            if request_id in self._pending:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight", param="request_id")
            if len(self._pending) >= self.max_pending:
                raise QueueFullError(
                    f"{len(self._pending)} requests pending (max_pending={self.max_pending}); retry later"
                )
            wire_id = f"{request_id}#{next(self._admissions)}"
            msg = EngineRequest(
                request_id=wire_id,
                channel=channel.id,
                prompt=valid.prompt,
                params=valid.typed,
                final_stage_ids=valid.final_stage_ids,
                arrival_time=time.time(),
                deadline=time.monotonic() + timeout if timeout else None,
                priority=valid.priority,
                streaming_input=streaming_input,
            )
            try:
                self._orchestrator.request_queue.sync_q.put_nowait(msg)
            except (janus.SyncQueueFull, janus.SyncQueueShutDown):
                raise QueueFullError("the engine's request queue is full; retry later") from None
            pending = PendingRequest(request_id, wire_id, channel, streaming_input)
            self._pending[request_id] = pending
        if timeout:
            # The backstop: released on this loop even if the engine never says a word.
            pending.timer = channel.loop.call_later(timeout + DEADLINE_GRACE_S, self._expire, pending)
        return pending

    def add_streaming_update(
        self, request_id: str, text: str | None = None, inputs: dict[str, Any] | None = None, final: bool = False
    ) -> None:
        """Append input to a request opened with ``streaming_input``, from any thread. Raises
        EngineClosedError or EngineDeadError (as every call), UnknownRequestError (not in flight,
        or not opened for updates), StreamClosedError (after its final update) or
        InvalidRequestError (``text`` past ``MAX_PROMPT_CHARS``, a value no message can carry) at
        once."""
        self._ensure_open()
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError(f"`text` must be a string, got {type(text).__name__}", param="text")
        if text is not None and len(text) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(
                f"text is {len(text)} characters; the limit of one update is {MAX_PROMPT_CHARS}", param="text"
            )
        if inputs is not None and not isinstance(inputs, dict):
            raise InvalidRequestError(f"`inputs` must be a mapping, got {type(inputs).__name__}", param="inputs")
        check_encodable(text, "text")
        check_encodable(inputs or {}, "inputs")
        with self._lock:
            self._ensure_open()
            pending = self._pending.get(request_id) if isinstance(request_id, str) else None
            if pending is None:
                raise UnknownRequestError(f"no request {request_id!r} in flight", param="request_id")
            if not pending.open_input:
                raise StreamClosedError(
                    f"request {request_id!r} takes no more input (not opened with streaming_input, "
                    "or its final update was sent)",
                    param="request_id",
                )
            msg = EngineUpdate(request_id=pending.wire_id, text=text, inputs=dict(inputs or {}), final=bool(final))
            try:
                self._orchestrator.request_queue.sync_q.put_nowait(msg)
            except (janus.SyncQueueFull, janus.SyncQueueShutDown):
                raise QueueFullError("the engine's request queue is full; retry later") from None
            if final:
                pending.open_input = False

    def abort(self, request_ids: str | Sequence[str], reason: BaseException | None = None) -> None:
        """Abort requests wherever they are, from any thread or loop. Their streams end with
        ``reason`` (default RequestAbortedError) at once, without waiting for the stages."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            ended = [p for rid in ids if isinstance(rid, str) and (p := self._pending.pop(rid, None)) is not None]
        self._abort_ended(ended, reason)

    def abort_dropped(self, pending: PendingRequest) -> None:
        """Abort ``pending`` soon, on its own loop, if it is still in flight then: its stream was
        dropped unread. For a finalizer: it may run in any thread, in a garbage collection while
        that thread holds a lock here, so it only schedules the abort. A later request that reuses
        the id is not touched."""
        with contextlib.suppress(RuntimeError):  # a closed loop: its requests go with it (``_channel``)
            pending.channel.loop.call_soon_threadsafe(self._abort_if_pending, pending)

    def _abort_if_pending(self, pending: PendingRequest) -> None:
        with self._lock:
            ours = self._pending.get(pending.request_id) is pending
            if ours:
                del self._pending[pending.request_id]
        if ours:
            self._abort_ended([pending], RequestAbortedError("its stream was dropped unread"))

    def _abort_ended(self, ended: list[PendingRequest], reason: BaseException | None) -> None:
        """End the streams of requests just taken out of ``_pending`` and tell the stages."""
        if not ended:
            return
        info = ErrorInfo.from_exception(reason or RequestAbortedError("request aborted"))
        for p in ended:
            self._end(p, info)
        if self.is_running:
            try:
                self._orchestrator.request_queue.sync_q.put_nowait(
                    EngineAbort(request_ids=[p.wire_id for p in ended], reason=info)
                )
            except (janus.SyncQueueFull, janus.SyncQueueShutDown):
                logger.warning("request queue full: the abort of %d request(s) reaches the stages late", len(ended))

    def _expire(self, pending: PendingRequest) -> None:
        if self._pending.get(pending.request_id) is pending:
            logger.error("request %s: no answer from the engine by its deadline; released here", pending.request_id)
            self.abort(pending.request_id, RequestTimeoutError("request did not finish before its deadline"))

    def _end(self, pending: PendingRequest, error: ErrorInfo) -> None:
        """Give a request (no longer in ``_pending``) its last output, on its own loop."""
        msg = EngineOutput(request_id=pending.request_id, stage_id=-1, finished=True, error=error)
        _on_loop(pending.channel.loop, _end_stream, pending, msg)

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        stage_ids: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[RpcReplicaResult]:
        """Run ``method`` on every live replica of ``stage_ids`` (all stages by default)."""
        self._ensure_open()
        if not isinstance(method, str) or not method or len(method) > 256:
            raise InvalidRequestError("method must be a non-empty string of at most 256 characters", param="method")
        check_encodable(method, "method")
        if isinstance(args, str | bytes) or not isinstance(args, Sequence):
            raise InvalidRequestError(f"args must be a list, got {type(args).__name__}", param="args")
        if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
            raise InvalidRequestError("kwargs must be a mapping with string keys", param="kwargs")
        check_encodable(list(args), "args")
        check_encodable(dict(kwargs or {}), "kwargs")
        # A built-in call's fields within the deploy YAML's bounds (set_batching: max_num_seqs...).
        kwargs = check_control_kwargs(method, dict(kwargs or {}), prefix="kwargs.")
        if stage_ids is not None:
            if isinstance(stage_ids, str | bytes) or not isinstance(stage_ids, Sequence):
                raise InvalidRequestError("stage_ids must be a list of stage ids", param="stage_ids")
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in stage_ids):
                raise InvalidRequestError("stage_ids must be a list of integers", param="stage_ids")
            unknown = set(stage_ids) - {s.stage_id for s in self.config.stage_args}
            if unknown:
                shown = sorted(unknown)[:8]
                raise InvalidRequestError(f"unknown stage id(s) {shown}", param="stage_ids")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_RPC_TIMEOUT_S
        ):
            raise InvalidRequestError(
                f"timeout must be a number of seconds in (0, {MAX_RPC_TIMEOUT_S:g}]", param="timeout"
            )
        channel = self._channel()
        fut = channel.loop.create_future()
        with self._lock:
            self._ensure_open()
            call_id = next(self._rpc_ids)
            msg = EngineRpc(
                call_id=call_id,
                channel=channel.id,
                method=method,
                args=list(args),
                kwargs=dict(kwargs or {}),
                stage_ids=list(stage_ids) if stage_ids is not None else None,
                timeout=timeout,
            )
            try:
                self._orchestrator.request_queue.sync_q.put_nowait(msg)
            except (janus.SyncQueueFull, janus.SyncQueueShutDown):
                raise QueueFullError("the engine's request queue is full; retry later") from None
            self._rpcs[call_id] = (channel, fut)
        try:
            if timeout is None:
                return await fut
            # The backstop: each replica answers by ``timeout``; the call as a whole shortly after.
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout + DEADLINE_GRACE_S)
            except TimeoutError:
                raise RequestTimeoutError(f"control call {method!r} got no answer from the engine") from None
        finally:
            with self._lock:
                self._rpcs.pop(call_id, None)

    # ------------------------------------------------------------------ output dispatch

    def _channel(self) -> _Channel:
        """This loop's channel, made on first use (and channels of closed loops dropped)."""
        loop = asyncio.get_running_loop()
        channel = self._channels.get(loop)
        if channel is not None:
            if channel.dispatcher is None or channel.dispatcher.done():
                # Cancelled under us (asyncio.run cancels every task it leaves): drain again.
                channel.dispatcher = loop.create_task(self._dispatch(channel), name=f"omni-dispatch-{channel.id}")
            return channel
        with self._lock:
            channel = self._channels.get(loop)
            if channel is not None:
                return channel
            gone = [c for c in self._channels.values() if c.loop.is_closed()]
            for c in gone:
                del self._channels[c.loop]
                self._orchestrator.channels.pop(c.id, None)
            orphans = [p for p in self._pending.values() if p.channel in gone]
            for p in orphans:
                del self._pending[p.request_id]
            channel = _Channel(next(self._channel_ids), loop)
            self._channels[loop] = channel
            self._orchestrator.channels[channel.id] = channel.queue
        if orphans:
            # Nobody can read their answers any more (their loop is closed): stop the work.
            try:
                self._orchestrator.request_queue.sync_q.put_nowait(
                    EngineAbort(request_ids=[p.wire_id for p in orphans])
                )
            except (janus.SyncQueueFull, janus.SyncQueueShutDown):
                pass
        channel.dispatcher = loop.create_task(self._dispatch(channel), name=f"omni-dispatch-{channel.id}")
        return channel

    async def _dispatch(self, channel: _Channel) -> None:
        queue = channel.queue.async_q
        while True:
            try:
                msg = await queue.get()
            except janus.AsyncQueueShutDown:
                return
            if isinstance(msg, EngineOutput):
                rid = msg.request_id.rpartition("#")[0]
                with self._lock:
                    pending = self._pending.get(rid)
                    if pending is None or pending.wire_id != msg.request_id:
                        continue  # aborted by the caller meanwhile (and its id perhaps reused since)
                    if msg.finished:
                        del self._pending[rid]
                if msg.finished and pending.timer is not None:
                    pending.timer.cancel()
                pending.stream.put_nowait(msg)
            elif isinstance(msg, EngineRpcResult):
                with self._lock:
                    entry = self._rpcs.get(msg.call_id)
                if entry is not None and not entry[1].done():
                    if msg.error is not None:
                        entry[1].set_exception(msg.error.to_exception())
                    else:
                        entry[1].set_result(msg.results)
            elif isinstance(msg, EngineDead):
                self._fail_everything(msg.error.to_exception(), channel)

    # ------------------------------------------------------------------ death and shutdown

    def _ensure_open(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineClosedError("the engine is closed")
        if not self._orchestrator.alive:
            raise EngineClosedError("the engine's orchestrator has stopped")

    def _on_engine_dead(self, error: EngineDeadError) -> None:
        """From the orchestrator thread (or its last words): refuse what comes, and end what is
        pending on each channel after the outputs already on their way (a request lost with its
        replica keeps its StageDeadError)."""
        with self._lock:
            if self._dead is not None or self._closed:
                return
            self._dead = error
            callbacks, self._dead_callbacks = self._dead_callbacks, []
            channels = list(self._channels.values())
        marker = EngineDead(error=ErrorInfo.from_exception(error))
        for channel in channels:
            try:
                channel.queue.sync_q.put_nowait(marker)
            except (janus.SyncQueueShutDown, RuntimeError):
                pass  # that loop is gone: nobody waits there
        for loop, callback in callbacks:
            if loop is None:
                _call_quietly(callback, error)
            else:
                _on_loop(loop, _call_quietly, callback, error)

    def _fail_everything(self, error: BaseException, channel: _Channel | None = None) -> None:
        """End every pending request and control call (of ``channel`` only, if given)."""
        with self._lock:
            pending = [p for p in self._pending.values() if channel is None or p.channel is channel]
            ended = [(c, call_id) for call_id, c in self._rpcs.items() if channel is None or c[0] is channel]
            for p in pending:
                del self._pending[p.request_id]
            for _, call_id in ended:
                del self._rpcs[call_id]
        info = ErrorInfo.from_exception(error)
        for p in pending:
            self._end(p, info)
        for (rpc_channel, fut), _ in ended:
            _on_loop(rpc_channel.loop, _fail_future, fut, info)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the orchestrator and every stage process; pending requests end with EngineClosedError.
        Safe from any thread; closing twice is a no-op."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail_everything(EngineClosedError("engine closed"))
        self._finalizer()
        self._orchestrator.join(timeout)
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            if channel.dispatcher is not None:
                _on_loop(channel.loop, channel.dispatcher.cancel)


def _on_loop(loop: asyncio.AbstractEventLoop, func: Callable[..., Any], *args: Any) -> None:
    """Run ``func(*args)`` on ``loop``: now if that is the running loop, else soon from any thread."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        func(*args)
    elif not loop.is_closed():
        try:
            loop.call_soon_threadsafe(func, *args)
        except RuntimeError:
            pass  # closed meanwhile: nobody waits there any more


def _end_stream(pending: PendingRequest, msg: EngineOutput) -> None:
    if pending.timer is not None:
        pending.timer.cancel()
    pending.stream.put_nowait(msg)


def _fail_future(fut: asyncio.Future, error: ErrorInfo) -> None:
    if not fut.done():
        fut.set_exception(error.to_exception())


def _call_quietly(callback: Callable[[Any], Any], arg: Any) -> None:
    try:
        callback(arg)
    except Exception:
        logger.exception("engine callback failed")


def _stop_orchestrator(orchestrator: Orchestrator) -> None:
    """Also runs at garbage collection / interpreter exit, so no stage process outlives us."""
    try:
        orchestrator.request_queue.sync_q.put(EngineShutdown(), timeout=5.0)
    except Exception:
        pass
    orchestrator.join(30.0)
