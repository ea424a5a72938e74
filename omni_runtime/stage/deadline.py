"""Serving to deadlines in step execution (``engine_args.batch_policy: deadline``): which request
leads the next step, and which to refuse at the door. Pure: the clock and the cost model are
passed in; :class:`~omni_runtime.stage.step_scheduler.StepScheduler` calls it.

A request's *due time* is its arrival plus its latency target (the tighter of the request's
``slo_ms`` and the stage's). A request without one is due ``priority_aging_s`` after it arrived:
it takes its place among the others by that date, so it is neither served first nor last.

Its *slack* is its due time less now less its predicted remaining time: the steps it has left
times what one step of its key costs alone (the learned cost model's ``t(1)``: the fastest it
could go, so that a request that can still make it is never taken for one that cannot). A key the
model does not know yet costs nothing: no request is judged without evidence.

The order of the next step, best first:

1. *Overdue*: requests past their due time by another ``priority_aging_s``, by arrival. Every
   request has a due time, so every request becomes overdue in time, and among the overdue the
   oldest goes first: nothing waits forever, however many urgent requests keep arriving.
2. *Feasible*: slack of zero or more (and every request without a target), by priority, then least
   slack first. A step boundary is a preemption point, so a request that would otherwise miss takes
   the next step from one with time to spare, across keys (an image and a video in one stage).
3. *Late*: requests that will miss whatever is done (negative slack), by priority, then due time.
   Serving them before a request that can still make it would make two misses out of one, which
   is how first-come-first-served loses its attainment under overload. They still finish: they
   wait only while feasible ones are served, and become overdue in time.

Shedding (``slo_shed``), by :func:`admission`: the queue in the order above, with and without a
new request, each request's finish predicted from the work before it (remaining steps at its key's
per-request cost in a batch of the best size). A new request that would finish past its target,
or that would make an admitted request miss a target it would otherwise meet, is refused at once
(429, with the work before it as its ``Retry-After``) rather than served late or at another's
expense, so that it can go to another replica or come back. An admitted request is never dropped.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from omni_runtime.stage.cost_model import CostModel

#: Where a request stands (the first element of its rank).
OVERDUE, FEASIBLE, LATE = 0, 1, 2


@dataclass(slots=True)
class Deadline:
    """What the deadline policy knows of one live request."""

    key: Hashable
    #: ``time.monotonic()``-style seconds.
    arrival: float
    #: Arrival plus the request's latency target; None without one.
    due: float | None
    #: Denoising steps it runs in all (None: unknown, counted as none left).
    total_steps: int | None
    steps_taken: int = 0
    priority: int = 0
    #: Arrival order: the last tie-break.
    seq: int = 0

    def due_at(self, aging_s: float) -> float:
        """Its due time, or, without a target, ``aging_s`` after its arrival."""
        return self.arrival + aging_s if self.due is None else self.due

    def steps_left(self) -> int:
        return 0 if self.total_steps is None else max(0, self.total_steps - self.steps_taken)


def remaining_ms(entry: Deadline, model: CostModel | None) -> float:
    """Its remaining steps at its key's cost of one step alone; 0 for a key the model does not know."""
    step = None if model is None else model.estimate_ms(entry.key, 1)
    return 0.0 if step is None else entry.steps_left() * step


def rank(entry: Deadline, now: float, aging_s: float, model: CostModel | None) -> tuple[float, ...]:
    """The order of the next step (lower first): see the module docstring."""
    due = entry.due_at(aging_s)
    if now >= due + aging_s:
        return (OVERDUE, entry.arrival, entry.seq)
    slack = due - now - remaining_ms(entry, model) / 1000.0
    if slack >= 0 or entry.due is None:
        return (FEASIBLE, -entry.priority, slack, entry.seq)
    return (LATE, -entry.priority, due, entry.seq)


@dataclass(frozen=True, slots=True)
class Admission:
    """What taking a new request would do, by the cost model."""

    #: When the new request is expected to finish (ms from now).
    finish_ms: float
    #: The work that ranks before it (ms): when a retry could start.
    ahead_ms: float
    #: Admitted requests expected to meet their targets without it that would miss them with it.
    displaced: int


def admission(
    new: Deadline, live: Iterable[Deadline], now: float, aging_s: float, model: CostModel | None, max_n: int
) -> Admission:
    """The stage's queue in the order the policy would serve it, with and without ``new``: each
    request's expected finish is the work of those before it (at its key's per-request cost in a
    batch of the best size, at most ``max_n``) plus its own. Keys the model does not know count as
    free, so nothing is refused without evidence."""
    if model is None:
        return Admission(0.0, 0.0, 0)

    def work(entry: Deadline) -> float:
        per_item = model.per_item_ms(entry.key, max_n)
        return 0.0 if per_item is None else entry.steps_left() * per_item

    own = rank(new, now, aging_s, model)
    queue = sorted(((rank(d, now, aging_s, model), d) for d in live), key=lambda item: item[0])
    # Before ``new``: the work ahead of it. After it: each admitted request's finish without and
    # with it, which differ by its work in a batch (its own finish counts it alone, the slowest).
    ahead = [entry for place, entry in queue if place < own]
    ahead_ms = sum(work(entry) for entry in ahead)
    done_without, done_with = ahead_ms, ahead_ms + work(new)
    displaced = 0
    for entry in (entry for place, entry in queue if place > own):
        done_without += work(entry)
        done_with += work(entry)
        if entry.due is not None and done_without <= (entry.due - now) * 1000.0 < done_with:
            displaced += 1
    return Admission(ahead_ms + remaining_ms(new, model), ahead_ms, displaced)
