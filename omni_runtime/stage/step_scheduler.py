"""The step-level scheduler of one stage replica: which requests take the next denoising step together.

Pure policy, no I/O, clock injected, like :mod:`omni_runtime.stage.scheduler`. With
``engine_args.step_execution`` the stage worker (the event loop of the replica's process) runs one
denoising step at a time: before each step it asks :meth:`StepScheduler.schedule` for a
:class:`StepPlan`, has the runner carry it out in the forward thread, and reports what happened with
:meth:`StepScheduler.finish_step`.

* One key per step. A step is one batched denoiser call, so the requests that step together share a
  compatibility key (size, guidance mode...; not the step count: each request has its own timesteps).
* The leader picks the key: the live request of highest *aged* priority (as in
  :func:`~omni_runtime.stage.scheduler.aged_rank`: one level per ``priority_aging_s`` waited), then
  earliest arrival, whether it waits or has already taken steps, as request-level's oldest-key-first
  waves do. Nothing starves: a request that waits only grows older than everyone who arrives after
  it, and ages past any priority in time.
* The batch: the best ``max_num_seqs`` live requests of that key (aged priority, then arrival). So a
  compatible request that arrives while the key is stepping joins at the next step when there is
  room, and a request leaves the batch after its own last step. Those taking their first step are
  *admitted* (the runner encodes them, in one call). Under load the batch is as full as a
  request-level wave would be. A request may bound the batch it steps in (``max_batch``: a video's
  share of ``max_video_pixels``): the batch ends before the first request that would take it past
  its own bound or a member's, and that request waits for room, as it would for ``max_num_seqs``.
* Pauses. A request that has taken steps but is not in this step's batch keeps its state in the
  runner and resumes when it is again: when a request of higher priority took its place in the
  batch (preemption), or when an older or higher-priority request of another key leads.
* Learned cap. With a :class:`~omni_runtime.stage.cost_model.CostModel` injected (``cost_model``,
  fed each step's time and batch size), the batch of a key the model knows is also capped where its
  throughput stops rising: on a machine where a step of 4 costs 4 steps of 1, requests step one at
  a time and the first one finishes first, instead of all finishing late together.
* Abort. A request that has not started leaves at once; one with state leaves with the next plan,
  which asks the runner to drop that state.
* Deadlines (``policy="deadline"``, ``engine_args.batch_policy: deadline``). The leader and the
  batch are ranked by :mod:`omni_runtime.stage.deadline` instead: overdue requests by arrival,
  then those that can still meet their latency target (``slo_ms``), least slack first, then those
  that cannot; the slack comes from the cost model's time of a step. With ``slo_shed``, a request
  the model expects to finish past its target is refused at :meth:`StepScheduler.add`.

:class:`ProgressThrottle` decides when progress events go out, so that they cost about 1 % of the time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from omni_runtime.exceptions import ConfigError, DuplicateRequestError, QueueFullError
from omni_runtime.stage import deadline
from omni_runtime.stage.cost_model import CostModel
from omni_runtime.stage.scheduler import BatchSize, aged_rank

StepPolicy = Literal["priority", "deadline"]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the runner does before the next step boundary: drop, admit, then one step of one key."""

    #: Increasing from 1, per scheduler.
    step_id: int
    #: The key whose requests step; None when none steps (a plan that only drops state).
    key: Hashable | None
    #: The requests that take one denoising step together, best first.
    run: list[str]
    #: Of ``run``, those taking their first step: the runner encodes and prepares them first.
    join: list[str]
    #: What :meth:`StepScheduler.add` was given, for each request of ``join``.
    payloads: dict[str, Any]
    #: Of ``run``, those that had state but did not take the previous step.
    resume: list[str]
    #: Took the previous step, did not finish, and do not take this one; they keep their state.
    paused: list[str]
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
    #: Arrival order: the tie-break among equal priorities.
    seq: int
    arrival: float
    admitted_at: float | None = None
    #: Admitted once: the runner holds its state until it finishes or is dropped.
    has_state: bool = False
    aborted: bool = False
    steps: int = 0
    first_step_id: int | None = None
    first_step_at: float | None = None
    max_batch: int = 0
    pauses: int = 0
    #: Most requests that may step together while this one does (None: max_num_seqs alone).
    cap: int | None = None
    #: What the deadline policy ranks it by (None under the priority policy).
    deadline: deadline.Deadline | None = None


