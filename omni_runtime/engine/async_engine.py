"""AsyncOmniEngine: the thin caller-side proxy. Lives in the callers' threads and event loops.

It validates and normalises input here, before anything is queued, so bad input is a typed error
at the call site (:mod:`omni_runtime.engine.validation`). It puts messages on the janus request
queue with ``put_nowait`` (a full queue is an immediate :class:`QueueFullError`, never a wait).

One engine serves any number of event loops, one after another or at once: each loop that uses it
gets an output channel of its own, and every request and control call names the channel its
answer goes to (:mod:`omni_runtime.engine.channels`).

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
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import janus

from omni_runtime.checks import MAX_IMAGE_PIXELS
from omni_runtime.engine.channels import Channels, PendingRequest, on_loop
from omni_runtime.engine.orchestrator import Orchestrator
from omni_runtime.engine.status import EngineHealth, EngineState, StageStatus
from omni_runtime.engine.validation import MAX_REQUEST_ID_CHARS as MAX_REQUEST_ID_CHARS
from omni_runtime.engine.validation import MAX_RPC_TIMEOUT_S as MAX_RPC_TIMEOUT_S
from omni_runtime.engine.validation import (
    NO_CONSTRAINTS,
    ValidRequest,
    check_entry_stages,
    check_prompt,
    check_prompt_lengths,
    check_request_id,
    check_rpc,
    check_update,
    chosen_stages,
    final_stages,
    resolve_stage_params,
)
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
from omni_runtime.messages import (
    EngineAbort,
    EngineDead,
    EngineRequest,
    EngineRpc,
    EngineShutdown,
    EngineUpdate,
    ErrorInfo,
    RpcReplicaResult,
    StageConstraints,
)
from omni_runtime.params import params_to_dict
from omni_runtime.resolve import ResolvedConfig

logger = logging.getLogger(__name__)

#: How long after a request's deadline the caller is released even if the engine said nothing.
DEADLINE_GRACE_S = 2.0


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
        # The pending requests and control calls, by the loop their answers go to.
        self._channels = Channels(self._orchestrator, self._lock)
        self._orchestrator.start()
        self._finalizer = weakref.finalize(self, _stop_orchestrator, self._orchestrator)

    # ------------------------------------------------------------------ state

    @property
    def num_pending(self) -> int:
        return len(self._channels.pending)

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
            pending=len(self._channels.pending),
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
            and (limit := self._orchestrator.constraints.get(stage.stage_id, NO_CONSTRAINTS).max_pixels) is not None
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
        """Per-stage params structs, defaults applied, checked against what each stage reported
        in READY (:func:`~omni_runtime.engine.validation.resolve_stage_params`)."""
        return resolve_stage_params(self.resolved, self._orchestrator.constraints, sampling_params)

    def final_stages(self, modalities: Sequence[str] | None) -> list[int]:
        """Final stage ids for the requested output modalities (None = all final outputs)."""
        return final_stages(self.config, modalities)

    # ------------------------------------------------------------------ requests

    def validate(
        self,
        prompt: Any,
        sampling_params: Any = None,
        modalities: Sequence[str] | None = None,
        stages: Sequence[int] | None = None,
        entry_stages: Sequence[int] | None = None,
    ) -> ValidRequest:
        """Check a request once, completely, before anything is queued: the prompt, every stage's
        params (defaults applied, model constraints), the requested outputs, and that all of it can
        travel. Raises InvalidRequestError naming the field.

        ``stages`` (not with ``modalities``): the stages whose outputs answer the request, any of
        the pipeline's; only the stages they need run. ``entry_stages``: the stages the prompt
        enters at, as it is (as a source stage takes it), in place of the pipeline's sources; the
        stages before them do not run."""
        if stages is not None and modalities is not None:
            raise InvalidRequestError("give modalities or stages, not both", param="stages")
        prompt = check_prompt(prompt)
        typed = self.resolve_params(sampling_params)
        params = {stage_id: params_to_dict(p) for stage_id, p in typed.items()}
        check_prompt_lengths(self.resolved, self._orchestrator.constraints, prompt, params)
        finals = self.final_stages(modalities) if stages is None else chosen_stages(self.config, stages)
        timeout = next((p["timeout"] for p in params.values() if p.get("timeout")), self.default_timeout)
        priority = next((p["priority"] for p in params.values() if p.get("priority") is not None), 0)
        entries = (
            None
            if entry_stages is None
            else check_entry_stages(self.config, self._orchestrator.graph, entry_stages, finals)
        )
        return ValidRequest(prompt, params, finals, timeout, self._id_prefix, priority, typed, entries)

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
        request_id = (
            # Unique per engine without a system call per request (uuid4 reads os.urandom).
            f"{self._id_prefix}-{next(self._auto_ids)}" if request_id is None else check_request_id(request_id)
        )
        timeout = valid.timeout
        channel = self._channels.current()
        with self._lock:
            self._ensure_open()
            if request_id in self._channels.pending:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight", param="request_id")
            if len(self._channels.pending) >= self.max_pending:
                raise QueueFullError(
                    f"{len(self._channels.pending)} requests pending (max_pending={self.max_pending}); retry later"
                )
            wire_id = f"{request_id}#{next(self._admissions)}"
            msg = EngineRequest(
                request_id=wire_id,
                channel=channel.id,
                prompt=valid.prompt,
                params=valid.typed,
                final_stage_ids=valid.final_stage_ids,
                entry_stage_ids=valid.entry_stage_ids,
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
            self._channels.pending[request_id] = pending
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
        check_update(text, inputs)
        with self._lock:
            self._ensure_open()
            pending = self._channels.pending.get(request_id) if isinstance(request_id, str) else None
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
        pending = self._channels.pending
        with self._lock:
            ended = [p for rid in ids if isinstance(rid, str) and (p := pending.pop(rid, None)) is not None]
        self._abort_ended(ended, reason)

    def abort_dropped(self, pending: PendingRequest) -> None:
        """Abort ``pending`` soon, on its own loop, if it is still in flight then: its stream was
        dropped unread. For a finalizer: it may run in any thread, in a garbage collection while
        that thread holds a lock here, so it only schedules the abort. A later request that reuses
        the id is not touched."""
        # A closed loop: its requests go with it (``Channels.current``).
        with contextlib.suppress(RuntimeError):
            pending.channel.loop.call_soon_threadsafe(self._abort_if_pending, pending)

    def _abort_if_pending(self, pending: PendingRequest) -> None:
        with self._lock:
            ours = self._channels.pending.get(pending.request_id) is pending
            if ours:
                del self._channels.pending[pending.request_id]
        if ours:
            self._abort_ended([pending], RequestAbortedError("its stream was dropped unread"))

    def _abort_ended(self, ended: list[PendingRequest], reason: BaseException | None) -> None:
        """End the streams of requests just taken out of ``Channels.pending`` and tell the stages."""
        if not ended:
            return
        info = ErrorInfo.from_exception(reason or RequestAbortedError("request aborted"))
        for p in ended:
            self._channels.end(p, info)
        if self.is_running:
            try:
                self._orchestrator.request_queue.sync_q.put_nowait(
                    EngineAbort(request_ids=[p.wire_id for p in ended], reason=info)
                )
            except (janus.SyncQueueFull, janus.SyncQueueShutDown):
                logger.warning("request queue full: the abort of %d request(s) reaches the stages late", len(ended))

    def _expire(self, pending: PendingRequest) -> None:
        if self._channels.pending.get(pending.request_id) is pending:
            logger.error("request %s: no answer from the engine by its deadline; released here", pending.request_id)
            self.abort(pending.request_id, RequestTimeoutError("request did not finish before its deadline"))

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
        kwargs = check_rpc(self.config, method, args, kwargs, stage_ids, timeout)
        channel = self._channels.current()
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
            self._channels.rpcs[call_id] = (channel, fut)
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
                self._channels.rpcs.pop(call_id, None)

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
            channels = self._channels.open_channels()
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
                on_loop(loop, _call_quietly, callback, error)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the orchestrator and every stage process; pending requests end with EngineClosedError.
        Safe from any thread; closing twice is a no-op."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._channels.fail_everything(EngineClosedError("engine closed"))
        self._finalizer()
        self._orchestrator.join(timeout)
        self._channels.close()


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
