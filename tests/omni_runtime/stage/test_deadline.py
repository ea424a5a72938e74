"""The deadline policy of step execution (``batch_policy: deadline``): order by slack, preempt at
step boundaries, late requests behind feasible ones, no starvation, shedding only with evidence.
Pure: a fake clock (ms) and a cost model fed with made-up step times."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.exceptions import QueueFullError
from omni_runtime.stage import deadline
from omni_runtime.stage.cost_model import CostModel
from omni_runtime.stage.step_scheduler import StepScheduler
from tests.conftest import FakeClock

pytestmark = pytest.mark.unit

#: One step of each key alone, in ms: an "image" key and a "video" key 4x its cost.
STEP_MS = {"img": 10.0, "vid": 40.0}


def trained(step_ms: dict[str, float] = STEP_MS, per_item: float = 1.0) -> CostModel:
    """A cost model that knows each key: a batch of n costs ``step * (1 + per_item * (n - 1))``."""
    model = CostModel()
    for key, ms in step_ms.items():
        for n in (1, 2, 1, 2):
            model.observe(key, n, ms * (1 + per_item * (n - 1)))
    return model


def make(clock: FakeClock, model: CostModel | None = None, max_num_seqs: int = 1, **kw) -> StepScheduler:
    return StepScheduler(
        max_num_seqs, clock=clock, cost_model=trained() if model is None else model, policy="deadline", **kw
    )


def run_step(s: StepScheduler, clock: FakeClock, steps_left: dict[str, int], model: CostModel) -> list[str]:
    """Plan a step, advance the clock by what the model says it costs, report those done."""
    plan = s.schedule()
    assert plan is not None and plan.key is not None
    cost = model.estimate_ms(plan.key, len(plan.run))
    assert cost is not None
    clock.advance(cost)
    done = []
    for rid in plan.run:
        steps_left[rid] -= 1
        if steps_left[rid] == 0:
            done.append(rid)
    s.finish_step(plan.step_id, plan.run, done)
    return plan.run


# ---------------------------------------------------------------- the rank, alone


def test_slack_orders_feasible_requests_and_late_ones_go_after() -> None:
    model = trained()
    # Due in 100 ms with 5 image steps (50 ms) left: slack 50 ms. Due in 80 ms with 2 left: 60 ms.
    tight = deadline.Deadline("img", 0.0, 0.100, 5)
    loose = deadline.Deadline("img", 0.0, 0.080, 2, seq=1)
    # Due in 100 ms with 5 video steps (200 ms) left: it cannot make it.
    late = deadline.Deadline("vid", 0.0, 0.100, 5, seq=2)
    ranks = {
        name: deadline.rank(d, 0.0, 10.0, model) for name, d in [("tight", tight), ("loose", loose), ("late", late)]
    }
    assert sorted(ranks, key=ranks.__getitem__) == ["tight", "loose", "late"]
    assert ranks["late"][0] == deadline.LATE


def test_an_unknown_key_costs_nothing_and_a_request_without_a_target_is_due_after_the_aging_time() -> None:
    model = trained()
    unknown = deadline.Deadline("new-key", 0.0, 0.050, 1000)
    assert deadline.remaining_ms(unknown, model) == 0.0
    assert deadline.rank(unknown, 0.0, 10.0, model)[0] == deadline.FEASIBLE
    no_target = deadline.Deadline("img", 0.0, None, 3)
    assert no_target.due_at(10.0) == 10.0
    assert deadline.rank(no_target, 19.9, 10.0, model)[0] == deadline.FEASIBLE
    assert deadline.rank(no_target, 20.0, 10.0, model)[0] == deadline.OVERDUE


# ---------------------------------------------------------------- the scheduler


def test_an_urgent_arrival_preempts_a_running_request_at_the_next_step_boundary() -> None:
    clock, model = FakeClock(), trained()
    s = make(clock, model)
    left = {"video": 10, "image": 3}
    s.add("video", "vid", slo_ms=10_000, steps=10)
    assert run_step(s, clock, left, model) == ["video"]
    # An image due in 60 ms (3 steps, 30 ms): it would miss behind the video's 9 steps (360 ms).
    s.add("image", "img", slo_ms=60, steps=3)
    plan = s.schedule()
    assert plan is not None and plan.run == ["image"] and plan.paused == ["video"]
    s.finish_step(plan.step_id, plan.run, [])
    left["image"] -= 1
    assert [run_step(s, clock, left, model) for _ in range(2)] == [["image"], ["image"]]
    assert run_step(s, clock, left, model) == ["video"]  # resumed, its state kept


def test_a_request_that_will_miss_waits_behind_one_that_can_still_make_it() -> None:
    clock, model = FakeClock(), trained()
    s = make(clock, model)
    s.add("hopeless", "vid", slo_ms=50, steps=5)  # 200 ms of work, due in 50 ms
    s.add("fine", "img", slo_ms=100, steps=5)  # 50 ms of work, due in 100 ms
    left = {"hopeless": 5, "fine": 5}
    order = [run_step(s, clock, left, model)[0] for _ in range(10)]
    assert order == ["fine"] * 5 + ["hopeless"] * 5


def test_fcfs_would_miss_both_where_the_deadline_policy_meets_one() -> None:
    """The same two requests under the priority policy (first come, first served) and the deadline
    policy: a long video first, then an image with a tight target."""
    met = {}
    for policy in ("priority", "deadline"):
        clock, model = FakeClock(), trained()
        s = StepScheduler(1, clock=clock, cost_model=model, policy=policy)
        s.add("video", "vid", slo_ms=300, steps=6)  # 240 ms of work
        s.add("image", "img", slo_ms=60, steps=4)  # 40 ms of work
        left, finished_at = {"video": 6, "image": 4}, {}
        while left and any(left.values()):
            for rid in run_step(s, clock, left, model):
                if left[rid] == 0:
                    finished_at[rid] = clock.ms
        met[policy] = sum(finished_at[r] <= slo for r, slo in (("video", 300), ("image", 60)))
    assert met == {"priority": 1, "deadline": 2}


def test_a_request_without_a_target_is_not_starved_by_a_stream_of_urgent_ones() -> None:
    clock, model = FakeClock(), trained()
    aging_s = 1.0
    s = make(clock, model, priority_aging_s=aging_s)
    s.add("patient", "vid", steps=3)
    left = {"patient": 3}
    finished = None
    n = 0
    # A new urgent image arrives every step, each feasible: they alone could fill the stage forever.
    while finished is None and clock.ms < 10_000:
        rid = f"urgent{n}"
        n += 1
        s.add(rid, "img", slo_ms=100, steps=1)
        left[rid] = 1
        ran = run_step(s, clock, left, model)
        if "patient" in ran and left["patient"] == 0:
            finished = clock.ms
    assert finished is not None
    assert finished <= 2 * aging_s * 1000 + 3 * STEP_MS["vid"] + STEP_MS["img"]


def test_shedding_refuses_with_evidence_only_and_never_at_an_admitted_requests_expense() -> None:
    clock = FakeClock()
    s = make(clock, slo_shed=True)
    with pytest.raises(QueueFullError, match=r"expected to finish in 200 ms, past the request's slo_ms 100"):
        s.add("too-long", "vid", slo_ms=100, steps=5)  # 5 x 40 ms alone
    s.add("unknown-key", "other", slo_ms=1, steps=1000)  # no evidence: admitted
    s.add("video", "vid", slo_ms=1000, steps=10)  # 400 ms, due at 1000
    s.add("image", "img", slo_ms=250, steps=20)  # 200 ms, less slack: goes first, both still fit
    # Less slack than the video too: it would finish in time (200 + 440 ms) but push the video
    # (200 + 440 + 400 ms) past its 1000.
    with pytest.raises(QueueFullError, match=r"would make 1 admitted request\(s\) miss") as caught:
        s.add("pushy", "vid", slo_ms=700, steps=11)
    assert caught.value.retry_after_s == pytest.approx(0.2)  # the image's work, ahead of it
    s.add("patient", "vid", slo_ms=1100, steps=1)  # fits after both: admitted
    assert s.stats()["slo_shed"] == 2
    assert s.num_waiting == 4


@dataclass
class _Arrival:
    at_ms: float
    key: str
    steps: int
    slo_ms: float | None


@dataclass
class _Run:
    finished: dict[str, float] = field(default_factory=dict)
    shed: dict[str, float] = field(default_factory=dict)


def simulate(arrivals: list[_Arrival], *, policy: str = "deadline", shed: bool = False, aging_s: float = 2.0) -> _Run:
    """Replay arrivals on a fake clock; each step takes what the model says. Returns finish times."""
    clock, model = FakeClock(), trained()
    s = StepScheduler(2, clock=clock, cost_model=model, policy=policy, slo_shed=shed, priority_aging_s=aging_s)
    pending = sorted(enumerate(arrivals), key=lambda item: item[1].at_ms)
    left: dict[str, int] = {}
    out = _Run()
    while pending or left:
        while pending and pending[0][1].at_ms <= clock.ms:
            i, a = pending.pop(0)
            rid = f"r{i}"
            try:
                s.add(rid, a.key, slo_ms=a.slo_ms, steps=a.steps)
                left[rid] = a.steps
            except QueueFullError:
                out.shed[rid] = clock.ms
        if not left:
            if pending:
                clock.ms = pending[0][1].at_ms
            continue
        for rid in run_step(s, clock, left, model):
            if left[rid] == 0:
                del left[rid]
                out.finished[rid] = clock.ms
    return out


ARRIVALS = st.lists(
    st.builds(
        _Arrival,
        at_ms=st.floats(0, 2000),
        key=st.sampled_from(sorted(STEP_MS)),
        steps=st.integers(1, 8),
        slo_ms=st.none() | st.floats(5, 3000),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ARRIVALS)
def test_every_request_finishes_within_its_aging_bound(arrivals: list[_Arrival]) -> None:
    aging_s = 2.0
    run = simulate(arrivals, aging_s=aging_s)
    assert len(run.finished) == len(arrivals)
    # Overdue (due + aging) at the latest at its due time plus the aging time; after that only
    # older overdue requests go before it: at most all the work there is.
    work = sum(a.steps * STEP_MS[a.key] for a in arrivals)
    for i, a in enumerate(arrivals):
        due = a.at_ms + (a.slo_ms if a.slo_ms is not None else aging_s * 1000)
        assert run.finished[f"r{i}"] <= due + aging_s * 1000 + work + 1e-6


@settings(max_examples=60, deadline=None)
@given(ARRIVALS)
def test_a_request_that_fits_alone_is_never_shed_on_an_idle_stage_and_nothing_is_shed_without_a_target(
    arrivals: list[_Arrival],
) -> None:
    run = simulate(arrivals, shed=True)
    assert len(run.finished) + len(run.shed) == len(arrivals)
    for rid in run.shed:
        a = arrivals[int(rid[1:])]
        assert a.slo_ms is not None
    first = min(range(len(arrivals)), key=lambda i: (arrivals[i].at_ms, i))
    a = arrivals[first]
    if a.slo_ms is not None and a.steps * STEP_MS[a.key] <= a.slo_ms:
        assert f"r{first}" not in run.shed


@settings(max_examples=60, deadline=None)
@given(ARRIVALS)
def test_the_deadline_policy_meets_at_least_as_many_targets_as_fcfs_on_one_key(arrivals: list[_Arrival]) -> None:
    """One key, one request per step (a batch of two costs two steps): on the same arrivals, serving
    least slack first and the hopeless last meets at least as many targets as arrival order (held
    on 1,500 generated sequences; not a theorem for every cost model)."""
    one_key = [_Arrival(a.at_ms, "img", a.steps, a.slo_ms) for a in arrivals]
    runs = {p: simulate(one_key, policy=p) for p in ("priority", "deadline")}
    met = {
        p: sum(
            1
            for i, a in enumerate(one_key)
            if a.slo_ms is not None and r.finished[f"r{i}"] - a.at_ms <= a.slo_ms + 1e-6
        )
        for p, r in runs.items()
    }
    assert met["deadline"] >= met["priority"]