class StepScheduler(BatchSize):
    """Decides the steps of one stage replica. Not thread-safe: owned by the worker's event loop."""

    def __init__(
        self,
        max_num_seqs: int = 1,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_queue_len: int | None = None,
        priority_aging_s: float = 10.0,
        cost_model: CostModel | None = None,
        policy: StepPolicy = "priority",
        slo_ms: float | None = None,
        slo_shed: bool = False,
    ) -> None:
        if max_queue_len is not None:
            _check_int("max_queue_len", max_queue_len)
        if policy not in ("priority", "deadline"):
            raise ConfigError(f"expected 'priority' or 'deadline', got {policy!r}", path="policy")
        self._policy = policy
        #: The stage's latency target (ms); a request's own ``slo_ms`` tightens it.
        self._slo_ms = slo_ms
        self._slo_shed = slo_shed and policy == "deadline"
        self._shed = 0
        self._aging_s = float(priority_aging_s)
        self._clock = clock
        self._max_queue_len = max_queue_len
        self._cost_model = cost_model
        self.set_config(max_num_seqs=max_num_seqs)
        # Every live request, and two indexes in arrival order: by priority, and by key then priority.
        self._entries: dict[str, _Entry] = {}
        self._by_priority: dict[int, dict[str, _Entry]] = {}
        self._by_key: dict[Hashable, dict[int, dict[str, _Entry]]] = {}
        self._with_state = 0
        self._aborted: list[str] = []  # aborted with state: dropped by the next plan
        self._last_run: list[str] = []
        self._in_flight: StepPlan | None = None
        self._seq = itertools.count()
        self._next_step_id = 1
        self._requests_admitted = 0
        self._histogram: dict[int, int] = {}

    # ------------------------------------------------------------------ requests

    def add(
        self,
        request_id: str,
        key: Hashable,
        payload: Any = None,
        *,
        priority: int = 0,
        max_batch: int | None = None,
        slo_ms: float | None = None,
        steps: int | None = None,
    ) -> None:
        """Queue a request. ``key`` groups requests that may step together; higher ``priority`` first;
        ``max_batch`` bounds the batch of any step this one takes (at least 1). Under the deadline
        policy, ``slo_ms`` is its latency target (tightening the stage's) and ``steps`` the
        denoising steps it will run (what its remaining time is predicted from)."""
        if request_id in self._entries:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        if self._max_queue_len is not None and self.num_waiting >= self._max_queue_len:
            raise QueueFullError(f"{self.num_waiting} requests already wait (max_queue_len)")
        now = self._clock()
        entry = _Entry(request_id, key, payload, int(priority), next(self._seq), now)
        entry.cap = None if max_batch is None else max(1, int(max_batch))
        if self._policy == "deadline":
            target = self._slo_ms if slo_ms is None else slo_ms if self._slo_ms is None else min(slo_ms, self._slo_ms)
            due = None if target is None else now + target / 1000.0
            entry.deadline = deadline.Deadline(key, now, due, steps, 0, entry.priority, entry.seq)
            if self._slo_shed and target is not None:
                self._shed_if_late(entry.deadline, target, now)
        self._entries[request_id] = entry
        self._by_priority.setdefault(entry.priority, {})[request_id] = entry
        self._by_key.setdefault(key, {}).setdefault(entry.priority, {})[request_id] = entry

    def _shed_if_late(self, new: deadline.Deadline, target_ms: float, now: float) -> None:
        live = (e.deadline for e in self._entries.values() if e.deadline is not None and not e.aborted)
        taken = deadline.admission(new, live, now, self._aging_s, self._cost_model, self._max_num_seqs)
        if taken.finish_ms > target_ms or taken.displaced:
            self._shed += 1
            whose = "the stage's" if target_ms == self._slo_ms else "the request's"
            why = (
                f"expected to finish in {taken.finish_ms:.0f} ms, past {whose} slo_ms {target_ms:g}"
                if taken.finish_ms > target_ms
                else f"taking it would make {taken.displaced} admitted request(s) miss their slo_ms"
            )
            raise QueueFullError(why, retry_after_s=max(0.001, taken.ahead_ms / 1000.0))

    def abort(self, request_id: str) -> Literal["waiting", "running"] | None:
        """Drop a request that has not started ("waiting"); mark one with state to leave with the
        next plan ("running"); None if unknown."""
        entry = self._entries.get(request_id)
        if entry is None or entry.aborted:
            return None if entry is None else "running"
        if not entry.has_state:
            self._remove(entry)
            return "waiting"
        entry.aborted = True
        self._aborted.append(request_id)
        return "running"

    def is_aborted(self, request_id: str) -> bool:
        """Whether a request with state was aborted (it leaves with the next plan)."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.aborted

    # ------------------------------------------------------------------ steps

    def schedule(self) -> StepPlan | None:
        """The plan of the next step, or None: a step is in flight, or there is nothing to do."""
        if self._in_flight is not None:
            return None
        now = self._clock()
        # 1) Aborted requests with state leave; the runner frees it with this plan.
        drop = []
        for rid in self._aborted:
            entry = self._entries.get(rid)
            if entry is not None:  # not finished meanwhile
                self._remove(entry)
                drop.append(rid)
        self._aborted = []
        # 2) The leader (priority, then arrival) picks the key; the best of that key form the batch.
        # Under the deadline policy every request is ranked once per plan (the rank moves with the
        # clock and the cost model), for the leader and its key's batch alike.
        ranks = self._deadline_ranks(now) if self._policy == "deadline" else None
        leader = self._leader(ranks)
        batch = [] if leader is None else self._best_of(leader.key, self._limit(leader.key), ranks)
        if not batch and not drop:
            return None
        last = set(self._last_run)
        run = [e.request_id for e in batch]
        resume = [e.request_id for e in batch if e.has_state and e.request_id not in last]
        chosen = set(run)
        paused = [rid for rid in self._last_run if rid in self._entries and rid not in chosen]
        for rid in paused:
            self._entries[rid].pauses += 1
        # 3) Those taking their first step are admitted.
        join, payloads, queue_wait_ms = [], {}, {}
        for entry in batch:
            if not entry.has_state:
                entry.has_state, entry.admitted_at = True, now
                self._with_state += 1
                self._requests_admitted += 1
                join.append(entry.request_id)
                payloads[entry.request_id] = entry.payload
                queue_wait_ms[entry.request_id] = (now - entry.arrival) * 1000.0
        plan = StepPlan(
            step_id=self._next_step_id,
            key=None if leader is None else leader.key,
            run=run,
            join=join,
            payloads=payloads,
            resume=resume,
            paused=paused,
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
            entry = self._entries.get(rid)
            if entry is None:
                continue
            entry.steps += 1
            if entry.deadline is not None:
                entry.deadline.steps_taken = entry.steps
            entry.max_batch = max(entry.max_batch, batch)
            if entry.first_step_id is None:
                entry.first_step_id, entry.first_step_at = step_id, now
        done: dict[str, dict[str, Any]] = {}
        for rid in finished:
            entry = self._entries.get(rid)
            if entry is None:
                continue
            self._remove(entry)
            if entry.aborted:
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
                "pauses": entry.pauses,
            }
        self._last_run = plan.run
        self._in_flight = None
        return done

    # ------------------------------------------------------------------ configuration and stats

    def set_config(
        self,
        *,
        max_num_seqs: int | None = None,
        max_wait_ms: float | None = None,
        stable_window_ms: float | None = None,
    ) -> None:
        """Change the batch size; it applies from the next plan (a request beyond it pauses).
        ``max_wait_ms`` and ``stable_window_ms`` are accepted for the request-level interface and
        have no effect: a request joins at the next step anyway."""
        if max_num_seqs is not None:
            self._ask_max_num_seqs(max_num_seqs)

    @property
    def max_wait_ms(self) -> float:
        return 0.0

    @property
    def stable_window_ms(self) -> float:
        """No hold, so no quiet window to end one: 0."""
        return 0.0

    @property
    def num_waiting(self) -> int:
        """Requests that have not taken a step yet."""
        return len(self._entries) - self._with_state

    @property
    def num_running(self) -> int:
        """Requests the runner holds state for (stepping or paused)."""
        return self._with_state

    def running_ids(self) -> list[str]:
        """The requests the runner holds state for."""
        return [rid for rid, e in self._entries.items() if e.has_state]

    def stats(self) -> dict[str, Any]:
        """Counters; ``batch_size_histogram`` maps the size of a step's batch to how many steps had it."""
        last = set(self._last_run)
        return {
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "num_paused": sum(1 for rid, e in self._entries.items() if e.has_state and rid not in last),
            "steps": self._next_step_id - 1,
            "requests_scheduled": self._requests_admitted,
            "batch_size_histogram": dict(sorted(self._histogram.items())),
            **({"slo_shed": self._shed} if self._slo_shed else {}),
        }

    # ------------------------------------------------------------------ internals

    def _rank(self, entry: _Entry) -> tuple[float, int]:
        return aged_rank(entry.priority, entry.arrival, self._aging_s), entry.seq

    def _deadline_ranks(self, now: float) -> dict[str, tuple[float, ...]]:
        return {
            rid: deadline.rank(e.deadline, now, self._aging_s, self._cost_model)
            for rid, e in self._entries.items()
            if e.deadline is not None
        }

    def _leader(self, ranks: dict[str, tuple[float, ...]] | None) -> _Entry | None:
        if not self._by_priority:
            return None
        if ranks is not None:
            return min(self._entries.values(), key=lambda e: ranks[e.request_id])
        if len(self._by_priority) > 1:  # aging may lift an older, lower priority over a newer one
            return min(self._entries.values(), key=self._rank)
        return next(iter(self._by_priority[max(self._by_priority)].values()))

    def _limit(self, key: Hashable) -> int:
        """``max_num_seqs``, or less where the cost model says a bigger step stops paying."""
        best = None if self._cost_model is None else self._cost_model.best_batch(key, self._max_num_seqs)
        return self._max_num_seqs if best is None else best

    def _best_of(self, key: Hashable, limit: int, ranks: dict[str, tuple[float, ...]] | None) -> list[_Entry]:
        by_priority = self._by_key[key]
        if ranks is not None:
            members = (e for same in by_priority.values() for e in same.values())
            entries: Iterable[_Entry] = sorted(members, key=lambda e: ranks[e.request_id])
        elif len(by_priority) > 1:
            entries = sorted((e for same in by_priority.values() for e in same.values()), key=self._rank)
        else:
            entries = (e for priority in sorted(by_priority, reverse=True) for e in by_priority[priority].values())
        best: list[_Entry] = []
        for entry in entries:
            if entry.cap is not None:
                limit = min(limit, entry.cap)
            if len(best) >= limit:  # full, or this one's bound leaves it no room: it waits
                break
            best.append(entry)
        return best

    def _remove(self, entry: _Entry) -> None:
        rid, priority = entry.request_id, entry.priority
        del self._entries[rid]
        if entry.has_state:
            self._with_state -= 1
        same = self._by_priority[priority]
        del same[rid]
        if not same:
            del self._by_priority[priority]
        of_key = self._by_key[entry.key]
        same = of_key[priority]
        del same[rid]
        if not same:
            del of_key[priority]
            if not of_key:
                del self._by_key[entry.key]


