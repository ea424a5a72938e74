"""AsyncOmniEngine: the thin caller-side proxy. Lives in the caller's thread.

It validates and normalises input here, before anything is queued, so bad input is a typed error
at the call site. It puts messages on the janus request queue with ``put_nowait`` (a full queue is
an immediate :class:`QueueFullError`, never a wait), and a dispatcher task on the caller's event
loop hands outputs from the janus output queue to per-request streams.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import janus
import msgspec

from omni_runtime.config import DeployConfig, StageConfig
from omni_runtime.engine.orchestrator import Orchestrator
from omni_runtime.exceptions import (
    DuplicateRequestError,
    EngineClosedError,
    InvalidRequestError,
    QueueFullError,
    RequestAbortedError,
)
from omni_runtime.messages import (
    EngineAbort,
    EngineOutput,
    EngineRequest,
    EngineRpc,
    EngineRpcResult,
    EngineShutdown,
    ErrorInfo,
    RpcReplicaResult,
)
from omni_runtime.params import PARAMS_BY_STAGE_TYPE, check_constraints, resolve_params

logger = logging.getLogger(__name__)

#: Longest prompt accepted, in characters.
MAX_PROMPT_CHARS = 100_000


def params_class(stage: StageConfig) -> type[msgspec.Struct]:
    """The sampling-params class of a stage, without importing its (heavy) runner if builtin."""
    if stage.stage_type in PARAMS_BY_STAGE_TYPE:
        return PARAMS_BY_STAGE_TYPE[stage.stage_type]
    from omni_runtime.stage.runners.base import runner_class

    return runner_class(stage.stage_type).params_cls


class AsyncOmniEngine:
    """Starts the orchestrator thread and proxies requests, aborts and control calls to it."""

    def __init__(
        self, config: DeployConfig, *, max_pending: int | None = None, default_timeout: float | None = None
    ) -> None:
        self.config = config
        self.max_pending = max_pending or config.max_pending
        self.default_timeout = default_timeout if default_timeout is not None else config.default_timeout_s
        self._params_cls = {s.stage_id: params_class(s) for s in config.stage_args}
        self._output_queue: janus.Queue = janus.Queue()
        # Room for every admitted request plus the aborts and control calls about them.
        self._orchestrator = Orchestrator(config, self._output_queue, request_queue_size=2 * self.max_pending + 256)
        self._orchestrator.start()
        self._finalizer = weakref.finalize(self, _stop_orchestrator, self._orchestrator)
        self._streams: dict[str, asyncio.Queue] = {}
        # Caller's request id -> the id it has inside the engine, unique per admission: a caller may
        # reuse an id once its request ended (aborted, timed out), and a late output of the old one
        # must neither reach the new one nor collide with it in a stage's queue.
        self._wire_ids: dict[str, str] = {}
        self._admissions = itertools.count(1)
        self._rpcs: dict[int, asyncio.Future] = {}
        self._rpc_ids = itertools.count(1)
        self._id_prefix = uuid.uuid4().hex[:12]
        self._auto_ids = itertools.count(1)
        self._dispatcher: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the caller's, where streams live
        self._closed = False

    # ------------------------------------------------------------------ input

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    def stage_status(self) -> dict[int, dict[str, Any]]:
        return self._orchestrator.status()

    @property
    def is_running(self) -> bool:
        return not self._closed and self._orchestrator.alive

    def resolve_params(self, sampling_params: Any) -> dict[int, dict[str, Any]]:
        """Per-stage params, validated, stage defaults applied.

        Accepts None, one params object or dict (for a one-stage pipeline, or a typed object for
        the stages of its type), or a list with one entry per stage in ``stage_args`` order.
        """
        stages = self.config.stage_args
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
            given = [
                sampling_params if isinstance(sampling_params, self._params_cls[s.stage_id]) else None for s in stages
            ]
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
            typed = resolve_params(self._params_cls[stage.stage_id], stage.default_sampling_params, params)
            check_constraints(typed, self._orchestrator.constraints.get(stage.stage_id, {}))
            resolved[stage.stage_id] = {k: v for k, v in msgspec.structs.asdict(typed).items() if v is not None}
        return resolved

    def final_stages(self, modalities: Sequence[str] | None) -> list[int]:
        """Final stage ids for the requested output modalities (None = all final outputs)."""
        finals = [s for s in self.config.stage_args if s.final_output]
        if modalities is None:
            return [s.stage_id for s in finals]
        if isinstance(modalities, str) or not all(isinstance(m, str) for m in modalities):
            raise InvalidRequestError("modalities must be a list of strings", param="modalities")
        wanted = {"image" if m == "images" else m for m in modalities}
        chosen = [s.stage_id for s in finals if s.final_output_type in wanted]
        if not chosen:
            available = sorted({s.final_output_type for s in finals})
            raise InvalidRequestError(
                f"no final stage produces {sorted(wanted)}; this pipeline offers {available}", param="modalities"
            )
        return chosen

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: Any,
        sampling_params: Any = None,
        request_id: str | None = None,
        modalities: Sequence[str] | None = None,
    ) -> tuple[str, asyncio.Queue]:
        """Validate and enqueue one request; returns its id and the stream its outputs arrive on.

        Must be called on the caller's running event loop. Raises InvalidRequestError,
        DuplicateRequestError, QueueFullError or EngineClosedError at once.
        """
        self._ensure_open()
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(
                f"prompt is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}", param="prompt"
            )
        if request_id is None:
            # Unique per engine without a system call per request (uuid4 reads os.urandom).
            request_id = f"{self._id_prefix}-{next(self._auto_ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        params = self.resolve_params(sampling_params)
        finals = self.final_stages(modalities)
        if len(self._streams) >= self.max_pending:
            raise QueueFullError(f"{len(self._streams)} requests pending (max_pending={self.max_pending}); retry later")
        timeout = next((p["timeout"] for p in params.values() if p.get("timeout")), self.default_timeout)
        now = time.monotonic()
        wire_id = f"{request_id}#{next(self._admissions)}"
        msg = EngineRequest(
            request_id=wire_id,
            prompt=prompt,
            params=params,
            final_stage_ids=finals,
            arrival_time=time.time(),
            deadline=now + timeout if timeout else None,
        )
        self._start_dispatcher()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._wire_ids[request_id] = wire_id
        try:
            self._orchestrator.request_queue.sync_q.put_nowait(msg)
        except janus.SyncQueueFull:
            del self._streams[request_id], self._wire_ids[request_id]
            raise QueueFullError("the engine's request queue is full; retry later") from None
        return request_id, stream

    def abort(self, request_ids: str | Sequence[str], reason: BaseException | None = None) -> None:
        """Abort requests wherever they are. Their streams end with ``reason`` (default
        RequestAbortedError) at once, without waiting for the stages."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        err = reason or RequestAbortedError("request aborted")
        live = [rid for rid in ids if rid in self._streams]
        for rid in live:
            self._streams.pop(rid).put_nowait(
                EngineOutput(request_id=rid, stage_id=-1, finished=True, error=ErrorInfo.from_exception(err))
            )
        wire_ids = [self._wire_ids.pop(rid) for rid in live]
        if live and self.is_running:
            try:
                self._orchestrator.request_queue.sync_q.put_nowait(
                    EngineAbort(request_ids=wire_ids, reason=ErrorInfo.from_exception(err))
                )
            except janus.SyncQueueFull:
                logger.warning("request queue full: abort of %s will reach the stages late", live)

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
        if not isinstance(method, str) or not method:
            raise InvalidRequestError("method must be a non-empty string", param="method")
        if stage_ids is not None:
            unknown = set(stage_ids) - {s.stage_id for s in self.config.stage_args}
            if unknown:
                raise InvalidRequestError(f"unknown stage id(s) {sorted(unknown)}", param="stage_ids")
        if timeout is not None and timeout <= 0:
            raise InvalidRequestError("timeout must be > 0", param="timeout")
        call_id = next(self._rpc_ids)
        self._start_dispatcher()
        fut = asyncio.get_running_loop().create_future()
        self._rpcs[call_id] = fut
        try:
            self._orchestrator.request_queue.sync_q.put_nowait(
                EngineRpc(
                    call_id=call_id,
                    method=method,
                    args=list(args),
                    kwargs=dict(kwargs or {}),
                    stage_ids=list(stage_ids) if stage_ids is not None else None,
                    timeout=timeout,
                )
            )
        except janus.SyncQueueFull:
            del self._rpcs[call_id]
            raise QueueFullError("the engine's request queue is full; retry later") from None
        try:
            return await fut
        finally:
            self._rpcs.pop(call_id, None)

    # ------------------------------------------------------------------ output dispatch

    def _start_dispatcher(self) -> None:
        if self._dispatcher is None or self._dispatcher.done():
            self._loop = asyncio.get_running_loop()
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch(), name="omni-dispatch")

    async def _dispatch(self) -> None:
        queue = self._output_queue.async_q
        while True:
            try:
                msg = await queue.get()
            except janus.AsyncQueueShutDown:
                return
            if isinstance(msg, EngineOutput):
                rid = msg.request_id.rpartition("#")[0]
                if self._wire_ids.get(rid) != msg.request_id:
                    continue  # aborted by the caller meanwhile (and its id perhaps reused since)
                stream = self._streams[rid]
                if msg.finished:
                    del self._streams[rid], self._wire_ids[rid]
                stream.put_nowait(msg)
            elif isinstance(msg, EngineRpcResult):
                fut = self._rpcs.get(msg.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg.results)

    # ------------------------------------------------------------------ shutdown

    def _ensure_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")
        if not self._orchestrator.alive:
            raise EngineClosedError("the engine's orchestrator has stopped")

    def close(self, timeout: float = 30.0) -> None:
        """Stop the orchestrator and every stage process; pending requests end with EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        # Streams and futures belong to the caller's loop: fail them there, even when close() is
        # called from another thread (a server closes its engine from an executor thread).
        self._on_caller_loop(self._fail_pending)
        self._finalizer()
        self._orchestrator.join(timeout)
        self._output_queue.shutdown(immediate=True)

    def _fail_pending(self) -> None:
        err = ErrorInfo.from_exception(EngineClosedError("engine closed"))
        for rid, stream in list(self._streams.items()):
            stream.put_nowait(EngineOutput(request_id=rid, stage_id=-1, finished=True, error=err))
        self._streams.clear()
        self._wire_ids.clear()
        for fut in self._rpcs.values():
            if not fut.done():
                fut.set_exception(EngineClosedError("engine closed"))
        if self._dispatcher is not None:
            self._dispatcher.cancel()

    def _on_caller_loop(self, callback: Any) -> None:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or loop is running or loop.is_closed():
            callback()
        else:
            loop.call_soon_threadsafe(callback)


def _stop_orchestrator(orchestrator: Orchestrator) -> None:
    """Also runs at garbage collection / interpreter exit, so no stage process outlives us."""
    try:
        orchestrator.request_queue.sync_q.put(EngineShutdown(), timeout=5.0)
    except Exception:
        pass
    orchestrator.join(30.0)
