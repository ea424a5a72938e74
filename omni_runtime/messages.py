"""Every message that crosses a thread or process boundary, as msgspec Structs.

Two unions travel on stage sockets (tagged, so the receiver decodes the right type):
``WorkerInbound`` (orchestrator → stage worker) and ``WorkerOutbound`` (worker → orchestrator).
Two more cross the janus queues between the caller's thread and the orchestrator thread:
``EngineInbound`` and ``EngineOutbound``. Arrays and tensors inside ``Any`` fields are encoded by
:mod:`omni_runtime.serialization` as raw buffers, never pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omni_runtime.exceptions import ERROR_TYPES, OmniError, RequestError, StageExecutionError

_Msg = {"kw_only": True, "frozen": True}


class ErrorInfo(msgspec.Struct, **_Msg):
    """A typed error in transit; ``to_exception`` re-creates the same class on the other side."""

    type: str
    message: str
    param: str | None = None
    stage_id: int | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, stage_id: int | None = None) -> ErrorInfo:
        if isinstance(exc, OmniError) and type(exc).__name__ in ERROR_TYPES:
            return cls(
                type=type(exc).__name__,
                message=str(exc),
                param=getattr(exc, "param", None),
                stage_id=stage_id if stage_id is not None else getattr(exc, "stage_id", None),
            )
        # Anything else raised by a model is this request's execution error.
        return cls(type="StageExecutionError", message=f"{type(exc).__name__}: {exc}", stage_id=stage_id)

    def to_exception(self) -> OmniError:
        cls = ERROR_TYPES.get(self.type, StageExecutionError)
        if issubclass(cls, RequestError):
            return cls(self.message, param=self.param, stage_id=self.stage_id)
        return cls(self.message)


# --------------------------------------------------------------------------- orchestrator -> worker


class StageRequest(msgspec.Struct, tag="request", **_Msg):
    request_id: str
    #: The caller's prompt, or what this stage's input function made of upstream outputs.
    prompt: Any
    #: Resolved sampling params (stage defaults applied) as a plain dict.
    params: dict[str, Any]
    #: Upstream outputs: ``text`` and named arrays / tensors.
    inputs: dict[str, Any] = {}
    #: When the caller submitted it (``time.time()``), for end-to-end metrics.
    arrival_time: float = 0.0


class StageAbort(msgspec.Struct, tag="abort", **_Msg):
    request_ids: list[str]


class StageRpc(msgspec.Struct, tag="rpc", **_Msg):
    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class StageShutdown(msgspec.Struct, tag="shutdown", **_Msg):
    pass


WorkerInbound = StageRequest | StageAbort | StageRpc | StageShutdown


# --------------------------------------------------------------------------- worker -> orchestrator


class StageReady(msgspec.Struct, tag="ready", **_Msg):
    stage_id: int
    replica_id: int
    pid: int
    #: Checks the caller makes before enqueue (``size_multiple``, ``max_pixels``).
    constraints: dict[str, Any] = {}


class StageOutput(msgspec.Struct, tag="output", **_Msg):
    request_id: str
    #: False for a partial output (a text delta); True once this stage is done with the request.
    finished: bool = True
    text: str | None = None
    #: uint8 HxWx3 arrays.
    images: list[Any] = []
    tensors: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    error: ErrorInfo | None = None


class StageRpcResult(msgspec.Struct, tag="rpc_result", **_Msg):
    call_id: int
    result: Any = None
    error: ErrorInfo | None = None


WorkerOutbound = StageReady | StageOutput | StageRpcResult


# --------------------------------------------------------------------------- caller <-> orchestrator


class EngineRequest(msgspec.Struct, tag="request", **_Msg):
    request_id: str
    prompt: Any
    #: Resolved params per stage id.
    params: dict[int, dict[str, Any]]
    #: The final stages this caller wants (a subset of the config's, e.g. for ``modalities``).
    final_stage_ids: list[int]
    arrival_time: float
    #: Absolute ``time.monotonic()`` deadline, or None.
    deadline: float | None = None


class EngineAbort(msgspec.Struct, tag="abort", **_Msg):
    request_ids: list[str]
    #: The error the caller gets (``RequestAbortedError`` unless said otherwise).
    reason: ErrorInfo | None = None


class EngineRpc(msgspec.Struct, tag="rpc", **_Msg):
    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    stage_ids: list[int] | None = None
    timeout: float | None = None


class EngineShutdown(msgspec.Struct, tag="shutdown", **_Msg):
    pass


EngineInbound = EngineRequest | EngineAbort | EngineRpc | EngineShutdown


class EngineOutput(msgspec.Struct, tag="output", **_Msg):
    request_id: str
    stage_id: int
    #: True on the request's last message: every requested final stage is done (or it failed).
    finished: bool
    #: True when this stage is done with the request (False for a streamed delta).
    stage_finished: bool = True
    text: str | None = None
    images: list[Any] = []
    tensors: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    error: ErrorInfo | None = None


class RpcReplicaResult(msgspec.Struct, **_Msg):
    """One replica's answer to a control call."""

    stage_id: int
    replica_id: int
    result: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class EngineRpcResult(msgspec.Struct, tag="rpc_result", **_Msg):
    call_id: int
    results: list[RpcReplicaResult]


EngineOutbound = EngineOutput | EngineRpcResult
