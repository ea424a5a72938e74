"""The step-level scheduler of one stage replica: which requests hold a slot in the running denoising
batch, and which of them take the next step.

Pure policy, no I/O, clock injected, like :mod:`omni_runtime.stage.scheduler`. With
``engine_args.step_execution`` the stage worker (the event loop of the replica's process) runs one
denoising step at a time: before each step it asks :meth:`StepScheduler.schedule` for a
:class:`StepPlan`, has the runner carry it out in the forward thread, and reports what happened with
:meth:`StepScheduler.finish_step`.

* Slots. At most ``max_num_seqs`` requests (of any keys) hold a slot. A free slot goes to the waiting
  request of highest priority, then earliest arrival, at the next step boundary: new requests join a
  running batch instead of waiting for it to end. A finished or aborted request frees its slot at once.
* One key per step. A step is one batched denoiser call, so the requests that step together share a
  compatibility key (size, guidance mode...; not the step count: each request has its own timesteps).
  The key of the oldest running request of the highest priority steps, with every running request
  of that key: requests finish close to arrival order, as request-level's oldest-key-first waves do,
  and a compatible arrival still joins at the next step. Taking turns between keys instead would
  slow every running request whenever two keys run, and stretch the latency tail.
* Preemption. A waiting request of higher priority than the lowest-priority running one takes that
  one's slot at the step boundary (of equals, the one admitted last gives way). The preempted request
  keeps its state in the runner and its place in the queue (its arrival), and resumes when a slot frees.
* Abort. A waiting request leaves at once (its state, if it was preempted, is dropped with the next
  plan); a running one leaves with the next plan, which asks the runner to drop its state.

:class:`ProgressThrottle` bounds what per-step progress events cost, as a share of the stepping time.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

from omni_runtime.exceptions import ConfigError, DuplicateRequestError, QueueFullError


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the runner does before the next step boundary: drop, admit, then one step of one key."""

    #: Increasing from 1, per scheduler.
    step_id: int
    #: The key whose running requests step; None when none steps (a plan that only drops state).
    key: Hashable | None
    #: Requests that take one denoising step together, in admission order.
    run: list[str]
    #: Requests entering the running set for the first time: the runner encodes and prepares them.
    join: list[str]
    #: What :meth:`StepScheduler.add` was given, for each request of ``join``.
    payloads: dict[str, Any]
    #: Preempted earlier and back in the running set; their state is still in the runner.
    resume: list[str]
    #: Leave the running set at this boundary and keep their state (a higher priority took the slot).
    preempt: list[str]
    #: Aborted requests whose state the runner frees.
    drop: list[str]
    #: Per joining request: admission minus arrival.
    queue_wait_ms: dict[str, float]


@dataclass(slots=True)
class _Entry:
    request_id: str
    key: Hashable
    payload: Any
    priority: int
    #: Arrival order; the tie-break of equal priorities, kept through preemption.
    seq: int
    arrival: float
    #: Admission order into the running set (the last admitted is preempted first among equals).
    admit_seq: int = 0
    admitted_at: float | None = None
    #: The runner holds its state (it was admitted once), so a return to the running set is a resume.
    has_state: bool = False
    aborted: bool = False
    steps: int = 0
    first_step_id: int | None = None
    first_step_at: float | None = None
    max_batch: int = 0
    preemptions: int = 0