@dataclass(slots=True)
class ProgressThrottle:
    """When the worker may send progress events: in bursts (every request that just stepped, in one
    go), at most one burst per :attr:`interval_s`, so that they cost about ``budget`` of the time.

    What a burst costs is mostly not the worker's send (about 0.1 ms for a few events, measured) but
    what it sets off elsewhere: the orchestrator thread and the caller's event loop wake up to route
    and deliver each event, and on a machine whose cores the model's threads already fill, that
    preempts a model thread mid-step. Measured on 2 CPU cores: about 3 ms per event with tiny-sd,
    against 0.1 ms sent. Hence a floor under the interval (``min_interval_s`` = 3 ms / 1 %), and
    above it the measured send cost x ``amplification`` / ``budget``, up to ``max_interval_s``: a
    progress bar or a job's event stream still moves at least once a second on a slow machine.
    ``fixed_interval_s`` (``engine_args.progress_interval_s``) replaces all that with a fixed
    interval; 0 makes every step due.
    """

    fixed_interval_s: float | None = None
    budget: float = 0.01
    min_interval_s: float = 0.3
    max_interval_s: float = 1.0
    amplification: float = 30.0
    _last: float = float("-inf")
    bursts: int = 0
    events: int = 0
    cost_s: float = 0.0
    step_s: float = 0.0

    @property
    def interval_s(self) -> float:
        if self.fixed_interval_s is not None:
            return self.fixed_interval_s
        per_burst = self.cost_s / self.bursts if self.bursts else 0.0
        return min(self.max_interval_s, max(self.min_interval_s, per_burst * self.amplification / self.budget))

    def add_step(self, seconds: float) -> None:
        self.step_s += seconds

    def due(self, now: float) -> bool:
        return now - self._last >= self.interval_s

    def claim(self, now: float) -> bool:
        """``due``, and if so the burst is taken now (for a caller in another thread than the sender,
        so that two steps in quick succession do not both send)."""
        if not self.due(now):
            return False
        self._last = now
        return True

    def sent(self, now: float, events: int, cost_s: float) -> None:
        self._last = now
        self.bursts += 1
        self.events += events
        self.cost_s += cost_s

    def stats(self) -> dict[str, Any]:
        return {
            "progress_events": self.events,
            "progress_bursts": self.bursts,
            "progress_cost_ms": self.cost_s * 1000.0,
            "step_time_ms": self.step_s * 1000.0,
        }


def _check_int(field_name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"expected int >= 1, got {value!r}", path=field_name)
