"""Typed errors of the runtime.

Two families, kept apart on purpose:

* :class:`RequestError` and its subclasses end *one* request; the engine keeps serving.
* :class:`EngineError` subclasses mean the engine (or a part of it) cannot serve.

The HTTP layer maps them to status codes in one place; the core never raises HTTP errors.
"""

from __future__ import annotations


class OmniError(Exception):
    """Base of every error raised by omni_runtime."""

    # Where known; set by RequestError and by an error re-created from the wire (ErrorInfo).
    param: str | None = None
    stage_id: int | None = None


# --------------------------------------------------------------------------- config


class ConfigError(OmniError, ValueError):
    """A deploy config is invalid. The message names the file and the YAML path."""

    path: str | None = None
    source: str | None = None
    #: Every error found, when several were reported at once (this one alone otherwise).
    errors: tuple[ConfigError, ...] = ()

    def __init__(self, message: str, *, path: str | None = None, source: str | None = None) -> None:
        self.path = path
        self.source = source
        self.errors = (self,)
        where = ": ".join(p for p in (source, path) if p)
        super().__init__(f"{where}: {message}" if where else message)

    @classmethod
    def of(cls, errors: list[ConfigError], *, source: str | None = None) -> ConfigError:
        """One error that reports all of ``errors`` (each on a line of its own)."""
        if len(errors) == 1:
            return errors[0]
        lines = "\n".join(f"  {e}" for e in errors)
        combined = cls(f"{len(errors)} errors:\n{lines}", source=source)
        combined.errors = tuple(errors)
        return combined


# --------------------------------------------------------------------------- per request


class RequestError(OmniError):
    """Ends one request; the engine keeps serving others."""

    #: The request field at fault, where one is (``num_inference_steps``, ``size``...).
    param: str | None = None
    #: The stage that raised, where known.
    stage_id: int | None = None

    def __init__(self, message: str, *, param: str | None = None, stage_id: int | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param
        if stage_id is not None:
            self.stage_id = stage_id


class InvalidRequestError(RequestError, ValueError):
    """Bad input: an unknown field, a wrong type, an out-of-range value. Rejected before enqueue."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in flight."""


class UnknownRequestError(InvalidRequestError):
    """A request id that is not in flight (never was, or has finished), or not open for
    streaming updates."""


class StreamClosedError(InvalidRequestError):
    """A streaming update after the request's final one."""


class QueueFullError(RequestError):
    """Admission is full; retry later. Raised at once, never after a wait."""

    #: Seconds a client should wait before retrying (HTTP ``Retry-After``).
    retry_after_s: float = 1.0

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, param: str | None = None, stage_id: int | None = None
    ) -> None:
        super().__init__(message, param=param, stage_id=stage_id)
        self.retry_after_s = retry_after_s


class RequestAbortedError(RequestError):
    """The request was aborted (by the caller, a disconnect, or shutdown)."""


class RequestTimeoutError(RequestError):
    """The request did not finish before its deadline and was aborted wherever it was."""


class StageExecutionError(RequestError):
    """The stage's model raised for this request. ``stage_id`` says which stage."""


class ProgramError(StageExecutionError):
    """An external program (a ``subprocess`` stage) failed this request: it exited with an error,
    passed a limit (time, standard output, an output file's size), or wrote an output that cannot
    be read. Its process group is gone; the stage serves on."""


class ProgramTimeoutError(ProgramError):
    """An external program ran past its ``timeout_s``; its process group was killed."""


class StageDeadError(RequestError):
    """The stage replica that held this request died. The engine may restart it."""


class StageAsleepError(RequestError):
    """The stage was put to sleep with ``collective_rpc("sleep")`` and has not been woken."""


class LoraLoadError(RequestError):
    """A LoRA adapter that exists could not be loaded into the model (not LoRA weights, made for
    another architecture, a registered path that is gone). The request fails; the stage serves on."""


class LoraFormatError(InvalidRequestError):
    """A LoRA adapter file that is refused before any loader reads it: not safetensors (a pickle,
    a ``.bin``), a malformed header, over ``engine_args.max_lora_file_mb``, or NaN / infinite
    weights. ``param`` names the field that gave the path; the message names the file."""


# --------------------------------------------------------------------------- engine


class EngineError(OmniError):
    """The engine cannot serve (not started, closed, or a fatal failure)."""


class EngineClosedError(EngineError):
    """The engine has been closed."""


class EngineDeadError(EngineError):
    """The engine can no longer serve and will not recover by itself: its orchestrator thread
    stopped, or every replica of a stage is gone and no restart is left. Every pending and every
    later request fails with this error at once; a server exits non-zero so that its supervisor
    (systemd, Kubernetes) starts a fresh one."""


class StageStartupError(EngineError):
    """A stage process failed to start or did not say READY in time."""


class StageUnplacedError(StageStartupError):
    """No node can host a replica now (on Ray: no live node offers what it needs, such as the
    model it serves). A start fails with it at once; a restart waits for a node instead of
    spending its attempts."""


class UnavailableError(OmniError):
    """A dependency is unreachable or a bounded resource is spent for now (the job store, the
    budget of event streams): the request is refused at once and may be retried later (HTTP 503
    with ``Retry-After``). Nothing was lost: no job was created, no write was dropped."""

    #: Seconds a client should wait before retrying (HTTP ``Retry-After``).
    retry_after_s: float = 1.0

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownModelError(InvalidRequestError):
    """A request names a model that is not served (HTTP 404); ``known`` lists those that are."""

    def __init__(self, model: str, known: tuple[str, ...]) -> None:
        names = ", ".join(f"`{k}`" for k in known)
        super().__init__(f"the model `{model}` does not exist; this server serves {names}", param="model")
        self.model = model
        self.known = known


class ModelUnavailableError(EngineError):
    """One model of several cannot serve (still loading, failed to load, dead, or unplaced: no
    node can host one of its stages now): its requests fail with this error naming the model
    and why, while the other models serve."""

    def __init__(self, model: str, state: str, reason: str | None = None) -> None:
        why = {
            "loading": "is loading; retry shortly",
            "failed": "failed to load",
            "dead": "is dead",
            "unplaced": "has no node to run on",
        }.get(state, state)
        super().__init__(f"the model `{model}` {why}" + (f": {reason}" if reason else ""))
        self.model = model
        self.state = state


class RpcError(OmniError):
    """A control call failed on one replica (raised, unknown method, or timed out)."""


#: Errors that travel over the wire by name, so the receiving side re-raises the same type.
ERROR_TYPES: dict[str, type[OmniError]] = {
    cls.__name__: cls
    for cls in (
        OmniError,
        ConfigError,
        RequestError,
        InvalidRequestError,
        DuplicateRequestError,
        QueueFullError,
        RequestAbortedError,
        RequestTimeoutError,
        StageExecutionError,
        ProgramError,
        ProgramTimeoutError,
        StageDeadError,
        StageAsleepError,
        LoraLoadError,
        LoraFormatError,
        EngineError,
        EngineClosedError,
        EngineDeadError,
        StageStartupError,
        StageUnplacedError,
        RpcError,
    )
}
