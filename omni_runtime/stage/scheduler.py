"""The request-level scheduler of one stage replica: which waiting requests run together.

Pure policy, no I/O, clock injected. The stage worker (the event loop of the replica's process) calls
:meth:`~RequestScheduler.add` on each arrival and :meth:`~RequestScheduler.schedule` whenever its runner
is idle, runs the :class:`Wave` it gets in one fused ``forward()``, then calls ``finish``.

* One wave at a time. The key of the *oldest* waiting request runs next, with the waiting requests of
  that key in arrival order, up to ``max_num_seqs``: an incompatible request never blocks compatible
  ones behind it, and nothing starves. ``policy="fifo"`` is the strict-FIFO baseline: the head plus
  the consecutive requests of its key, stopping at the first incompatible one.
* Priority. "Oldest" is by *aged priority*: a request of priority ``p`` that arrived at ``t`` ranks by
  ``p - t / aging_s`` (higher first; equal ranks in arrival order). With one priority this is arrival
  order; a request of higher priority goes first, yet every second a request waits counts as
  ``1 / aging_s`` of a level, so a low-priority request waits at most ``aging_s`` seconds per level of
  difference behind later arrivals: it cannot starve. The rank does not change as time passes (the
  clock cancels out of every comparison), so no re-sorting is ever needed.
* Admission wait. A wave goes at once when it is full, when ``max_wait_ms == 0``, or when its head
  queued behind an earlier wave (that wave's run was its batching window; holding again would idle a
  runner that has work, so under load the scheduler is work-conserving). Otherwise it is held until
  ``max(head arrival, idle since) + max_wait_ms``, or earlier once nothing has arrived for
  ``stable_window_ms``: the burst that woke the scheduler is over, and waiting longer buys nothing.

The stable window, unless fixed (``stable_window_ms``), adapts to the arrivals: it is
``_GAP_MARGIN`` times the longest gap between consecutive arrivals among the last ``_GAP_HISTORY`` gaps
that were shorter than ``max_wait_ms`` (gaps inside a burst; longer ones are pauses between bursts),
never below ``min(max_wait_ms / 4, 5.0)`` ms and never above ``max_wait_ms``. A gap across which a
wave finished is not learned from: a client that sends its next request when its previous one is
answered arrives a hold, a forward and its own think time after that request, and learning that gap
would hold the next request longer, whose answer comes later, whose successor's gap is longer: the
window would feed on its own holds (a lone client waited 8, 25, then 76 s with a large wait). A gap
with no finish inside is bounded by what the scheduler does not control: an arrival that reacts to
a finish comes at most its client's think time after the latest arrival before it, and any other
arrival does not depend on the scheduler at all. Requests of one
``generate()`` over a prompt list reach a replica well under a millisecond apart, and the floor keeps
what a lone request pays small. Concurrent HTTP clients arrive with jitter (connection set-up, parsing,
a busy machine): one late arrival of a burst that the floor missed teaches the window the gap, and the
following bursts are held long enough. Sporadic traffic pushes the short gaps out of the history, and
the window returns to the floor.

Learned admission (a :class:`~omni_runtime.stage.cost_model.CostModel` injected as ``cost_model``,
``engine_args.batch_policy: learned``). Once the model has a fit for the head's key, it replaces the
stable window: a wave is capped at the model's best batch (where throughput stops rising, never
above ``max_num_seqs``), and it is held only while the machine time one more request would save
(:meth:`~omni_runtime.stage.cost_model.CostFit.gain_of_one_more`) exceeds the expected wait for one
(the mean of the recent gaps between arrivals, all of them: a longer gap only makes holding look
worse, so it cannot feed on itself). A hold ends once it has lasted as long as that saving, or at
``max_wait_ms``, which stays the upper bound. When per-item cost is flat or rising the saving is
zero, and a lone request goes at once. Until the model has a fit for a key, the window above holds.

Re-exploration. Once the model caps a key at 1 (flat per-item cost), that key never runs a bigger
wave again, and a change in the curve (a warmed cache, other load leaving the machine) would never be
learned. So when a key has been capped at 1 for ``explore_every`` waves that had a second request of
it waiting, or for ``explore_after_s`` seconds since the first of them, its next such wave runs at 2
(counted as ``explored_waves``). That is at most one wave in ``explore_every`` run at a size the
model thinks costs as much as two single ones: bounded, and never a hold.

Latency target (``slo_ms``, with a cost model): the stage's, and a request's own (``add(slo_ms=)``);
a request is held to the tighter of the two. A hold never lasts past the moment every member of
the wave could still finish within its target of its arrival (its wait so far plus the model's time
for the wave it would run in). With ``slo_shed``, :meth:`~RequestScheduler.add` refuses
(QueueFullError, whose ``retry_after_s`` is the expected backlog) a request the model expects to
finish later than its target: the rest of the running wave, the waiting requests at their per-item
cost, and its own wave. A key the model does not know yet counts as free: a request is never
refused without evidence.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal

from omni_runtime.exceptions import ConfigError, DuplicateRequestError, QueueFullError
from omni_runtime.stage.cost_model import CostFit, CostModel

Policy = Literal["oldest_key", "fifo"]

#: A hold counts as over this close to its end, so a timer that fires a float rounding early is not
#: answered with a second, microsecond-long wait.
_DUE_SLACK_S = 1e-6
#: How many recent inter-arrival gaps the adaptive stable window looks at.
_GAP_HISTORY = 32
#: The adaptive stable window is this many times the longest recent gap inside a burst.
_GAP_MARGIN = 3.0
#: Keys whose capped waves the re-exploration counts; the least recently capped is forgotten first.
_EXPLORE_KEYS = 64


@dataclass(frozen=True, slots=True)
class Wave:
    """Requests fused into one ``forward()``: one key, arrival order."""

    #: Increasing from 1, per scheduler.
    batch_id: int
    key: Hashable
    request_ids: list[str]
    #: What :meth:`RequestScheduler.add` was given, in ``request_ids`` order.
    payloads: list[Any]
    #: Per request: dispatch time minus arrival.
    queue_wait_ms: dict[str, float]
    #: Per request: time held for batching, dispatch minus ``max(arrival, idle since)``; never negative.
    admission_wait_ms: dict[str, float]

    def __len__(self) -> int:
        return len(self.request_ids)


def aged_rank(priority: int, arrival: float, aging_s: float) -> float:
    """The rank of a waiting request (lower goes first): its priority, less what waiting has aged it.
    Comparing ``p1 - t1/a`` with ``p2 - t2/a`` is comparing the aged priorities at any moment."""
    return arrival / aging_s - priority


@dataclass(slots=True)
class _Pending:
    request_id: str
    key: Hashable
    payload: Any
    arrival: float
    priority: int = 0
    #: The tighter of the stage's and the request's latency target (ms), or None.
    slo_ms: float | None = None


class BatchSize:
    """``max_num_seqs`` as asked (config, ``set_batching``) and as applied: never above the
    runner's own cap, whichever was set first. Shared by the request and step schedulers."""

    _asked_max_num_seqs: int = 1
    _batch_cap: int | None = None
    _max_num_seqs: int = 1

    def _ask_max_num_seqs(self, value: int) -> None:
        _check_int("max_num_seqs", value)
        self._asked_max_num_seqs = value
        self._apply_cap()

    def set_batch_cap(self, cap: int | None) -> None:
        """The most requests the runner can take in one forward or step (None: no limit of its
        own). ``max_num_seqs`` never exceeds it, whatever is asked before or after."""
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