class StepScheduler:
    """Decides the steps of one stage replica. Not thread-safe: owned by the worker's event loop."""

    def __init__(
        self,
        max_num_seqs: int = 1,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_queue_len: int | None = None,
    ) -> None:
        if max_queue_len is not None:
            _check_int("max_queue_len", max_queue_len)
        self._clock = clock
        self._max_queue_len = max_queue_len
        self._asked_max_num_seqs = 1
        self._batch_cap: int | None = None
        self._max_num_seqs = 1
        self.set_config(max_num_seqs=max_num_seqs)
        # Waiting: a heap of (-priority, seq, id) with lazy deletion, and the entries by id.
        self._heap: list[tuple[int, int, str]] = []
        self._waiting: dict[str, _Entry] = {}
        self._running: dict[str, _Entry] = {}  # admission order
        self._drops: list[str] = []  # aborted while preempted: state to free with the next plan
        self._in_flight: StepPlan | None = None
        self._seq = itertools.count()
        self._admit_seq = itertools.count()
        self._next_step_id = 1
        self._requests_admitted = 0
        self._histogram: dict[int, int] = {}

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, key: Hashable, payload: Any = None, *, priority: int = 0) -> None:
        """Queue a request. ``key`` groups requests that may step together; higher ``priority`` first."""
        if request_id in self._waiting or request_id in self._running:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        if self._max_queue_len is not None and len(self._waiting) >= self._max_queue_len:
            raise QueueFullError(f"{len(self._waiting)} requests already wait (max_queue_len)")
        entry = _Entry(request_id, key, payload, int(priority), next(self._seq), self._clock())
        self._push(entry)

    def abort(self, request_id: str) -> Literal["waiting", "running"] | None:
        """Drop a waiting request, or mark a running one to leave with the next plan; None if unknown."""
        entry = self._waiting.pop(request_id, None)
        if entry is not None:
            if entry.has_state:
                self._drops.append(request_id)
            return "waiting"
        entry = self._running.get(request_id)
        if entry is not None:
            entry.aborted = True
            return "running"
        return None

    def is_aborted(self, request_id: str) -> bool:
        """Whether a running request was aborted (it leaves with the next plan)."""
        entry = self._running.get(request_id)
        return entry is not None and entry.aborted

    # ------------------------------------------------------------------ steps

    def schedule(self) -> StepPlan | None:
        """The plan of the next step, or None: a step is in flight, or there is nothing to do."""
        if self._in_flight is not None:
            return None
        now = self._clock()
        # 1) Aborted running requests leave; the runner frees their state with this plan.
        drop, self._drops = self._drops, []
        for rid in [rid for rid, e in self._running.items() if e.aborted]:
            del self._running[rid]
            drop.append(rid)
        # 2) Free slots go to the best waiting requests (priority, then arrival).
        join: list[str] = []
        resume: list[str] = []
        payloads: dict[str, Any] = {}
        queue_wait_ms: dict[str, float] = {}

        def admit(entry: _Entry) -> None:
            entry.admit_seq = next(self._admit_seq)
            self._running[entry.request_id] = entry
            if entry.has_state:
                resume.append(entry.request_id)
                return
            entry.has_state = True
            entry.admitted_at = now
            join.append(entry.request_id)
            payloads[entry.request_id] = entry.payload
            queue_wait_ms[entry.request_id] = (now - entry.arrival) * 1000.0
            self._requests_admitted += 1

        while len(self._running) < self._max_num_seqs:
            best = self._pop_best()
            if best is None:
                break
            admit(best)
        # 3) Preemption: a waiting request of higher priority than the lowest running one swaps in.
        preempt: list[str] = []
        while self._running:
            best = self._peek_best()
            victim = min(self._running.values(), key=lambda e: (e.priority, -e.admit_seq))
            if best is None or best.priority <= victim.priority:
                break
            del self._running[victim.request_id]
            victim.preemptions += 1
            self._push(victim)
            preempt.append(victim.request_id)
            admit(self._pop_best())
        # 4) The key that steps: that of the oldest running request of the highest priority.
        key = self._pick_key()
        run = [] if key is None else [rid for rid, e in self._running.items() if e.key == key]
        if not (run or join or drop or preempt):
            return None
        plan = StepPlan(
            step_id=self._next_step_id,
            key=key,
            run=run,
            join=join,
            payloads=payloads,
            resume=resume,
            preempt=preempt,
            drop=drop,
            queue_wait_ms=queue_wait_ms,
        )
        self._next_step_id += 1
        self._in_flight = plan
        return plan

    def finish_step(
        self, step_id: int, stepped: Collection[str], finished: Collection[str]
    ) -> dict[str, dict[str, Any]]:
        """End the plan in flight. ``stepped``: the requests that took the step; ``finished``: those
        that left (last step done, or failed). Returns the metrics of each finished request that was
        not aborted meanwhile (an aborted one's caller was already answered)."""
        plan = self._in_flight
        if plan is None or plan.step_id != step_id:
            raise ValueError(f"step {step_id} is not in flight (in flight: {plan and plan.step_id})")
        now = self._clock()
        batch = len(stepped)
        if batch:
            self._histogram[batch] = self._histogram.get(batch, 0) + 1
        for rid in stepped:
            entry = self._running.get(rid)
            if entry is None:
                continue
            entry.steps += 1
            entry.max_batch = max(entry.max_batch, batch)
            if entry.first_step_id is None:
                entry.first_step_id, entry.first_step_at = step_id, now
        done: dict[str, dict[str, Any]] = {}
        for rid in finished:
            entry = self._running.pop(rid, None)
            if entry is None or entry.aborted:
                continue
            admitted = entry.admitted_at if entry.admitted_at is not None else now
            done[rid] = {
                "queue_wait_ms": (admitted - entry.arrival) * 1000.0,
                "time_to_first_step_ms": None
                if entry.first_step_at is None
                else (entry.first_step_at - entry.arrival) * 1000.0,
                "execution_ms": (now - admitted) * 1000.0,
                "batch_id": entry.first_step_id,
                "batch_size": entry.max_batch,
                "steps_run": entry.steps,
                "preemptions": entry.preemptions,
            }
        self._in_flight = None
        return done

    # ------------------------------------------------------------------ configuration and stats

    def set_config(self, *, max_num_seqs: int | None = None, max_wait_ms: float | None = None) -> None:
        """Change the number of slots; it applies from the next plan (running requests above a lowered
        cap finish their steps; no one new joins until there is room). ``max_wait_ms`` is accepted
        for the request-level interface and has no effect: a request joins at the next step anyway."""
        if max_num_seqs is not None:
            _check_int("max_num_seqs", max_num_seqs)
            self._asked_max_num_seqs = max_num_seqs
            self._apply_cap()

    def set_batch_cap(self, cap: int | None) -> None:
        """The most requests the runner can step at once; ``max_num_seqs`` never exceeds it."""
        if cap is not None:
            _check_int("batch cap", cap)
        self._batch_cap = cap
        self._apply_cap()

    def _apply_cap(self) -> None:
        cap = self._batch_cap
        self._max_num_seqs = self._asked_max_num_seqs if cap is None else min(cap, self._asked_max_num_seqs)

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def max_wait_ms(self) -> float:
        return 0.0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def running_ids(self) -> list[str]:
        """The requests holding a slot, in admission order."""
        return list(self._running)

    def stats(self) -> dict[str, Any]:
        """Counters; ``batch_size_histogram`` maps the size of a step's batch to how many steps had it."""
        return {
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "num_preempted": sum(1 for e in self._waiting.values() if e.has_state),
            "steps": self._next_step_id - 1,
            "requests_scheduled": self._requests_admitted,
            "batch_size_histogram": dict(sorted(self._histogram.items())),
        }

    # ------------------------------------------------------------------ internals

    def _push(self, entry: _Entry) -> None:
        self._waiting[entry.request_id] = entry
        heapq.heappush(self._heap, (-entry.priority, entry.seq, entry.request_id))

    def _peek_best(self) -> _Entry | None:
        while self._heap:
            _, seq, rid = self._heap[0]
            entry = self._waiting.get(rid)
            if entry is not None and entry.seq == seq:
                return entry
            heapq.heappop(self._heap)  # aborted, or its id reused since
        return None

    def _pop_best(self) -> _Entry | None:
        entry = self._peek_best()
        if entry is not None:
            heapq.heappop(self._heap)
            del self._waiting[entry.request_id]
        return entry

    def _pick_key(self) -> Hashable | None:
        if not self._running:
            return None
        return min(self._running.values(), key=lambda e: (-e.priority, e.seq)).key


