"""Job stores: where a job's record and its events live. Runs on the server's event loop.

One small async interface, :class:`JobStore`, with two implementations: :class:`MemoryJobStore`
(the default; one gateway, bounded, TTL eviction) and ``RedisJobStore`` (``serve --redis-url``;
gateways share jobs). A job is a flat record (a dict of JSON values) plus an append-only list of
events, each with an id that grows within the job: that id is the SSE event id, so a client that
reconnects with ``Last-Event-ID`` gets exactly the events after it.

Jobs created with a ``kind`` (the media a task makes: ``video``, ``image``) are indexed by it in
creation order, so a route lists them (``GET /v1/videos``) from any gateway without scanning.
"""

from __future__ import annotations

import abc
import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_runtime.exceptions import InvalidRequestError, OmniError, QueueFullError, UnavailableError

#: States a job ends in; nothing changes a job after it reached one.
TERMINAL = frozenset({"completed", "failed", "cancelled"})
#: Event types that end a job's event stream.
TERMINAL_EVENTS = TERMINAL


class Backoff:
    """Waits that double from ``first`` to at most ``most`` seconds, for retrying a store that
    cannot be reached; :meth:`reset` after a success starts again from ``first``."""

    def __init__(self, first: float = 0.25, most: float = 5.0) -> None:
        self.first, self.most = first, most
        self.delay = first

    async def wait(self) -> None:
        """Sleep the current delay, then double it (up to ``most``)."""
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.most)

    def reset(self) -> None:
        self.delay = self.first


class JobStoreUnavailableError(UnavailableError):
    """The store cannot be reached now (Redis down, stopped or too slow): HTTP 503."""


class StreamBudgetError(UnavailableError):
    """Every event-stream slot of this gateway is taken (``--job-streams``): HTTP 503."""


class JobFencedError(OmniError):
    """A write refused by the store: the job ended already (a terminal state is final), or its
    owner or attempt is no longer the writer's (another gateway claimed it). The writer drops the
    job; it never reaches a client."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"job {job_id}: write refused ({reason})")
        self.reason = reason


#: The writer of a fenced write: (gateway id, attempt).
Fence = tuple[str, int]


@dataclass(frozen=True)
class Event:
    """One event of a job: ``id`` orders it within the job (the SSE event id)."""

    id: str
    type: str
    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "data": self.data}


class JobStore(abc.ABC):
    """What the job routes need from a store; every method is a coroutine on the server's loop.

    Records are dicts of JSON values. ``update`` merges fields into a record; ``append_event``
    adds an event (with record fields, atomically) and returns its id; ``events`` replays the
    events after an id (None: from the start); ``wait_events`` also waits up to ``timeout``
    seconds for the first new one.

    Writes are fenced: a job that reached a terminal state takes no more writes, and a write
    that carries ``fence=(gateway, attempt)`` is applied only while the record's ``owner`` and
    ``attempts`` are still those (else :class:`JobFencedError`). A store that cannot be reached
    raises :class:`JobStoreUnavailableError`.
    """

    #: ``memory`` or ``redis`` (shown on /readyz).
    backend: str = "?"

    @abc.abstractmethod
    async def create(
        self, record: dict[str, Any], first_event: tuple[str, dict[str, Any]], *, kind: str | None = None
    ) -> str:
        """Store a new job with its first event; with ``kind``, also index it under that kind
        (newest last) for :meth:`list_kind`."""

    @abc.abstractmethod
    async def list_kind(self, kind: str, *, after: str | None, limit: int, newest_first: bool) -> list[dict[str, Any]]:
        """Up to ``limit`` records of the jobs indexed under ``kind``, by creation time (newest
        first or oldest first), starting after the job ``after`` (None: from the start; a job
        not in the index: nothing). Jobs that expired are skipped and leave the index."""

    @abc.abstractmethod
    async def delete(self, kind: str, job_id: str) -> bool:
        """Remove a job: its record, its events and its place in ``kind``'s index, for every
        gateway at once (a read by id finds nothing, as for an expired job; a write for it from
        a gateway that still runs it is dropped). False when there was no record."""

    @abc.abstractmethod
    async def get(self, job_id: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    async def update(self, job_id: str, fields: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def append_event(
        self,
        job_id: str,
        type: str,
        data: dict[str, Any],
        fields: dict[str, Any] | None = None,
        *,
        fence: Fence | None = None,
    ) -> str:
        """Append an event (and merge ``fields`` into the record in the same step: a reader that
        sees a finished record also sees its final event)."""

    @abc.abstractmethod
    async def events(self, job_id: str, after: str | None) -> list[Event]: ...

    @abc.abstractmethod
    async def wait_events(self, job_id: str, after: str | None, timeout: float) -> list[Event]: ...

    @abc.abstractmethod
    def check_event_id(self, event_id: str) -> str:
        """``event_id`` if it is one of this store's ids, else InvalidRequestError."""

    async def ping(self) -> bool:
        return True

    # Gateways sharing a store (Redis): ownership, cross-gateway cancel, recovery. In memory the
    # one gateway owns every job, so these do nothing.

    async def start(self, gateway_id: str, on_cancel: Callable[[str], None]) -> None:
        """Register this gateway; ``on_cancel(job_id)`` is called (on the loop) when another
        gateway asks to cancel a job this one runs."""
        return None

    async def signal_cancel(self, record: dict[str, Any]) -> None:
        """Ask the gateway that runs ``record``'s job to cancel it."""
        return None

    async def heartbeat(self) -> bool:
        """Keep this gateway's lease alive (called every ``lease_s / 3``); False when the lease
        had run out before this renewal (another gateway may have claimed this one's jobs)."""
        return True

    async def claim_orphans(self) -> list[str]:
        """Jobs of gateways whose lease ran out, now owned by this one (each claimed once)."""
        return []

    def count(self) -> int | None:
        """Jobs held (the in-memory store), or None where the store cannot say cheaply."""
        return None

    async def close(self) -> None:
        return None


