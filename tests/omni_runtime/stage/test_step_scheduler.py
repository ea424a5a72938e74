"""The step scheduler's policy (who joins, who leaves, who steps, preemption), on a fake clock (ms)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.exceptions import ConfigError, DuplicateRequestError, QueueFullError
from omni_runtime.stage.step_scheduler import ProgressThrottle, StepPlan, StepScheduler

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.ms = 0.0

    def __call__(self) -> float:
        return self.ms / 1000.0

    def advance(self, ms: float) -> None:
        self.ms += ms


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(clock: FakeClock, max_num_seqs: int = 4, **kw) -> StepScheduler:
    return StepScheduler(max_num_seqs, clock=clock, **kw)


def step(s: StepScheduler, finished: tuple[str, ...] = (), clock: FakeClock | None = None) -> StepPlan:
    """Plan a step, let it take 10 ms, and report ``finished`` as done."""
    plan = s.schedule()
    assert isinstance(plan, StepPlan), plan
    if clock is not None:
        clock.advance(10)
    s.finish_step(plan.step_id, plan.run, finished)
    return plan


# ---------------------------------------------------------------- joining and leaving


def test_requests_join_a_running_batch_at_the_next_step(clock: FakeClock) -> None:
    s = make(clock)
    s.add("a", "k", payload="A")
    first = step(s)
    assert first.join == ["a"] and first.run == ["a"] and first.payloads == {"a": "A"}
    s.add("b", "k", payload="B")  # arrives while a runs: joins at the next boundary, not after a
    second = step(s)
    assert second.join == ["b"] and second.run == ["a", "b"]
    third = step(s, finished=("a",))
    assert third.join == [] and third.run == ["a", "b"]
    assert step(s).run == ["b"]  # a left after its last step


def test_slots_are_capped_and_a_finished_request_frees_its_slot(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=2)
    for rid in "abc":
        s.add(rid, "k")
    plan = step(s, finished=("a",))
    assert plan.run == ["a", "b"] and s.num_waiting == 1
    plan = step(s)
    assert plan.join == ["c"] and plan.run == ["b", "c"]


def test_one_key_steps_at_a_time_the_oldest_requests_first(clock: FakeClock) -> None:
    s = make(clock)
    s.add("a1", "64")
    s.add("b1", "48")
    s.add("a2", "64")
    plans = [step(s) for _ in range(2)]
    assert plans[0].join == ["a1", "b1", "a2"]  # everyone admitted (encoded) at once
    assert [p.run for p in plans] == [["a1", "a2"], ["a1", "a2"]]  # a1 is the oldest: its key steps
    plans.append(step(s, finished=("a1",)))
    plans += [step(s) for _ in range(2)]
    # Once a1 left, b1 is the oldest: its key steps until it leaves, then a2's again.
    assert [p.key for p in plans] == ["64", "64", "64", "48", "48"]
    step(s, finished=("b1",))
    assert step(s).run == ["a2"]
    assert s.stats()["batch_size_histogram"] == {1: 4, 2: 3}


def test_nothing_to_do_is_none_and_one_step_is_in_flight_at_a_time(clock: FakeClock) -> None:
    s = make(clock)
    assert s.schedule() is None
    s.add("a", "k")
    plan = s.schedule()
    assert isinstance(plan, StepPlan)
    s.add("b", "k")
    assert s.schedule() is None  # the runner is busy with plan
    with pytest.raises(ValueError, match="not in flight"):
        s.finish_step(plan.step_id + 1, [], [])
    s.finish_step(plan.step_id, plan.run, ["a"])
    assert step(s, finished=("b",)).run == ["b"]
    assert s.schedule() is None and s.num_running == 0


def test_metrics_of_a_finished_request(clock: FakeClock) -> None:
    s = make(clock)
    s.add("a", "k")
    clock.advance(5)
    plan = s.schedule()
    assert plan.queue_wait_ms == pytest.approx({"a": 5.0})
    clock.advance(10)
    assert s.finish_step(plan.step_id, ["a"], []) == {}  # still running: no metrics yet
    s.add("b", "k")
    plan = s.schedule()
    clock.advance(10)
    done = s.finish_step(plan.step_id, ["a", "b"], ["a"])
    assert done["a"] == pytest.approx(
        {
            "queue_wait_ms": 5.0,
            "time_to_first_step_ms": 15.0,
            "execution_ms": 20.0,
            "batch_id": 1,
            "batch_size": 2,
            "steps_run": 2,
            "preemptions": 0,
        }
    )


def test_a_failed_admission_leaves_with_no_step(clock: FakeClock) -> None:
    s = make(clock)
    s.add("bad", "k")
    plan = s.schedule()
    done = s.finish_step(plan.step_id, [], ["bad"])
    assert done["bad"]["steps_run"] == 0 and done["bad"]["time_to_first_step_ms"] is None
    assert s.num_running == 0


# ---------------------------------------------------------------- abort


def test_abort_of_a_waiting_request_is_immediate(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1)
    s.add("a", "k")
    s.add("b", "k")
    assert s.abort("b") == "waiting" and s.num_waiting == 1
    assert s.abort("nope") is None
    plan = step(s)
    assert plan.drop == []  # b never had state


def test_abort_of_a_running_request_frees_its_slot_at_the_next_step(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=2)
    for rid in "abc":
        s.add(rid, "k")
    plan = s.schedule()
    assert s.abort("a") == "running" and s.is_aborted("a")
    # The step in flight finishes; a finished during it, but its caller was already answered.
    assert s.finish_step(plan.step_id, plan.run, ["a"]) == {}
    s.add("d", "k")
    assert s.abort("b") == "running"
    plan = step(s)
    assert plan.drop == ["b"] and plan.join == ["c", "d"] and plan.run == ["c", "d"]
    assert not s.is_aborted("b")


def test_abort_of_a_preempted_request_drops_its_state(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1)
    s.add("low", "k")
    step(s)
    s.add("high", "k", priority=5)
    plan = step(s)
    assert plan.preempt == ["low"]
    assert s.abort("low") == "waiting"
    assert step(s).drop == ["low"]


# ---------------------------------------------------------------- priority and preemption


def test_higher_priority_joins_first(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1)
    s.add("a", "k")
    s.add("b", "k", priority=1)
    s.add("c", "k", priority=1)
    assert step(s, finished=("b",)).run == ["b"]
    assert step(s, finished=("c",)).run == ["c"]
    assert step(s).run == ["a"]


def test_preemption_takes_the_slot_and_the_preempted_request_resumes(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=2)
    s.add("a", "k")
    s.add("b", "k")
    step(s)
    s.add("urgent", "k", priority=10)
    plan = step(s)
    # Of equal priorities the one admitted last gives way; it keeps its state.
    assert plan.preempt == ["b"] and plan.join == ["urgent"] and plan.run == ["a", "urgent"]
    assert s.stats()["num_preempted"] == 1
    s.add("later", "k")  # arrived after b: b resumes first
    plan = step(s, finished=("a",))
    assert plan.resume == [] and plan.preempt == []
    plan = step(s, finished=("urgent",))
    assert plan.resume == ["b"] and plan.join == [] and plan.run == ["urgent", "b"]
    plan = step(s, finished=("b",))
    assert plan.join == ["later"] and s.num_waiting == 0


def test_no_preemption_among_equal_priorities(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1)
    s.add("a", "k")
    step(s)
    s.add("b", "k")
    plan = step(s)
    assert plan.preempt == [] and plan.run == ["a"]


def test_the_key_of_the_highest_priority_steps_first(clock: FakeClock) -> None:
    s = make(clock)
    s.add("small", "48")
    s.add("big", "64", priority=3)
    assert [step(s).key for _ in range(3)] == ["64", "64", "64"]


def test_preemption_counts_in_the_metrics(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1)
    s.add("low", "k")
    step(s)
    s.add("high", "k", priority=1)
    step(s, finished=("high",))
    plan = s.schedule()
    assert plan.resume == ["low"]
    done = s.finish_step(plan.step_id, plan.run, ["low"])
    assert done["low"]["preemptions"] == 1 and done["low"]["steps_run"] == 2


# ---------------------------------------------------------------- configuration and errors


def test_duplicate_ids_and_a_full_queue_are_refused(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1, max_queue_len=1)
    s.add("a", "k")
    with pytest.raises(DuplicateRequestError):
        s.add("a", "k")
    step(s)
    with pytest.raises(DuplicateRequestError):
        s.add("a", "k")  # running
    s.add("b", "k")
    with pytest.raises(QueueFullError):
        s.add("c", "k")


def test_lowering_max_num_seqs_lets_the_running_finish(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=3)
    for rid in "abcd":
        s.add(rid, "k")
    step(s)
    s.set_config(max_num_seqs=1)
    assert step(s, finished=("a",)).run == ["a", "b", "c"]
    assert step(s, finished=("b",)).join == []  # 2 still running: no room under the new cap
    assert step(s, finished=("c",)).run == ["c"]
    assert step(s).join == ["d"]
    s.set_batch_cap(None)
    with pytest.raises(ConfigError):
        s.set_config(max_num_seqs=0)


# ---------------------------------------------------------------- the progress throttle


def test_progress_events_stay_within_the_budget() -> None:
    throttle = ProgressThrottle(budget=0.01, amplification=3.0)
    assert not throttle.allow()  # no step yet: nothing to spend
    sent = 0
    for _ in range(1000):
        throttle.add_step(0.020)  # 20 ms steps
        while throttle.allow():
            throttle.spend(0.0001)  # 0.1 ms per event, 0.3 ms counted
            sent += 1
    # 1 % of 20 s is 200 ms: at 0.3 ms each, about 667 events (one more may go on credit).
    assert 600 <= sent <= 668
    assert throttle.stats()["progress_events"] == sent


def test_the_throttle_does_not_bank_credit_across_idle_steps() -> None:
    throttle = ProgressThrottle(budget=0.01, amplification=1.0, burst_steps=2.0)
    for _ in range(1000):
        throttle.add_step(0.010)  # no events for a long time
    burst = 0
    while throttle.allow():
        throttle.spend(0.00005)
        burst += 1
    assert burst <= 5  # at most two steps' worth: 0.2 ms of 0.05 ms events


# ---------------------------------------------------------------- random sequences

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.tuples(st.sampled_from(["x", "y", "z"]), st.integers(0, 2))),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(0, 7)),
        st.tuples(st.just("cap"), st.integers(1, 4)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, cap=st.integers(1, 4))
def test_random_sequences_keep_the_invariants(ops: list, cap: int) -> None:
    clock = FakeClock()
    s = StepScheduler(cap, clock=clock)
    added: list[str] = []
    priority: dict[str, int] = {}
    key_of: dict[str, str] = {}
    alive: set[str] = set()  # added, not aborted, not finished
    leaving: set[str] = set()  # aborted while running: known until the next plan
    with_state: set[str] = set()
    done: set[str] = set()
    for op, arg in ops:
        if op == "add":
            rid = f"r{len(added)}"
            s.add(rid, arg[0], priority=arg[1])
            added.append(rid)
            priority[rid], key_of[rid] = arg[1], arg[0]
            alive.add(rid)
        elif op == "abort" and added:
            rid = added[arg % len(added)]
            result = s.abort(rid)
            assert (result is not None) == (rid in alive or rid in leaving)
            if result == "running":
                leaving.add(rid)
            alive.discard(rid)
        elif op == "cap":
            cap = arg
            s.set_config(max_num_seqs=arg)
        elif op == "step":
            before = set(s.running_ids())
            plan = s.schedule()
            leaving.clear()
            if plan is None:
                assert not alive, "live requests but no plan"
                continue
            running = s.running_ids()
            # Slots: never more than the cap, unless the cap was lowered under the running ones.
            assert len(running) <= max(cap, len(before))
            assert set(plan.run) <= set(running) and len({key_of[r] for r in plan.run}) <= 1
            if running:  # the oldest running request of the highest priority steps, with its key
                oldest = min(running, key=lambda r: (-priority[r], int(r[1:])))
                assert oldest in plan.run and plan.run == [r for r in running if key_of[r] == key_of[oldest]]
            assert not set(plan.join) & with_state and set(plan.resume) <= with_state
            assert set(plan.drop) <= with_state and not set(plan.drop) & set(running)
            assert set(plan.preempt).isdisjoint(running)
            # No waiting request outranks a running one after preemption.
            waiting = alive - set(running)
            if waiting and running:
                assert max(priority[r] for r in waiting) <= min(priority[r] for r in running)
            with_state |= set(plan.join)
            with_state -= set(plan.drop)
            finished = [r for i, r in enumerate(plan.run) if (arg >> (i % 3)) & 1]
            metrics = s.finish_step(plan.step_id, plan.run, finished)
            assert set(metrics) == {r for r in finished if r in alive}
            for rid in finished:
                assert rid not in done
                done.add(rid)
                alive.discard(rid)
                with_state.discard(rid)
    assert s.num_running + s.num_waiting <= len(alive) + len(with_state)
