"""The seam between routing and execution. Runs in the orchestrator thread.

The orchestrator routes requests through the stage graph and knows nothing of processes,
sockets or shared memory: it talks to each replica through a :class:`StageClient`, and a
:class:`StageBackend` (one per ``runtime.backend`` in use) makes those clients, owns what they
share, and decides how an output's arrays reach their next consumer. Everything an engine holds
outside Python objects is registered with its one :class:`EngineResources`, made before the first
such thing exists and released on every exit path.

Backends, by name in :mod:`.registry`: ``process`` (:mod:`.process`: a spawned process per replica,
ZMQ, shared memory; the default), ``inproc`` (:mod:`.inproc`: the same worker on the orchestrator's
loop; the test seam) and ``ray`` (:mod:`.ray_backend`: Ray actors across a cluster).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import msgspec

from omni_runtime.config import DeployConfig, StageConfig
from omni_runtime.exceptions import StageExecutionError
from omni_runtime.messages import ErrorInfo, StageOutput, StageOutputs, StageReady
from omni_runtime.serialization import output_ids

logger = logging.getLogger(__name__)

_HOSTNAME = socket.gethostname()

OnMessage = Callable[["StageClient", Any], None]
OnDead = Callable[["StageClient", str], None]


class StageClient(ABC):
    """Sends messages to one replica; delivers what it says to ``on_message``."""

    def __init__(self, stage: StageConfig, replica_id: int, on_message: OnMessage, on_dead: OnDead) -> None:
        self.stage = stage
        self.stage_id = stage.stage_id
        self.replica_id = replica_id
        self._on_message = on_message
        self._on_dead = on_dead
        self.ready: StageReady | None = None
        self.alive = False

    @property
    def pid(self) -> int | None:
        return self.ready.pid if self.ready else None

    def _unreadable(self, frames: list[Any], exc: BaseException) -> None:
        """A message from the replica that could not be decoded: logged and dropped, and the
        requests it names (read leniently) end with a StageExecutionError, so none waits for an
        output that will never be read."""
        logger.warning("stage %d: dropped a malformed message: %s", self.stage_id, exc)
        first = frames[0] if frames else b""
        ids = output_ids(first.buffer if hasattr(first, "buffer") else first)
        if not ids:
            return
        err = StageExecutionError(
            f"stage {self.stage_id} sent an output the engine could not read: {str(exc)[:200]}",
            stage_id=self.stage_id,
        )
        info = ErrorInfo.from_exception(err)
        self._on_message(self, StageOutputs(outputs=[StageOutput(request_id=rid, error=info) for rid in ids]))

    #: The machine (a Ray node id for remote replicas) the replica runs on.
    node: str | None = _HOSTNAME

    @abstractmethod
    async def start(self) -> StageReady:
        """Start the replica and wait for READY; StageStartupError on failure or time-out."""

    @abstractmethod
    def send(self, msg: Any) -> None:
        """Send one message; never blocks. Raises StageDeadError if the replica cannot be reached
        (it is then reported dead) and msgspec.EncodeError if ``msg`` cannot be encoded."""

    @abstractmethod
    def kill(self, reason: str) -> None:
        """Stop an unresponsive replica at once and report it dead with ``reason``."""

    @abstractmethod
    async def close(self, timeout: float = 5.0) -> None:
        """Stop the replica (gracefully, then by force after ``timeout``) and free its resources.
        Always returns: every wait is bounded."""


class NoOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The settings of a backend that reads no ``runtime:`` key of its own."""


class StageBackend(ABC):
    """Makes the replicas of the stages that run on it, and owns what they share."""

    #: The ``runtime.backend`` value that selects it (its name in :mod:`.registry`).
    name: ClassVar[str]
    #: Its own settings: the ``runtime:`` keys only this backend reads, decoded at load into
    #: ``stage.runtime.options`` (a YAML keeps writing them flat, beside the shared keys).
    options: ClassVar[type[msgspec.Struct]] = NoOptions

    def __init__(self, config: DeployConfig, resources: EngineResources) -> None:
        self.config = config
        self.resources = resources

    @classmethod
    def check_stages(cls, stages: list[StageConfig]) -> list[str]:
        """What is wrong with ``stages`` (every stage of a config on this backend) taken together,
        found when the config is resolved; each their own options struct already validated."""
        return []

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Set up what the replicas share (registering each piece with ``resources`` as it is
        made), before the first replica starts."""

    async def release_spare(self) -> None:  # noqa: B027 - optional hook
        """The engine is dead and its replicas are closed: free now what only new replicas would
        have used, rather than when the engine is closed."""

    @abstractmethod
    def client(
        self, stage: StageConfig, replica_id: int, generation: int, on_message: OnMessage, on_dead: OnDead
    ) -> StageClient:
        """A client for one replica of ``stage``, not started yet. ``generation`` counts restarts."""

    def settle(self, out: StageOutput, consumer: StageConfig | None) -> StageOutput | Awaitable[StageOutput]:
        """``out`` (produced by a stage of this backend) as it travels on: to ``consumer``, the one
        stage that consumes it (a backend may hand its arrays over as they are, without a copy), or
        with ``consumer=None`` to anyone else (the caller, several stages, an input function),
        which need plain values. An awaitable when the values must be fetched first (the
        orchestrator keeps each request's outputs in order meanwhile)."""
        return out


class EngineResources:
    """The one owner of an engine's processes, sockets, directories and shared memory.

    Made before the first of them exists. Each is registered as it is made, with a function that
    frees it, and unregistered when its owner freed it the ordinary way (a replica closed,
    say). :meth:`release` frees whatever is still registered, last made first, and never raises:
    it runs on every exit path of the orchestrator thread (a clean close, a failed start, a
    death), so nothing outlives the engine. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, tuple[str, Callable[[], Any]]] = {}
        self._tokens = itertools.count(1)

    def add(self, what: str, release: Callable[[], Any]) -> int:
        """Register ``what`` with the function that frees it; returns a token for :meth:`discard`."""
        with self._lock:
            token = next(self._tokens)
            self._items[token] = (what, release)
            return token

    def discard(self, token: int | None) -> None:
        """``what`` was freed by its owner: nothing left to do for it."""
        if token is not None:
            with self._lock:
                self._items.pop(token, None)

    def __len__(self) -> int:
        return len(self._items)

    def release(self) -> None:
        """Free everything still registered, last made first."""
        while True:
            with self._lock:
                if not self._items:
                    return
                token = max(self._items)
                what, release = self._items.pop(token)
            try:
                release()
            except Exception:
                logger.exception("could not release %s", what)