class _MemoryJob:
    __slots__ = ("changed", "events", "expires", "kind", "record")

    def __init__(self, record: dict[str, Any], kind: str | None) -> None:
        self.record = record
        self.kind = kind
        self.events: list[Event] = []
        #: Set (and replaced) whenever an event is appended: waiters wake without polling.
        self.changed = asyncio.Event()
        self.expires: float | None = None  # set once the job is finished


_EVENT_ID = re.compile(r"[0-9]{1,18}")


class MemoryJobStore(JobStore):
    """Jobs in this process: at most ``max_jobs``; a finished job is kept ``ttl_s`` seconds.

    Eviction runs when a job is created (nothing polls): expired jobs go first, then, while the
    store is full, the oldest finished ones. When every held job is still running the store is
    full and a new job is refused (429), which the engine's own admission limit makes rare.
    """

    backend = "memory"

    def __init__(self, *, max_jobs: int = 10_000, ttl_s: float = 3600.0) -> None:
        self.max_jobs, self.ttl_s = max_jobs, ttl_s
        self._jobs: dict[str, _MemoryJob] = {}
        #: Finished jobs in the order they finished, which is also their expiry order.
        self._finished: OrderedDict[str, None] = OrderedDict()
        #: Kind -> its jobs in creation order (oldest first).
        self._kinds: dict[str, OrderedDict[str, None]] = {}

    def _remove(self, job_id: str) -> None:
        job = self._jobs.pop(job_id)
        self._finished.pop(job_id, None)
        if job.kind is not None:
            self._kinds.get(job.kind, OrderedDict()).pop(job_id, None)
        job.changed.set()  # streams of a removed job end

    def _evict(self, now: float) -> None:
        while self._finished:
            oldest = next(iter(self._finished))
            job = self._jobs[oldest]
            if job.expires is not None and job.expires > now and len(self._jobs) < self.max_jobs:
                break
            self._remove(oldest)

    async def create(
        self, record: dict[str, Any], first_event: tuple[str, dict[str, Any]], *, kind: str | None = None
    ) -> str:
        self._evict(time.monotonic())
        if len(self._jobs) >= self.max_jobs:
            raise QueueFullError(f"the job store holds {self.max_jobs} unfinished jobs; retry later")
        job = _MemoryJob(dict(record), kind)
        self._jobs[record["job_id"]] = job
        if kind is not None:
            self._kinds.setdefault(kind, OrderedDict())[record["job_id"]] = None
        return await self.append_event(record["job_id"], *first_event)

    async def list_kind(self, kind: str, *, after: str | None, limit: int, newest_first: bool) -> list[dict[str, Any]]:
        index = self._kinds.get(kind, OrderedDict())
        if after is not None and after not in index:
            return []
        ids = list(reversed(index) if newest_first else index)
        if after is not None:
            ids = ids[ids.index(after) + 1 :]
        found: list[dict[str, Any]] = []
        for job_id in ids:
            if len(found) >= limit:
                break
            record = await self.get(job_id)  # an expired job leaves the index here
            if record is not None:
                found.append(record)
        return found

    async def delete(self, kind: str, job_id: str) -> bool:
        self._kinds.get(kind, OrderedDict()).pop(job_id, None)
        if job_id not in self._jobs:
            return False
        self._remove(job_id)
        return True

    async def get(self, job_id: str) -> dict[str, Any] | None:
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if job.expires is not None and job.expires <= time.monotonic():
            self._remove(job_id)
            return None
        return dict(job.record)

    async def update(self, job_id: str, fields: dict[str, Any]) -> None:
        job = self._jobs.get(job_id)
        if job is None or job.record.get("status") in TERMINAL:
            return
        job.record.update(fields)
        if fields.get("status") in TERMINAL and job.expires is None:
            job.expires = time.monotonic() + self.ttl_s
            self._finished[job_id] = None

    async def append_event(
        self,
        job_id: str,
        type: str,
        data: dict[str, Any],
        fields: dict[str, Any] | None = None,
        *,
        fence: Fence | None = None,
    ) -> str:
        job = self._jobs.get(job_id)
        if job is None:
            return "0"
        if job.record.get("status") in TERMINAL:
            raise JobFencedError(job_id, "final")
        if fence is not None and (job.record.get("owner"), job.record.get("attempts")) != fence:
            raise JobFencedError(job_id, "fenced")
        if fields:
            await self.update(job_id, fields)
        event = Event(str(len(job.events) + 1), type, data)
        job.events.append(event)
        changed, job.changed = job.changed, asyncio.Event()
        changed.set()
        return event.id

    def _after(self, job: _MemoryJob, after: str | None) -> list[Event]:
        start = 0 if after is None else int(after)
        return job.events[start:]

    async def events(self, job_id: str, after: str | None) -> list[Event]:
        job = self._jobs.get(job_id)
        return [] if job is None else self._after(job, after)

    async def wait_events(self, job_id: str, after: str | None, timeout: float) -> list[Event]:
        job = self._jobs.get(job_id)
        if job is None:
            return []
        found = self._after(job, after)
        if found:
            return found
        try:
            await asyncio.wait_for(job.changed.wait(), timeout)
        except TimeoutError:
            return []
        return self._after(job, after)

    def check_event_id(self, event_id: str) -> str:
        if not _EVENT_ID.fullmatch(event_id):
            raise InvalidRequestError(
                f"Last-Event-ID must be an event id this server sent (digits), got {event_id[:40]!r}",
                param="Last-Event-ID",
            )
        return event_id

    def count(self) -> int:
        return len(self._jobs)