class RequestScheduler(BatchSize):
    """Decides the waves of one stage replica. Not thread-safe: owned by the worker's event loop."""

    def __init__(
        self,
        max_num_seqs: int = 1,
        max_wait_ms: float = 0.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        stable_window_ms: float | None = None,
        max_queue_len: int | None = None,
        policy: Policy = "oldest_key",
        priority_aging_s: float = 10.0,
        cost_model: CostModel | None = None,
        slo_ms: float | None = None,
        slo_shed: bool = False,
        explore_every: int = 16,
        explore_after_s: float = 30.0,
    ) -> None:
        if not isinstance(priority_aging_s, int | float) or not 0 < priority_aging_s < math.inf:
            raise ConfigError(f"expected a finite number of seconds > 0, got {priority_aging_s!r}", path="aging")
        if stable_window_ms is not None:
            _check_ms("stable_window_ms", stable_window_ms)
        if max_queue_len is not None:
            _check_int("max_queue_len", max_queue_len)
        if policy not in ("oldest_key", "fifo"):
            raise ConfigError(f"expected 'oldest_key' or 'fifo', got {policy!r}", path="policy")
        self._max_wait_ms = 0.0
        self.set_config(max_num_seqs=max_num_seqs, max_wait_ms=max_wait_ms)
        self._clock = clock
        self._stable_window_ms = stable_window_ms
        self._max_queue_len = max_queue_len
        self._policy: Policy = policy
        self._aging_s = float(priority_aging_s)
        #: How many waiting requests have each priority: with one priority, arrival order is the order.
        self._priorities: dict[int, int] = {}
        # Arrival order overall (the head is the first entry), and per key (fills a wave in O(wave)).
        self._waiting: dict[str, _Pending] = {}
        self._by_key: dict[Hashable, dict[str, _Pending]] = {}
        self._running: Wave | None = None
        self._aborted: set[str] = set()
        self._idle_since = clock()
        self._last_arrival = -math.inf
        #: Recent gaps between consecutive arrivals (s), for the adaptive stable window.
        self._gaps: deque[float] = deque(maxlen=_GAP_HISTORY)
        #: The same gaps, none left out: the arrival rate the learned admission expects.
        self._raw_gaps: deque[float] = deque(maxlen=_GAP_HISTORY)
        #: None: the window policy; otherwise waves are capped and held by what this model learned.
        self._cost_model = cost_model
        if slo_ms is not None:
            _check_ms("slo_ms", slo_ms)
        self._slo_ms = slo_ms
        self._slo_shed = slo_shed
        self._running_since = 0.0
        self._shed = 0
        _check_int("explore_every", explore_every)
        if isinstance(explore_after_s, bool) or not isinstance(explore_after_s, int | float) or explore_after_s <= 0:
            raise ConfigError(f"expected a number of seconds > 0, got {explore_after_s!r}", path="explore_after_s")
        self._explore_every = explore_every
        self._explore_after_s = float(explore_after_s)
        #: Per key capped at 1 by the model: waves capped while a second request waited, and when
        #: the first of them ran (see "Re-exploration" in the module docstring).
        self._capped: dict[Hashable, tuple[int, float]] = {}
        self._explored = 0
        #: A wave finished since the latest arrival: the next gap spans our own hold and forward.
        self._finished_since_arrival = False
        self._next_batch_id = 1
        self._requests_scheduled = 0
        self._histogram: dict[int, int] = {}

    def add(
        self, request_id: str, key: Hashable, payload: Any = None, *, priority: int = 0, slo_ms: float | None = None
    ) -> None:
        """Queue a request. ``key`` groups requests that may share a ``forward()``; higher
        ``priority`` goes first (aged: see the module docstring); ``slo_ms`` is its own latency
        target, tightening the stage's."""
        if request_id in self._waiting or self._is_running(request_id):
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        if self._max_queue_len is not None and len(self._waiting) >= self._max_queue_len:
            raise QueueFullError(f"{len(self._waiting)} requests already wait (max_queue_len)")
        now = self._clock()
        target = self._slo_ms if slo_ms is None else slo_ms if self._slo_ms is None else min(slo_ms, self._slo_ms)
        if self._slo_shed and target is not None:
            expected_ms = self._expected_finish_ms(key, now)
            if expected_ms > target:
                self._shed += 1
                whose = "this stage's" if target == self._slo_ms else "the request's"
                raise QueueFullError(
                    f"expected to finish in {expected_ms:.0f} ms, past {whose} slo_ms {target:g}",
                    retry_after_s=expected_ms / 1000.0,
                )
        pending = _Pending(request_id, key, payload, now, int(priority), target)
        self._waiting[request_id] = pending
        self._priorities[pending.priority] = self._priorities.get(pending.priority, 0) + 1
        self._by_key.setdefault(key, {})[request_id] = pending
        if self._last_arrival > -math.inf:
            # A gap across a finished wave still takes its place in the history (so sporadic
            # traffic ages the burst gaps out), as a pause that never counts as inside a burst.
            self._gaps.append(math.inf if self._finished_since_arrival else now - self._last_arrival)
            self._raw_gaps.append(now - self._last_arrival)
        self._last_arrival = now
        self._finished_since_arrival = False

    def abort(self, request_id: str) -> Literal["waiting", "running"] | None:
        """Drop a waiting request, or mark a running one for :meth:`is_aborted`; None if unknown."""
        pending = self._waiting.pop(request_id, None)
        if pending is not None:
            self._unindex(pending)
            return "waiting"
        if self._is_running(request_id):
            self._aborted.add(request_id)
            return "running"
        return None

    def is_aborted(self, request_id: str) -> bool:
        """Whether a request of the running wave was aborted (the runner drops it at its next step)."""
        return request_id in self._aborted

    def schedule(self) -> Wave | float | None:
        """A wave to run now, an absolute clock time to call again (unless a request arrives first),
        or None: nothing waits, or a wave is running."""
        # 1) One wave at a time (the runner is busy until finish()); an empty queue needs no call back.
        if self._running is not None or not self._waiting:
            return None
        # 2) The oldest waiting request (by aged priority) picks the key, so no key starves behind a
        #    busier one.
        head = self._head()
        fit = None if self._cost_model is None else self._cost_model.fit(head.key)
        limit = self._max_num_seqs if fit is None else fit.best_batch(self._max_num_seqs, self._margin())
        now = self._clock()
        if limit == 1 and fit is not None and self._max_num_seqs > 1 and len(self._by_key[head.key]) > 1:
            limit = self._explore_limit(head.key, now)
        elif limit > 1:
            self._capped.pop(head.key, None)
        members, closed = self._select(head, limit)
        # 3) Go at once when holding cannot grow the wave (full, or a fifo run already cut off by an
        #    incompatible request), when no added latency is wanted, or when the head queued behind a
        #    running wave and so has already waited its turn.
        if len(members) >= limit or closed or self._max_wait_ms == 0 or head.arrival < self._idle_since:
            return self._dispatch(head.key, members, now)
        # 4) Otherwise hold for compatible arrivals, bounded by the deadline, and ended early: by a
        #    quiet stable window after the most recent arrival (the burst is over), or, once the cost
        #    model knows this key, as soon as one more request no longer pays for its wait.
        deadline = max(head.arrival, self._idle_since) + self._max_wait_ms / 1000.0
        if fit is None:
            wake_at = min(deadline, self._last_arrival + self._stable_window() / 1000.0)
        else:
            hold_s = self._learned_hold_s(fit, len(members))
            if hold_s <= 0:
                return self._dispatch(head.key, members, now)
            start = max(head.arrival, self._idle_since, self._last_arrival)
            wake_at = min(deadline, start + hold_s)
            targets = [p.arrival + p.slo_ms / 1000.0 for p in members if p.slo_ms is not None]
            if targets:  # every member must still make its target in a bigger wave
                wake_at = min(wake_at, min(targets) - fit.time_ms(len(members) + 1) / 1000.0)
        if now >= wake_at - _DUE_SLACK_S:
            return self._dispatch(head.key, members, now)
        # 5) Not yet: tell the worker when to ask again.
        return wake_at

    def _expected_finish_ms(self, key: Hashable, now: float) -> float:
        """When a request of ``key`` arriving now is expected to finish (ms from now), by the cost
        model: the running wave's rest, every waiting request at its key's per-item cost in a wave
        of its best size, and its own wave. Unknown keys count as free."""
        model = self._cost_model
        if model is None:
            return 0.0
        total = 0.0
        if self._running is not None and (fit := model.fit(self._running.key)) is not None:
            total += max(0.0, fit.time_ms(len(self._running)) - (now - self._running_since) * 1000.0)
        for k, same in self._by_key.items():
            if (fit := model.fit(k)) is not None:
                best = fit.best_batch(self._max_num_seqs, model.margin)
                total += len(same) * fit.time_ms(best) / best
        own = model.fit(key)
        if own is not None:
            total += own.time_ms(1)
        return total

    def _explore_limit(self, key: Hashable, now: float) -> int:
        """The cap of a wave of ``key``, which the model caps at 1 while a second request of it
        waits: 2 when re-exploration is due, else 1 (and this wave counts towards it)."""
        count, since = self._capped.pop(key, (0, now))
        if count >= self._explore_every or (count and now - since >= self._explore_after_s):
            self._explored += 1
            return 2
        self._capped[key] = (count + 1, since)  # re-inserted: the least recently capped go first
        if len(self._capped) > _EXPLORE_KEYS:
            del self._capped[next(iter(self._capped))]
        return 1

    def _margin(self) -> float:
        return 0.05 if self._cost_model is None else self._cost_model.margin

    def _learned_hold_s(self, fit: CostFit, n: int) -> float:
        """How long one more request is worth waiting for (s), after the latest arrival: the machine
        time it would save, if that beats the expected wait for it; else 0 (go now)."""
        gain_ms = fit.gain_of_one_more(n)
        if gain_ms <= 0 or not self._raw_gaps:
            return 0.0
        expected_gap_ms = sum(self._raw_gaps) / len(self._raw_gaps) * 1000.0
        return gain_ms / 1000.0 if gain_ms > expected_gap_ms else 0.0

    def finish(self, batch_id: int) -> list[str]:
        """End the running wave; returns its request ids. The scheduler is idle again."""
        if self._running is None or self._running.batch_id != batch_id:
            running = None if self._running is None else self._running.batch_id
            raise ValueError(f"batch {batch_id} is not running (running: {running})")
        ids = self._running.request_ids
        self._running = None
        self._aborted.clear()
        self._idle_since = self._clock()
        self._finished_since_arrival = True
        return list(ids)

    def set_config(
        self,
        *,
        max_num_seqs: int | None = None,
        max_wait_ms: float | None = None,
        stable_window_ms: float | None = None,
    ) -> None:
        """Change the batching knobs; they apply to the next wave (including one being held). A
        ``stable_window_ms`` given fixes the stable window (None leaves it as it is)."""
        if max_num_seqs is not None:
            _check_int("max_num_seqs", max_num_seqs)
        if max_wait_ms is not None:
            _check_ms("max_wait_ms", max_wait_ms)
        if stable_window_ms is not None:
            _check_ms("stable_window_ms", stable_window_ms)
        if max_num_seqs is not None:
            self._ask_max_num_seqs(max_num_seqs)
        if max_wait_ms is not None:
            self._max_wait_ms = float(max_wait_ms)
        if stable_window_ms is not None:
            self._stable_window_ms = float(stable_window_ms)

    @property
    def max_wait_ms(self) -> float:
        return self._max_wait_ms

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return 0 if self._running is None else len(self._running)

    def stats(self) -> dict[str, Any]:
        """Counters for metrics; ``batch_size_histogram`` maps wave size to how many waves had it."""
        stats = {
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "waves": self._next_batch_id - 1,
            "requests_scheduled": self._requests_scheduled,
            "batch_size_histogram": dict(sorted(self._histogram.items())),
        }
        if self._slo_shed:
            stats["slo_shed"] = self._shed
        if self._cost_model is not None:
            stats["explored_waves"] = self._explored
        return stats

    def _is_running(self, request_id: str) -> bool:
        return self._running is not None and request_id in self._running.queue_wait_ms

    def _stable_window(self) -> float:
        """The quiet time (ms) after the newest arrival that ends a hold (see the module docstring)."""
        if self._stable_window_ms is not None:
            return self._stable_window_ms
        floor = min(self._max_wait_ms / 4.0, 5.0)
        limit_s = self._max_wait_ms / 1000.0
        in_burst = [gap for gap in self._gaps if gap <= limit_s]
        if not in_burst:
            return floor
        return min(max(floor, _GAP_MARGIN * max(in_burst) * 1000.0), self._max_wait_ms)

    @property
    def stable_window_ms(self) -> float:
        """The stable window a hold would use now (fixed, or adapted to recent arrivals)."""
        return self._stable_window()

    def _rank(self, pending: _Pending) -> float:
        return aged_rank(pending.priority, pending.arrival, self._aging_s)

    def _head(self) -> _Pending:
        if len(self._priorities) == 1:
            return next(iter(self._waiting.values()))
        return min(self._waiting.values(), key=self._rank)  # the first of equal ranks: arrival order

    def _in_order(self, pendings: dict[str, _Pending]) -> Any:
        return pendings.values() if len(self._priorities) == 1 else sorted(pendings.values(), key=self._rank)

    def _select(self, head: _Pending, limit: int) -> tuple[list[_Pending], bool]:
        """The wave ``head`` would lead (at most ``limit``), and whether it is closed to later
        arrivals (fifo only)."""
        members: list[_Pending] = []
        if self._policy == "oldest_key":
            for pending in self._in_order(self._by_key[head.key]):
                members.append(pending)
                if len(members) == limit:
                    break
            return members, False
        for pending in self._in_order(self._waiting):
            if pending.key != head.key:
                return members, True
            members.append(pending)
            if len(members) == limit:
                break
        return members, False

    def _dispatch(self, key: Hashable, members: list[_Pending], now: float) -> Wave:
        for pending in members:
            del self._waiting[pending.request_id]
            self._unindex(pending)
        wave = Wave(
            batch_id=self._next_batch_id,
            key=key,
            request_ids=[p.request_id for p in members],
            payloads=[p.payload for p in members],
            queue_wait_ms={p.request_id: (now - p.arrival) * 1000.0 for p in members},
            admission_wait_ms={p.request_id: (now - max(p.arrival, self._idle_since)) * 1000.0 for p in members},
        )
        self._next_batch_id += 1
        self._requests_scheduled += len(members)
        self._histogram[len(members)] = self._histogram.get(len(members), 0) + 1
        self._running = wave
        self._running_since = now
        return wave

    def _unindex(self, pending: _Pending) -> None:
        left = self._priorities[pending.priority] - 1
        if left:
            self._priorities[pending.priority] = left
        else:
            del self._priorities[pending.priority]
        same_key = self._by_key[pending.key]
        del same_key[pending.request_id]
        if not same_key:
            del self._by_key[pending.key]


def _check_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"expected int >= 1, got {value!r}", path=field)


def _check_ms(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(f"expected a finite number of ms >= 0, got {value!r}", path=field)