@dataclass(slots=True)
class ProgressThrottle:
    """Keeps what progress events cost under ``budget`` of the time spent stepping.

    A token bucket: each step adds ``budget`` x its duration of credit, capped at ``burst_steps``
    steps' worth; each event spends its measured cost x ``amplification`` (the worker's send is one of
    the hops an event makes: the orchestrator routes it and the caller's loop delivers it, on the same
    cores). Credit may go below zero by one event, which the next steps repay.
    """

    budget: float = 0.01
    amplification: float = 3.0
    burst_steps: float = 2.0
    _credit: float = 0.0
    events: int = 0
    cost_s: float = 0.0
    step_s: float = 0.0
    _seen: dict[str, None] = field(default_factory=dict)

    def add_step(self, seconds: float) -> None:
        self.step_s += seconds
        self._credit = min(self._credit + self.budget * seconds, self.budget * seconds * self.burst_steps)

    def allow(self) -> bool:
        return self._credit > 0.0

    def spend(self, seconds: float) -> None:
        self.events += 1
        self.cost_s += seconds
        self._credit -= seconds * self.amplification

    def stats(self) -> dict[str, Any]:
        return {
            "progress_events": self.events,
            "progress_cost_ms": self.cost_s * 1000.0,
            "step_time_ms": self.step_s * 1000.0,
        }


def _check_int(field_name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"expected int >= 1, got {value!r}", path=field_name)
