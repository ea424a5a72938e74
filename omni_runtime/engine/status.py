"""The engine's status contract: what a stage pool says of its replicas (:class:`StageStatus`, made
in the orchestrator thread and read from any thread) and the engine's health built from it
(:class:`EngineHealth`). Structs, so a reader that misspells a field fails the type check instead
of reading a default; ``msgspec.to_builtins`` gives the JSON that ``/readyz`` and the metrics show.
"""

from __future__ import annotations

from typing import Literal

import msgspec

#: A replica is ``live`` (serving), ``restarting`` (dead, a restart under way), ``unplaced`` (dead,
#: and no node can host it now: its restart waits for one) or ``dead`` (for good, or not yet started).
ReplicaState = Literal["live", "restarting", "unplaced", "dead"]

#: What the engine as a whole is: ``ok``; ``unhealthy`` (a stage has no live replica now, a restart
#: may bring it back); ``dead`` (it will not serve again: see EngineDeadError); ``closed``.
EngineState = Literal["ok", "unhealthy", "dead", "closed"]


class StageStatus(msgspec.Struct, kw_only=True, frozen=True):
    """One stage's replicas and queue depth. The per-replica lists are indexed by replica id."""

    stage_id: int
    stage_type: str
    #: Configured replicas (``runtime.num_replicas``).
    replicas: int
    live_replicas: int
    replica_states: list[ReplicaState]
    #: The node each replica runs on (this host's name, or a Ray node id); None before it started.
    replica_nodes: list[str | None]
    #: Restarts of all replicas so far.
    restarts: int
    #: Replicas killed for missing heartbeats or a stalled forward.
    unresponsive_kills: int
    #: Requests inside the stage (waiting or running), over all replicas...
    inflight: int
    #: ...and per replica.
    per_replica_inflight: list[int]
    #: Why a replica waits for a node to host it (``unplaced``), or None.
    unplaced: str | None = None


class EngineHealth(msgspec.Struct, kw_only=True, frozen=True):
    """A snapshot of :meth:`AsyncOmniEngine.health <omni_runtime.engine.async_engine.AsyncOmniEngine.health>`."""

    status: EngineState
    #: Why it is not ``ok`` (None when it is).
    reason: str | None
    #: Requests admitted and not yet finished, and the admission limit.
    pending: int
    max_pending: int
    #: Every stage, by stage id.
    stages: list[StageStatus]
    #: The stages with no live replica now.
    dead_stages: list[int]

    @property
    def ok(self) -> bool:
        return self.status == "ok"
