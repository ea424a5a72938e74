"""The step scheduler's policy (who joins, who leaves, who steps, preemption), on a fake clock (ms)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.exceptions import ConfigError, DuplicateRequestError, QueueFullError
from omni_runtime.stage.step_scheduler import ProgressThrottle, StepPlan, StepScheduler
from tests.conftest import FakeClock

pytestmark = pytest.mark.unit


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


def test_the_batch_is_capped_and_a_finished_request_makes_room(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=2)
    for rid in "abc":
        s.add(rid, "k")
    plan = step(s, finished=("a",))
    assert plan.run == ["a", "b"] and s.num_waiting == 1
    plan = step(s)
    assert plan.join == ["c"] and plan.run == ["b", "c"]


def test_a_requests_own_bound_caps_its_batch_and_the_one_past_it_waits(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=4)
    for rid in "abc":
        s.add(rid, "k", max_batch=2)  # a video's share of max_video_pixels: two fit
    plan = step(s, finished=("a",))
    assert plan.run == ["a", "b"] and s.num_waiting == 1
    assert step(s).run == ["b", "c"]
    s.add("d", "k", max_batch=1)  # too large to step beside anyone: waits, then steps alone
    assert step(s, finished=("b", "c")).run == ["b", "c"]
    assert step(s).run == ["d"] and s.stats()["batch_size_histogram"] == {1: 1, 2: 3}


def test_the_oldest_request_picks_the_key_and_its_batch_fills_from_that_key(clock: FakeClock) -> None:
    s = make(clock)
    s.add("a1", "64")
    s.add("b1", "48")
    s.add("a2", "64")
    plan = step(s)
    assert plan.key == "64" and plan.run == plan.join == ["a1", "a2"]  # b1 waits, without state
    assert s.num_waiting == 1 and s.num_running == 2
    plan = step(s, finished=("a1",))
    # a1 left: b1 is now the oldest, so its key steps; a2 pauses with its state.
    plan = step(s)
    assert plan.key == "48" and plan.run == ["b1"] and plan.paused == ["a2"]
    plan = step(s, finished=("b1",))
    plan = step(s)
    assert plan.key == "64" and plan.run == plan.resume == ["a2"] and plan.join == []
    assert s.stats()["batch_size_histogram"] == {1: 3, 2: 2}


def test_under_load_every_step_is_a_full_batch_of_one_key(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=3)
    for i in range(6):
        s.add(f"a{i}", "64")
        s.add(f"b{i}", "48")
    assert step(s, finished=("a0", "a1", "a2")).run == ["a0", "a1", "a2"]
    assert step(s, finished=("b0", "b1", "b2")).run == ["b0", "b1", "b2"]
    assert step(s).run == ["a3", "a4", "a5"]


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
            "pauses": 0,
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


def test_abort_of_a_running_request_frees_its_place_at_the_next_step(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=2)
    for rid in "abc":
        s.add(rid, "k")
    plan = s.schedule()
    assert s.abort("a") == "running" and s.is_aborted("a")
    # The step in flight finishes; a finished during it, but its caller was already answered.
    assert s.finish_step(plan.step_id, plan.run, ["a"]) == {}
    s.add("d", "k")
    assert s.abort("b") == "running" and s.abort("b") == "running"
    plan = step(s)
    assert plan.drop == ["b"] and plan.join == ["c", "d"] and plan.run == ["c", "d"]
    assert not s.is_aborted("b") and s.abort("b") is None


def test_abort_of_a_paused_request_drops_its_state(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1)
    s.add("low", "k")
    step(s)
    s.add("high", "k", priority=5)
    plan = step(s)
    assert plan.paused == ["low"]
    assert s.abort("low") == "running"
    assert step(s).drop == ["low"]


# ---------------------------------------------------------------- priority and preemption


def test_higher_priority_goes_first(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1)
    s.add("a", "k")
    s.add("b", "k", priority=1)
    s.add("c", "k", priority=1)
    assert step(s, finished=("b",)).run == ["b"]
    assert step(s, finished=("c",)).run == ["c"]
    assert step(s).run == ["a"]


def test_preemption_takes_the_place_and_the_preempted_request_resumes(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=2)
    s.add("a", "k")
    s.add("b", "k")
    step(s)
    s.add("urgent", "k", priority=10)
    plan = step(s)
    # The lowest-ranked (here the later of equal priorities) gives way; it keeps its state.
    assert plan.paused == ["b"] and plan.join == ["urgent"] and plan.run == ["urgent", "a"]
    assert s.stats()["num_paused"] == 1
    s.add("later", "k")  # arrived after b: b resumes first
    plan = step(s, finished=("urgent",))
    assert plan.resume == [] and plan.paused == []
    plan = step(s, finished=("a",))
    assert plan.resume == ["b"] and plan.join == [] and plan.run == ["a", "b"]
    plan = step(s)
    assert plan.join == ["later"] and plan.run == ["b", "later"] and s.num_waiting == 0


def test_a_waiting_low_priority_request_ages_past_later_high_ones(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1, priority_aging_s=1.0)
    s.add("hog", "k", priority=5)
    s.add("low", "k")
    step(s)
    for i in range(5):  # a stream of priority-1 requests, one every 0.4 s
        clock.advance(400)
        s.add(f"high{i}", "k", priority=1)
    # low ranks 0 (priority 0, arrived at 0 s); high_i ranks 0.4*(i+1) - 1: the two that arrived
    # within 1 s of low go first, every later one after low, however long the stream.
    order = []
    finished: tuple[str, ...] = ("hog",)
    while True:
        plan = s.schedule()
        if plan is None:
            break
        s.finish_step(plan.step_id, plan.run, finished)
        finished = tuple(plan.run)
        order.extend(rid for rid in plan.join)
    assert order == ["high0", "high1", "low", "high2", "high3", "high4"]


def test_no_preemption_among_equal_priorities(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1)
    s.add("a", "k")
    step(s)
    s.add("b", "k")
    plan = step(s)
    assert plan.paused == [] and plan.run == ["a"]


def test_a_higher_priority_of_another_key_leads(clock: FakeClock) -> None:
    s = make(clock)
    s.add("small", "48")
    assert step(s).key == "48"
    s.add("big", "64", priority=3)
    plan = step(s)
    assert plan.key == "64" and plan.paused == ["small"]
    assert step(s, finished=("big",)).key == "64"
    assert step(s).resume == ["small"]


def test_pauses_count_in_the_metrics(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1)
    s.add("low", "k")
    step(s)
    s.add("high", "k", priority=1)
    step(s, finished=("high",))
    plan = s.schedule()
    assert plan.resume == ["low"]
    done = s.finish_step(plan.step_id, plan.run, ["low"])
    assert done["low"]["pauses"] == 1 and done["low"]["steps_run"] == 2


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


def test_lowering_max_num_seqs_pauses_the_requests_beyond_it(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=3)
    for rid in "abcd":
        s.add(rid, "k")
    step(s)
    s.set_config(max_num_seqs=1)
    plan = step(s, finished=("a",))
    assert plan.run == ["a"] and plan.paused == ["b", "c"]
    assert step(s, finished=("b",)).run == ["b"]
    assert step(s).run == ["c"]
    s.set_batch_cap(None)
    with pytest.raises(ConfigError):
        s.set_config(max_num_seqs=0)


# ---------------------------------------------------------------- the progress throttle


def test_progress_goes_out_in_bursts_at_most_once_per_interval() -> None:
    throttle = ProgressThrottle(budget=0.01, min_interval_s=0.3, amplification=30.0, max_interval_s=60.0)
    assert throttle.due(0.0)  # the first burst goes at once
    throttle.sent(0.0, events=3, cost_s=0.0001)
    assert throttle.interval_s == pytest.approx(0.3)  # 0.1 ms x 30 / 1 % = 0.3 s: the floor
    assert not throttle.due(0.29) and throttle.due(0.3)
    throttle.sent(0.3, events=40, cost_s=0.0199)  # a dearer burst: 10 ms on average
    assert throttle.interval_s == pytest.approx(30.0)
    assert throttle.stats()["progress_events"] == 43 and throttle.stats()["progress_bursts"] == 2


def test_a_dear_burst_still_leaves_progress_at_least_once_a_second() -> None:
    throttle = ProgressThrottle()
    throttle.sent(0.0, events=1, cost_s=0.05)  # 50 ms to send: 150 s by the budget alone
    assert throttle.interval_s == pytest.approx(1.0) and throttle.due(1.0)


def test_a_fixed_interval_replaces_the_measured_one() -> None:
    every_step = ProgressThrottle(fixed_interval_s=0.0)
    every_step.sent(0.0, events=1, cost_s=0.05)  # dear, but the interval is fixed
    assert every_step.interval_s == 0.0 and every_step.claim(0.0) and every_step.claim(0.0)
    slow = ProgressThrottle(fixed_interval_s=5.0)
    assert slow.claim(0.0) and not slow.due(4.9) and slow.due(5.0)


def test_bursts_cost_about_the_budget_of_the_stepping_time() -> None:
    # Each burst disturbs the model for about 30 x its measured send cost; over a long run of 30 ms
    # steps, the estimated disturbance stays near 1 % of the time.
    throttle = ProgressThrottle()
    now = 0.0
    for _ in range(10_000):
        now += 0.030
        throttle.add_step(0.030)
        if throttle.due(now):
            throttle.sent(now, events=4, cost_s=0.0001)
    assert throttle.cost_s * throttle.amplification / throttle.step_s == pytest.approx(0.01, rel=0.15)


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
    alive: list[str] = []  # added, not aborted, not finished: arrival order
    leaving: set[str] = set()  # aborted with state: known until the next plan
    with_state: set[str] = set()
    last_run: list[str] = []

    def rank(rid: str) -> tuple[int, int]:
        return (-priority[rid], int(rid[1:]))

    for op, arg in ops:
        if op == "add":
            rid = f"r{len(added)}"
            s.add(rid, arg[0], priority=arg[1])
            added.append(rid)
            priority[rid], key_of[rid] = arg[1], arg[0]
            alive.append(rid)
        elif op == "abort" and added:
            rid = added[arg % len(added)]
            result = s.abort(rid)
            if rid in alive:
                assert result == ("running" if rid in with_state else "waiting")
                alive.remove(rid)
                if rid in with_state:
                    leaving.add(rid)
            else:
                assert result == ("running" if rid in leaving else None)
        elif op == "cap":
            cap = arg
            s.set_config(max_num_seqs=arg)
        elif op == "step":
            plan = s.schedule()
            if plan is None:
                assert not alive and not leaving
                continue
            assert set(plan.drop) == leaving
            with_state -= leaving
            leaving.clear()
            if alive:
                # The leader's key; the best `cap` requests of it, best first.
                leader = min(alive, key=rank)
                expected = sorted((r for r in alive if key_of[r] == key_of[leader]), key=rank)[:cap]
                assert plan.key == key_of[leader] and plan.run == expected
            else:
                assert plan.run == []
            assert plan.join == [r for r in plan.run if r not in with_state]
            assert plan.resume == [r for r in plan.run if r in with_state and r not in last_run]
            assert plan.paused == [r for r in last_run if r in alive and r not in plan.run]
            with_state |= set(plan.join)
            finished = [r for i, r in enumerate(plan.run) if (arg >> (i % 3)) & 1]
            metrics = s.finish_step(plan.step_id, plan.run, finished)
            assert set(metrics) == {r for r in finished if r in alive}
            for rid in finished:
                alive.remove(rid)
                with_state.discard(rid)
            last_run = plan.run
        assert s.num_running == len(with_state | leaving) and s.num_waiting == len(alive) - len(with_state - leaving)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "abort", "step", "finish"]), st.integers(0, 30), st.integers(0, 3)),
        max_size=120,
    ),
    max_num_seqs=st.integers(1, 4),
)
def test_nothing_of_a_request_stays_after_it_ends(ops: list, max_num_seqs: int) -> None:
    """Requests that finish, fail, are aborted waiting or with state (an abort is also how a
    deadline reaches the stage): once every one has ended, no per-request state is left."""
    clock = FakeClock()
    s = StepScheduler(max_num_seqs, clock=clock)
    added = 0
    plan: StepPlan | None = None

    def end_step(finish_some: int) -> None:
        nonlocal plan
        finished = plan.run[:finish_some]  # done or failed: the runner's call
        s.finish_step(plan.step_id, plan.run, finished)
        plan = None

    for op, n, k in ops:
        clock.advance(1.0)
        if op == "add":
            s.add(f"r{added}", k % 2, priority=k)
            added += 1
        elif op == "abort" and added:
            s.abort(f"r{n % added}")
        elif op == "step" and plan is None:
            plan = s.schedule()
        elif op == "finish" and plan is not None:
            end_step(k)
    # Everyone still live is aborted, then the steps run out.
    for i in range(added):
        s.abort(f"r{i}")
    for _ in range(added + 2):
        if plan is not None:
            end_step(0)
        plan = s.schedule()
    assert plan is None
    assert s._entries == {} and s._by_priority == {} and s._by_key == {} and s._aborted == []
    assert s.num_waiting == 0 and s.num_running == 0 and s.running_ids() == []


# ---------------------------------------------------------------- a learned cap


def test_learned_cap_bounds_the_step_batch(clock: FakeClock) -> None:
    from omni_runtime.stage.cost_model import CostModel

    model = CostModel()
    for n in (1, 2, 3, 4):
        model.observe("flat", n, 50.0 * n)  # a step of n costs n steps of 1
        model.observe("gpu", n, 50.0 + 1.0 * n)  # fixed cost dominates
    s = StepScheduler(4, clock=clock, cost_model=model)
    for i in range(3):
        s.add(f"f{i}", "flat")
    plan = s.schedule()
    assert plan is not None and plan.run == ["f0"]
    s.finish_step(plan.step_id, plan.run, plan.run)
    for i in range(3):
        s.add(f"g{i}", "gpu")
    plans = []
    while (plan := s.schedule()) is not None:
        plans.append(plan.run)
        s.finish_step(plan.step_id, plan.run, plan.run)
    assert plans == [["f1"], ["f2"], ["g0", "g1", "g2"]]
