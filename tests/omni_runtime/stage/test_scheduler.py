"""The request scheduler's policy, driven by a fake clock (times below are in ms)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.exceptions import DuplicateRequestError, QueueFullError
from omni_runtime.stage.scheduler import RequestScheduler, Wave
from tests.conftest import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(clock: FakeClock, max_num_seqs: int = 4, max_wait_ms: float = 0.0, **kw) -> RequestScheduler:
    return RequestScheduler(max_num_seqs, max_wait_ms, clock=clock, **kw)


def run(s: RequestScheduler) -> list[str]:
    """Schedule a wave that must be ready now, finish it, and return its ids."""
    wave = s.schedule()
    assert isinstance(wave, Wave), wave
    assert s.finish(wave.batch_id) == wave.request_ids
    return wave.request_ids


def drain(s: RequestScheduler) -> list[list[str]]:
    waves = []
    while s.num_waiting:
        waves.append(run(s))
    return waves


# ---------------------------------------------------------------- which requests run together


def test_fills_up_to_max_num_seqs_in_arrival_order(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=3)
    for i in range(5):
        s.add(f"r{i}", "k", payload=i)
    wave = s.schedule()
    assert isinstance(wave, Wave)
    assert (wave.batch_id, wave.key, wave.request_ids, wave.payloads) == (
        1,
        "k",
        ["r0", "r1", "r2"],
        [0, 1, 2],
    )
    assert len(wave) == 3
    assert s.finish(1) == ["r0", "r1", "r2"]
    assert drain(s) == [["r3", "r4"]]


def test_separates_incompatible_keys(clock: FakeClock) -> None:
    s = make(clock)
    for rid, key in [("a1", "A"), ("b1", "B"), ("a2", "A"), ("b2", "B")]:
        s.add(rid, key)
    assert drain(s) == [["a1", "a2"], ["b1", "b2"]]


def test_incompatible_head_does_not_block_compatible_requests(clock: FakeClock) -> None:
    s = make(clock)
    for rid, key in [("b1", "B"), ("a1", "A"), ("a2", "A"), ("b2", "B"), ("a3", "A")]:
        s.add(rid, key)
    assert drain(s) == [["b1", "b2"], ["a1", "a2", "a3"]]


def test_oldest_key_goes_first_even_when_another_key_has_more(clock: FakeClock) -> None:
    s = make(clock)
    s.add("b1", "B")
    for i in range(4):
        s.add(f"a{i}", "A")
    assert drain(s) == [["b1"], ["a0", "a1", "a2", "a3"]]


def test_fifo_policy_stops_at_the_first_incompatible_request(clock: FakeClock) -> None:
    order = [("a1", "A"), ("b1", "B"), ("a2", "A"), ("a3", "A"), ("b2", "B")]
    oldest, fifo = make(clock), make(clock, policy="fifo")
    for rid, key in order:
        oldest.add(rid, key)
        fifo.add(rid, key)
    assert drain(oldest) == [["a1", "a2", "a3"], ["b1", "b2"]]
    assert drain(fifo) == [["a1"], ["b1"], ["a2", "a3"], ["b2"]]


def test_fifo_wave_cut_off_by_an_incompatible_request_is_not_held(clock: FakeClock) -> None:
    # Holding could not grow the wave: a later "A" would queue behind "B".
    fifo = make(clock, max_wait_ms=50, policy="fifo")
    oldest = make(clock, max_wait_ms=50)
    for s in (fifo, oldest):
        s.add("a1", "A")
        s.add("b1", "B")
    assert isinstance(fifo.schedule(), Wave)
    assert isinstance(oldest.schedule(), float)


def test_nothing_starves_over_a_long_mixed_sequence(clock: FakeClock) -> None:
    # Overload: three arrivals per wave of at most two, mostly one key. Every wave carries the oldest
    # waiting request, so no request waits more waves than there were requests ahead of it.
    s = make(clock, max_num_seqs=2, max_wait_ms=10)
    ahead: dict[str, int] = {}
    waves_waited: dict[str, int] = {}
    n = 0
    for step in range(1000):
        if step >= 150 and not s.num_waiting:
            break
        for _ in range(3 if step < 150 else 0):
            rid = f"r{n}"
            s.add(rid, "rare" if n % 17 == 0 else ("B" if n % 5 == 0 else "A"))
            ahead[rid], waves_waited[rid] = s.num_waiting - 1, 0
            n += 1
        clock.advance(10)
        wave = s.schedule()
        assert isinstance(wave, Wave)
        for rid in list(waves_waited):
            if rid in wave.request_ids:
                assert waves_waited.pop(rid) <= ahead[rid]
            else:
                waves_waited[rid] += 1
        s.finish(wave.batch_id)
    assert not waves_waited
    assert s.stats()["requests_scheduled"] == n


# ---------------------------------------------------------------- admission wait


def test_zero_wait_dispatches_at_once(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=8, max_wait_ms=0)
    s.add("r1", "k")
    wave = s.schedule()
    assert isinstance(wave, Wave)
    assert wave.admission_wait_ms == {"r1": 0.0}


def test_hold_ends_when_the_wave_is_full(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=3, max_wait_ms=50)
    s.add("r1", "k")
    assert s.schedule() == pytest.approx(0.005)
    s.add("other", "x")  # cannot join: does not fill the wave
    s.add("r2", "k")
    assert isinstance(s.schedule(), float)
    s.add("r3", "k")
    wave = s.schedule()
    assert isinstance(wave, Wave) and wave.request_ids == ["r1", "r2", "r3"]


def test_hold_ends_when_arrivals_stop_for_the_stable_window(clock: FakeClock) -> None:
    s = make(clock, max_wait_ms=50, stable_window_ms=5)
    s.add("r1", "k")
    assert s.schedule() == pytest.approx(0.005)
    clock.advance(2)
    s.add("r2", "k")
    assert s.schedule() == pytest.approx(0.007)  # the window restarts at the newest arrival
    clock.advance(4)
    assert isinstance(s.schedule(), float)
    clock.advance(1)
    wave = s.schedule()
    assert isinstance(wave, Wave) and wave.request_ids == ["r1", "r2"]
    assert wave.admission_wait_ms == pytest.approx({"r1": 7.0, "r2": 5.0})


def test_set_config_fixes_the_stable_window_of_a_hold_in_progress(clock: FakeClock) -> None:
    s = make(clock, max_wait_ms=50)  # adaptive: the floor of 5 ms with no gaps learned
    s.add("r1", "k")
    assert s.schedule() == pytest.approx(0.005)
    s.set_config(stable_window_ms=30)
    assert s.stable_window_ms == 30.0
    assert s.schedule() == pytest.approx(0.030)
    s.set_config(max_num_seqs=4)  # None leaves the window as it is
    assert s.stable_window_ms == 30.0
    with pytest.raises(ValueError, match="stable_window_ms"):
        s.set_config(stable_window_ms=-1.0)
    assert s.stable_window_ms == 30.0


def test_hold_ends_at_the_deadline_while_arrivals_continue(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=100, max_wait_ms=20, stable_window_ms=5)
    s.add("r0", "k")
    for i in range(1, 7):
        clock.advance(3)
        s.add(f"r{i}", "k")
        due = s.schedule()
        assert due == pytest.approx(min(0.020, clock() + 0.005))
    clock.advance(2)  # t = 20 ms
    wave = s.schedule()
    assert isinstance(wave, Wave) and len(wave) == 7
    assert wave.admission_wait_ms["r0"] == pytest.approx(20.0)


@pytest.mark.parametrize(("max_wait_ms", "window_ms"), [(20, 5.0), (8, 2.0), (100, 5.0)])
def test_default_stable_window_is_a_quarter_of_the_wait_capped_at_5ms(
    clock: FakeClock, max_wait_ms: float, window_ms: float
) -> None:
    s = make(clock, max_wait_ms=max_wait_ms)
    s.add("r1", "k")
    assert s.schedule() == pytest.approx(window_ms / 1000)


def test_request_that_waited_during_a_running_wave_dispatches_at_once(clock: FakeClock) -> None:
    # The running wave was r2's batching window: neither the deadline (r2 + 50 ms) nor the stable window
    # (r3 arrived 1 ms ago) holds it once the runner is idle.
    s = make(clock, max_num_seqs=4, max_wait_ms=50)
    s.add("r1", "k")
    clock.advance(50)
    first = s.schedule()
    assert isinstance(first, Wave)
    clock.advance(10)
    s.add("r2", "k")
    clock.advance(9)
    s.add("r3", "k")
    clock.advance(1)
    s.finish(first.batch_id)
    wave = s.schedule()
    assert isinstance(wave, Wave) and wave.request_ids == ["r2", "r3"]
    assert wave.queue_wait_ms == pytest.approx({"r2": 10.0, "r3": 1.0})
    assert wave.admission_wait_ms == pytest.approx({"r2": 0.0, "r3": 0.0})


def test_queue_and_admission_wait_metrics(clock: FakeClock) -> None:
    s = make(clock, max_wait_ms=50, stable_window_ms=5)
    clock.advance(10)  # idle since creation (t=0): holding starts at each arrival
    s.add("r1", "k")
    clock.advance(2)
    s.add("r2", "k")
    clock.advance(5)
    wave = s.schedule()
    assert isinstance(wave, Wave)
    assert wave.queue_wait_ms == pytest.approx({"r1": 7.0, "r2": 5.0})
    assert wave.admission_wait_ms == pytest.approx({"r1": 7.0, "r2": 5.0})
    clock.advance(3)
    s.add("r3", "k")  # arrives while the wave runs: waits in the queue, is not held for batching
    clock.advance(10)
    s.finish(wave.batch_id)
    clock.advance(1)  # the worker asks a little after the runner went idle
    second = s.schedule()
    assert isinstance(second, Wave)
    assert second.queue_wait_ms == pytest.approx({"r3": 11.0})
    assert second.admission_wait_ms == pytest.approx({"r3": 1.0})


def test_schedule_returns_none_when_empty_or_running(clock: FakeClock) -> None:
    s = make(clock)
    assert s.schedule() is None
    s.add("r1", "k")
    wave = s.schedule()
    assert isinstance(wave, Wave)
    s.add("r2", "k")
    assert s.schedule() is None
    assert (s.num_waiting, s.num_running) == (1, 1)
    s.finish(wave.batch_id)
    second = s.schedule()
    assert isinstance(second, Wave) and second.batch_id == 2


def test_finish_of_a_batch_that_is_not_running_raises(clock: FakeClock) -> None:
    s = make(clock)
    with pytest.raises(ValueError, match="not running"):
        s.finish(1)
    s.add("r1", "k")
    wave = s.schedule()
    assert isinstance(wave, Wave)
    with pytest.raises(ValueError, match="not running"):
        s.finish(wave.batch_id + 1)


# ---------------------------------------------------------------- admission control and abort


def test_duplicate_ids_are_rejected_while_waiting_or_running(clock: FakeClock) -> None:
    s = make(clock)
    s.add("r1", "k")
    with pytest.raises(DuplicateRequestError):
        s.add("r1", "other")
    wave = s.schedule()
    assert isinstance(wave, Wave)
    with pytest.raises(DuplicateRequestError) as info:
        s.add("r1", "k")
    assert info.value.param == "request_id"
    s.finish(wave.batch_id)
    s.add("r1", "k")  # done: the id may be reused
    assert s.num_waiting == 1


def test_queue_full_counts_only_waiting_requests(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1, max_queue_len=2)
    s.add("r1", "k")
    s.add("r2", "k")
    with pytest.raises(QueueFullError):
        s.add("r3", "k")
    assert s.num_waiting == 2
    assert isinstance(s.schedule(), Wave)  # r1 runs: one slot frees
    s.add("r3", "k")
    with pytest.raises(QueueFullError):
        s.add("r4", "k")
    assert s.abort("r2") == "waiting"
    s.add("r4", "k")


def test_abort_of_a_waiting_request_shrinks_a_held_wave(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=3, max_wait_ms=50, stable_window_ms=20)
    s.add("r1", "k")
    clock.advance(10)
    s.add("r2", "k")
    assert s.schedule() == pytest.approx(0.030)
    assert s.abort("r1") == "waiting"
    assert s.abort("r1") is None
    assert s.num_waiting == 1
    assert s.schedule() == pytest.approx(0.030)  # the deadline now counts from r2's arrival (10 ms)
    s.add("r3", "k")
    s.add("r4", "k")  # r2, r3, r4 fill the wave that r1 left
    wave = s.schedule()
    assert isinstance(wave, Wave) and wave.request_ids == ["r2", "r3", "r4"]


def test_abort_of_the_held_head_moves_the_deadline(clock: FakeClock) -> None:
    s = make(clock, max_wait_ms=20, stable_window_ms=20)
    s.add("r1", "k")
    clock.advance(15)
    s.add("r2", "k")
    assert s.schedule() == pytest.approx(0.020)
    s.abort("r1")
    assert s.schedule() == pytest.approx(0.035)


def test_abort_of_a_running_request_is_remembered_until_finish(clock: FakeClock) -> None:
    s = make(clock)
    s.add("r1", "k")
    s.add("r2", "k")
    wave = s.schedule()
    assert isinstance(wave, Wave)
    assert s.abort("r1") == "running"
    assert s.is_aborted("r1") and not s.is_aborted("r2")
    assert s.abort("nope") is None
    assert s.finish(wave.batch_id) == ["r1", "r2"]
    assert not s.is_aborted("r1")
    assert s.abort("r1") is None


# ---------------------------------------------------------------- config and stats


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("max_num_seqs", -1),
        ("max_num_seqs", 1.5),
        ("max_num_seqs", True),
        ("max_wait_ms", -1.0),
        ("max_wait_ms", math.nan),
        ("max_wait_ms", math.inf),
        ("max_wait_ms", "5"),
    ],
)
def test_set_config_rejects_bad_values_naming_the_field(clock: FakeClock, field: str, value: object) -> None:
    s = make(clock, max_num_seqs=2, max_wait_ms=5)
    with pytest.raises(ValueError, match=field):
        s.set_config(**{field: value})
    with pytest.raises(ValueError, match=field):
        RequestScheduler(**{field: value}, clock=clock)
    s.add("r1", "k")
    s.add("r2", "k")
    assert isinstance(s.schedule(), Wave)  # the old config still holds: the wave is full


@pytest.mark.parametrize(
    "kw",
    [{"stable_window_ms": -1.0}, {"max_queue_len": 0}, {"policy": "lifo"}],
    ids=lambda kw: next(iter(kw)),
)
def test_constructor_rejects_bad_values_naming_the_field(clock: FakeClock, kw: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        RequestScheduler(clock=clock, **kw)


def test_set_config_applies_to_the_held_wave(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=4, max_wait_ms=50)
    s.add("r1", "k")
    s.add("r2", "k")
    assert isinstance(s.schedule(), float)
    s.set_config(max_num_seqs=2)
    wave = s.schedule()
    assert isinstance(wave, Wave) and wave.request_ids == ["r1", "r2"]


def test_set_config_while_running_applies_to_the_next_wave(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=1, max_wait_ms=50)
    s.add("r1", "k")
    wave = s.schedule()
    assert isinstance(wave, Wave)
    s.set_config(max_num_seqs=4, max_wait_ms=0)
    for i in range(2, 7):
        s.add(f"r{i}", "k")
    assert wave.request_ids == ["r1"]
    s.finish(wave.batch_id)
    assert drain(s) == [["r2", "r3", "r4", "r5"], ["r6"]]


def test_stats_count_waves_and_sizes(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=2)
    assert s.stats() == {
        "num_waiting": 0,
        "num_running": 0,
        "waves": 0,
        "requests_scheduled": 0,
        "batch_size_histogram": {},
    }
    for rid, key in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", "C"), ("c2", "C")]:
        s.add(rid, key)
    run(s)
    wave = s.schedule()
    assert isinstance(wave, Wave)
    assert s.stats() == {
        "num_waiting": 3,
        "num_running": 1,
        "waves": 2,
        "requests_scheduled": 3,
        "batch_size_histogram": {1: 1, 2: 1},
    }
    s.finish(wave.batch_id)
    drain(s)
    assert s.stats()["batch_size_histogram"] == {1: 2, 2: 2}
    assert s.stats()["requests_scheduled"] == 6


# ---------------------------------------------------------------- property: random operation sequences

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from("ABC")),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("schedule"), st.none()),
        st.tuples(st.just("finish"), st.none()),
        st.tuples(st.just("tick"), st.sampled_from([0.0, 1.0, 3.0, 7.0, 30.0])),
        st.tuples(st.just("config"), st.tuples(st.integers(1, 4), st.sampled_from([0.0, 4.0, 20.0]))),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=_ops,
    max_num_seqs=st.integers(1, 4),
    max_wait_ms=st.sampled_from([0.0, 4.0, 20.0]),
    stable_window_ms=st.sampled_from([None, 0.0, 2.0]),
    policy=st.sampled_from(["oldest_key", "fifo"]),
)
def test_random_sequences_never_lose_or_duplicate_requests(
    ops: list, max_num_seqs: int, max_wait_ms: float, stable_window_ms: float | None, policy: str
) -> None:
    clock = FakeClock()
    s = RequestScheduler(max_num_seqs, max_wait_ms, clock=clock, stable_window_ms=stable_window_ms, policy=policy)
    waiting: list[tuple[str, str]] = []  # the model: (id, key) in arrival order
    added: list[str] = []
    dispatched: list[str] = []
    dropped: set[str] = set()
    running: Wave | None = None
    limit = max_num_seqs

    def check(wave: Wave) -> None:
        nonlocal running
        head_id, head_key = waiting[0]
        if policy == "oldest_key":
            expected = [rid for rid, key in waiting if key == head_key][:limit]
        else:
            expected = []
            for rid, key in waiting:
                if key != head_key or len(expected) == limit:
                    break
                expected.append(rid)
        assert wave.request_ids == expected and wave.request_ids[0] == head_id
        assert wave.key == head_key and 1 <= len(wave) <= limit
        assert all(0 <= wave.admission_wait_ms[r] <= wave.queue_wait_ms[r] + 1e-9 for r in expected)
        waiting[:] = [(rid, key) for rid, key in waiting if rid not in expected]
        dispatched.extend(expected)
        running = wave

    for op, arg in ops:
        if op == "add":
            rid = f"r{len(added)}"
            s.add(rid, arg)
            added.append(rid)
            waiting.append((rid, arg))
        elif op == "abort" and added:
            rid = added[arg % len(added)]
            result = s.abort(rid)
            if any(rid == w for w, _ in waiting):
                assert result == "waiting"
                waiting[:] = [(w, k) for w, k in waiting if w != rid]
                dropped.add(rid)
            elif running is not None and rid in running.request_ids:
                assert result == "running" and s.is_aborted(rid)
            else:
                assert result is None
        elif op == "schedule":
            out = s.schedule()
            if isinstance(out, Wave):
                assert running is None
                check(out)
            elif isinstance(out, float):
                assert running is None and waiting and out > clock()
            else:
                assert running is not None or not waiting
        elif op == "finish" and running is not None:
            assert s.finish(running.batch_id) == running.request_ids
            assert not any(s.is_aborted(r) for r in running.request_ids)
            running = None
        elif op == "tick":
            clock.advance(arg)
        elif op == "config":
            limit = arg[0]
            s.set_config(max_num_seqs=arg[0], max_wait_ms=arg[1])
        assert (s.num_waiting, s.num_running) == (len(waiting), 0 if running is None else len(running))

    # Drain: once idle and past every deadline, each call must yield a wave.
    if running is not None:
        s.finish(running.batch_id)
        running = None
    while waiting:
        clock.advance(1000)
        out = s.schedule()
        assert isinstance(out, Wave)
        check(out)
        s.finish(out.batch_id)
        running = None
    assert s.schedule() is None
    assert len(dispatched) == len(set(dispatched))
    assert set(dispatched) | dropped == set(added) and not set(dispatched) & dropped
    assert s.stats()["requests_scheduled"] == len(dispatched)


def test_the_runners_batch_cap_bounds_max_num_seqs_before_and_after(clock: FakeClock) -> None:
    """set_batching must not lift what the runner declared it can take (a wave of 4 reached a
    runner declaring 1)."""
    s = make(clock, max_num_seqs=4)
    s.set_batch_cap(1)
    assert s.max_num_seqs == 1
    s.set_config(max_num_seqs=8)
    assert s.max_num_seqs == 1
    for i in range(3):
        s.add(f"r{i}", "k")
    wave = s.schedule()
    assert isinstance(wave, Wave) and len(wave) == 1
    s.set_batch_cap(None)  # a runner without a limit of its own: the last asked value applies
    assert s.max_num_seqs == 8
    s.set_batch_cap(2)
    s.set_config(max_num_seqs=1)
    assert s.max_num_seqs == 1


# ---------------------------------------------------------------- the adaptive stable window


def burst(s: RequestScheduler, clock: FakeClock, ids: list[str], gaps_ms: list[float]) -> None:
    """Add ``ids``, the first now and each next one ``gaps_ms[i]`` later."""
    s.add(ids[0], "k")
    for rid, gap in zip(ids[1:], gaps_ms, strict=True):
        clock.advance(gap)
        s.add(rid, "k")


def test_a_late_arrival_teaches_the_window_and_the_next_burst_is_one_wave(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=4, max_wait_ms=50)
    burst(s, clock, ["a1", "a2", "a3"], [1.0, 1.0])
    assert s.stable_window_ms == 5.0  # 3 x 1 ms is under the floor
    clock.advance(5)
    first = s.schedule()
    assert isinstance(first, Wave) and first.request_ids == ["a1", "a2", "a3"]  # the 4th is 10 ms late
    clock.advance(5)
    s.add("a4", "k")
    assert s.stable_window_ms == pytest.approx(30.0)  # learned: 3 x the 10 ms gap
    clock.advance(1)
    s.finish(first.batch_id)
    assert run(s) == ["a4"]  # queued behind a running wave: goes at once
    clock.advance(1000)  # a pause between bursts is not a gap inside one
    burst(s, clock, ["b1", "b2", "b3"], [1.0, 1.0])
    clock.advance(9)
    assert isinstance(s.schedule(), float)  # still held: 9 ms of quiet is less than 30
    clock.advance(1)
    s.add("b4", "k")
    wave = s.schedule()
    assert isinstance(wave, Wave) and wave.request_ids == ["b1", "b2", "b3", "b4"]


def test_the_adaptive_window_stays_within_the_floor_and_the_wait(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=100, max_wait_ms=20)
    burst(s, clock, ["r0", "r1"], [15.0])
    assert s.stable_window_ms == 20.0  # 3 x 15 ms, capped at max_wait
    clock.advance(5)
    run(s)
    # Sporadic requests push the short gaps out of the history: back to the floor.
    for i in range(40):
        clock.advance(500)
        s.add(f"s{i}", "k")
        clock.advance(20)
        run(s)
    assert s.stable_window_ms == 5.0


def test_a_fixed_stable_window_ignores_the_gaps(clock: FakeClock) -> None:
    s = make(clock, max_wait_ms=50, stable_window_ms=2)
    burst(s, clock, ["r0", "r1"], [10.0])
    assert s.stable_window_ms == 2.0
    assert s.schedule() == pytest.approx(0.012)


# ---------------------------------------------------------------- priority


def test_higher_priority_goes_first_and_equal_priorities_keep_oldest_key_first(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=2)
    s.add("a", "k1")
    s.add("b", "k2", priority=1)
    s.add("c", "k1", priority=2)
    s.add("d", "k2", priority=1)
    s.add("e", "k1", priority=2)
    # c leads (priority 2) with e; then b and d (priority 1, same key); a last.
    assert drain(s) == [["c", "e"], ["b", "d"], ["a"]]


def test_a_wave_takes_the_best_of_its_key_not_the_first_to_arrive(clock: FakeClock) -> None:
    s = make(clock, max_num_seqs=2)
    for rid, p in (("low1", 0), ("low2", 0), ("high", 3)):
        s.add(rid, "k", priority=p)
    assert drain(s) == [["high", "low1"], ["low2"]]


def test_a_low_priority_request_ages_past_later_high_priority_ones(clock: FakeClock) -> None:
    s = RequestScheduler(1, 0.0, clock=clock, priority_aging_s=1.0)
    s.add("low", "k", priority=0)
    clock.advance(1500)  # 1.5 s waited: aged 1.5 levels
    s.add("high", "k", priority=1)
    assert run(s) == ["low"]
    s.add("low2", "k", priority=0)
    s.add("high2", "k", priority=1)  # same instant: priority decides
    assert drain(s) == [["high"], ["high2"], ["low2"]]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-3, 3), st.sampled_from(["a", "b"]), st.floats(0, 50)),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 4),
    st.floats(0.01, 5.0),
)
def test_waves_follow_aged_priority_and_nothing_waits_beyond_its_bound(
    arrivals: list[tuple[int, str, float]], max_num_seqs: int, aging_s: float
) -> None:
    """Properties of any arrival sequence: each wave's head has the best aged rank of everything
    waiting (so a request is never led past by one that arrived more than ``aging_s`` seconds per
    level of priority after it), and a wave holds the best of its key."""
    clock = FakeClock()
    s = RequestScheduler(max_num_seqs, 0.0, clock=clock, priority_aging_s=aging_s)
    meta: dict[str, tuple[int, str, float]] = {}
    served: list[str] = []
    for i, (priority, key, gap_ms) in enumerate(arrivals):
        clock.advance(gap_ms)
        rid = f"r{i}"
        s.add(rid, key, priority=priority)
        meta[rid] = (priority, key, clock())
        if i % 3 == 2:  # some waves run while requests keep arriving
            served.extend(_checked_wave(s, meta, served, max_num_seqs, aging_s))
    while s.num_waiting:
        served.extend(_checked_wave(s, meta, served, max_num_seqs, aging_s))
    assert sorted(served) == sorted(meta)  # nothing lost, nothing twice


def _checked_wave(s, meta, served, max_num_seqs, aging_s) -> list[str]:
    waiting = [rid for rid in meta if rid not in served]
    rank = {rid: (meta[rid][2] / aging_s - meta[rid][0], int(rid[1:])) for rid in waiting}
    wave = s.schedule()
    assert isinstance(wave, Wave)
    head = min(waiting, key=rank.__getitem__)
    assert wave.key == meta[head][1]
    same_key = sorted((rid for rid in waiting if meta[rid][1] == wave.key), key=rank.__getitem__)
    assert wave.request_ids == same_key[:max_num_seqs]
    s.finish(wave.batch_id)
    return wave.request_ids


def test_a_lone_sequential_client_is_not_held_longer_and_longer(clock: FakeClock) -> None:
    """Each request is sent when the one before is answered. A gap that spans our own hold and
    forward is no gap inside a burst: with a huge wait the window fed on its own holds before
    (held 5 ms, then 3 x that gap, then 3 x a longer one...)."""
    s = make(clock, max_num_seqs=8, max_wait_ms=1e300)
    holds = []
    for i in range(6):
        s.add(f"r{i}", "k")
        wake = s.schedule()
        assert isinstance(wake, float)
        clock.ms = wake * 1000.0
        wave = s.schedule()
        assert isinstance(wave, Wave)
        holds.append(wave.admission_wait_ms[f"r{i}"])
        clock.advance(300)  # the forward
        s.finish(wave.batch_id)
        clock.advance(20)  # the client's own turnaround
    assert holds == pytest.approx([5.0] * 6)


_events = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.floats(0, 1e6)),
        st.tuples(st.just("schedule"), st.none()),
        st.tuples(st.just("finish"), st.none()),
    ),
    max_size=60,
)


def schedule_or_finish(s: RequestScheduler, running: Wave | None, op: str) -> Wave | None:
    """Carry out a random sequence's ``schedule`` or ``finish``; returns the wave now running."""
    if op == "schedule" and running is None:
        decision = s.schedule()
        return decision if isinstance(decision, Wave) else None
    if op == "finish" and running is not None:
        s.finish(running.batch_id)
        return None
    return running


@settings(max_examples=300, deadline=None)
@given(events=_events, max_wait_ms=st.sampled_from([0.0, 4.0, 20.0, 60_000.0, 1e300]))
def test_the_learned_window_stays_within_its_bounds_for_any_arrivals(events: list, max_wait_ms: float) -> None:
    clock = FakeClock()
    s = RequestScheduler(4, max_wait_ms, clock=clock)
    floor = min(max_wait_ms / 4.0, 5.0)
    running: Wave | None = None
    for i, (op, gap_ms) in enumerate(events):
        if op == "add":
            clock.advance(gap_ms)
            s.add(f"r{i}", "k")
        running = schedule_or_finish(s, running, op)
        assert floor <= s.stable_window_ms <= max_wait_ms


@settings(max_examples=200, deadline=None)
@given(
    offsets_ms=st.lists(st.floats(0, 50), min_size=1, max_size=4),
    thinks_ms=st.lists(st.floats(0, 200), min_size=8, max_size=8),
    exec_ms=st.floats(0.1, 5_000),
    max_wait_ms=st.sampled_from([20.0, 60_000.0, 1e300]),
)
def test_the_window_never_grows_from_its_own_holds(
    offsets_ms: list[float], thinks_ms: list[float], exec_ms: float, max_wait_ms: float
) -> None:
    """Closed-loop clients (each sends its next request ``think`` ms after its answer): however long
    the forward and the wait, the window stays within 3 x the longest gap the clients make
    themselves (think times, start offsets), never 3 x a gap that holds and forwards made."""
    clock = FakeClock()
    s = RequestScheduler(8, max_wait_ms, clock=clock)
    arrivals = dict(enumerate(offsets_ms))  # client -> time (ms) of its next request
    sent = dict.fromkeys(arrivals, 0)
    running: tuple[Wave, float] | None = None
    wake_ms = None
    windows = []
    while arrivals or running is not None or s.num_waiting:
        if running is None:
            decision = s.schedule()
            if isinstance(decision, Wave):
                running, wake_ms = (decision, clock.ms + exec_ms), None
                continue
            wake_ms = None if decision is None else decision * 1000.0
        times = [*arrivals.values(), *([running[1]] if running else []), *([wake_ms] if wake_ms is not None else [])]
        now = max(clock.ms, min(times))
        clock.advance(now - clock.ms)
        if running is not None and running[1] <= now:
            wave, _ = running
            s.finish(wave.batch_id)
            running = None
            for rid in wave.request_ids:
                client = int(rid.split("-")[0])
                if sent[client] < len(thinks_ms):
                    arrivals[client] = now + thinks_ms[sent[client]]
            continue
        due = [c for c, t in arrivals.items() if t <= now]
        for client in due:
            del arrivals[client]
            s.add(f"{client}-{sent[client]}", "k")
            sent[client] += 1
            windows.append(s.stable_window_ms)
    floor = min(max_wait_ms / 4.0, 5.0)
    own_gaps = 3.0 * max(*thinks_ms, *offsets_ms)
    assert max(windows) <= max(floor, min(own_gaps, max_wait_ms)) * (1 + 1e-9) + 1e-6


@settings(max_examples=200, deadline=None)
@given(ops=_ops)
def test_nothing_of_a_request_stays_after_it_ends(ops: list) -> None:
    """Waves that finish and requests aborted waiting or running (a deadline is an abort in the
    stage): once every request has ended, the scheduler holds nothing of any of them."""
    clock = FakeClock()
    s = RequestScheduler(4, 20.0, clock=clock)
    added = 0
    running: Wave | None = None
    for op, arg in ops:
        if op == "add":
            s.add(f"r{added}", arg)
            added += 1
        elif op == "abort" and added:
            s.abort(f"r{arg % added}")
        elif op == "tick":
            clock.advance(arg)
        running = schedule_or_finish(s, running, op)
    for i in range(added):
        s.abort(f"r{i}")
    if running is not None:
        s.finish(running.batch_id)
    assert s.schedule() is None
    assert s._waiting == {} and s._by_key == {} and s._priorities == {} and s._aborted == set()
    assert s._running is None and s.num_waiting == 0


# ---------------------------------------------------------------- learned admission (a cost model)


def learned(
    clock: FakeClock,
    curve: Callable[[int], float],
    max_num_seqs: int = 4,
    max_wait_ms: float = 20.0,
    **kw: object,
) -> RequestScheduler:
    """A scheduler whose injected cost model has seen waves of 1..4 of key ``k`` cost ``curve(n)`` ms."""
    from omni_runtime.stage.cost_model import CostModel

    model = CostModel()
    for n in (1, 2, 3, 4):
        for _ in range(2):
            model.observe("k", n, curve(n))
    return make(clock, max_num_seqs=max_num_seqs, max_wait_ms=max_wait_ms, cost_model=model, **kw)


def test_learned_flat_per_item_cost_never_holds_a_lone_request(clock: FakeClock) -> None:
    s = learned(clock, lambda n: 150.0 * n)
    for i in range(3):  # frequent arrivals, 1 ms apart, each finished before the next
        s.add(f"r{i}", "k")
        assert run(s) == [f"r{i}"]  # at once, even with a 20 ms window
        clock.advance(1)


def test_learned_flat_cost_caps_waves_at_one(clock: FakeClock) -> None:
    s = learned(clock, lambda n: 150.0 * n)
    for i in range(3):
        s.add(f"r{i}", "k")
    assert drain(s) == [["r0"], ["r1"], ["r2"]]


def test_learned_fixed_cost_holds_while_arrivals_are_frequent(clock: FakeClock) -> None:
    s = learned(clock, lambda n: 10.0 + 1.0 * n, max_wait_ms=50.0)
    s.add("a", "k")
    clock.advance(2)
    s.add("b", "k")  # arrivals ~2 ms apart; one more saves ~10 ms: worth waiting for
    due = s.schedule()
    assert isinstance(due, float)
    # Held no longer than the saving one more request brings (10 / 2 = 5 ms after the last arrival).
    assert due * 1000.0 == pytest.approx(2 + 5.0)
    clock.advance(2)
    s.add("c", "k")
    clock.advance(2)
    s.add("d", "k")  # full: goes at once
    wave = s.schedule()
    assert isinstance(wave, Wave) and wave.request_ids == ["a", "b", "c", "d"]


def test_learned_fixed_cost_does_not_hold_when_arrivals_are_rare(clock: FakeClock) -> None:
    s = learned(clock, lambda n: 10.0 + 1.0 * n, max_wait_ms=1000.0)
    s.add("a", "k")
    assert len(run(s)) == 1
    clock.advance(500)  # one more would save 10 ms, but the next is ~500 ms away
    s.add("b", "k")
    assert run(s) == ["b"]


def test_learned_hold_never_exceeds_max_wait(clock: FakeClock) -> None:
    s = learned(clock, lambda n: 1000.0 + 1.0 * n, max_wait_ms=20.0)
    s.add("a", "k")
    clock.advance(1)
    s.add("b", "k")
    due = s.schedule()
    assert isinstance(due, float) and due * 1000.0 == pytest.approx(20.0)
    clock.advance(19)
    assert isinstance(s.schedule(), Wave)


def test_learned_caps_waves_at_best_batch(clock: FakeClock) -> None:
    # t = 20 + 100 n: throughput rises 9 % from 1 to 2, 3 % from 2 to 3: best batch 2.
    s = learned(clock, lambda n: 20.0 + 100.0 * n, max_num_seqs=8, max_wait_ms=0.0)
    for i in range(5):
        s.add(f"r{i}", "k")
    assert drain(s) == [["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_learned_unknown_key_keeps_the_window(clock: FakeClock) -> None:
    s = learned(clock, lambda n: 150.0 * n, max_wait_ms=20.0)
    s.add("a", "other")
    due = s.schedule()
    assert isinstance(due, float)  # no evidence for this key: held as the window policy holds


def test_slo_ends_a_hold_the_head_could_not_afford(clock: FakeClock) -> None:
    # One more request saves 100 ms, but a wave of 3 takes 103 ms and the head's target is 110 ms.
    s = learned(clock, lambda n: 100.0 + 1.0 * n, max_wait_ms=50.0, slo_ms=110.0)
    s.add("a", "k")
    clock.advance(2)
    s.add("b", "k")
    due = s.schedule()
    assert isinstance(due, float) and due * 1000.0 == pytest.approx(110.0 - 103.0)
    clock.advance(5)
    assert run(s) == ["a", "b"]


def test_slo_shed_refuses_what_would_finish_late_with_a_retry_after(clock: FakeClock) -> None:
    from omni_runtime.stage.cost_model import CostModel

    model = CostModel()
    for n in (1, 2, 3, 4):
        model.observe("k", n, 100.0 * n)  # flat: 100 ms a request, one at a time
    s = make(clock, max_num_seqs=4, cost_model=model, slo_ms=250.0, slo_shed=True)
    s.add("a", "k")
    s.add("b", "k")  # 100 ahead + 100 own = 200 <= 250
    with pytest.raises(QueueFullError) as e:
        s.add("c", "k")  # 200 ahead + 100 own = 300 > 250
    assert e.value.retry_after_s == pytest.approx(0.3)
    s.add("new", "unknown key")  # no evidence: never refused
    assert s.stats()["slo_shed"] == 1
    wave = s.schedule()
    assert isinstance(wave, Wave) and wave.request_ids == ["a"]
    clock.advance(60)  # the running wave has 40 ms left: 40 + 100 (b) + 100 own = 240
    s.add("d", "k")


def test_a_requests_own_slo_tightens_the_stages(clock: FakeClock) -> None:
    # One more request saves 100 ms; the stage's target (1 s) allows the hold, b's own (105 ms) does not.
    s = learned(clock, lambda n: 100.0 + 1.0 * n, max_wait_ms=50.0, slo_ms=1000.0)
    s.add("a", "k")
    clock.advance(1)
    s.add("b", "k", slo_ms=105.0)
    due = s.schedule()  # b must start by 1 + 105 - 103 ms (a wave of 3 takes 103 ms)
    assert isinstance(due, float) and due * 1000.0 == pytest.approx(3.0)
    clock.advance(2)
    assert run(s) == ["a", "b"]


def test_a_requests_own_slo_holds_without_a_stage_target(clock: FakeClock) -> None:
    s = learned(clock, lambda n: 100.0 + 1.0 * n, max_wait_ms=50.0)
    s.add("a", "k", slo_ms=102.5)  # a wave of 2 takes 102 ms: no time to wait for a second request
    clock.advance(0.1)
    s.add("b", "k", slo_ms=10_000.0)
    assert isinstance(s.schedule(), Wave)


def test_a_requests_own_slo_sheds_with_slo_shed(clock: FakeClock) -> None:
    from omni_runtime.stage.cost_model import CostModel

    model = CostModel()
    for n in (1, 2, 3, 4):
        model.observe("k", n, 100.0 * n)
    s = make(clock, max_num_seqs=4, cost_model=model, slo_shed=True)
    s.add("a", "k")  # no target: never refused
    s.add("b", "k", slo_ms=210.0)  # 100 ahead + 100 own
    with pytest.raises(QueueFullError) as e:
        s.add("c", "k", slo_ms=250.0)  # 200 ahead + 100 own
    assert e.value.retry_after_s == pytest.approx(0.3) and "request's slo_ms" in str(e.value)
    s.add("d", "k")
    assert s.stats()["slo_shed"] == 1


@pytest.mark.parametrize("policy", ["waves", "seconds"])
def test_re_exploration_learns_a_curve_that_turned_fixed_dominated(clock: FakeClock, policy: str) -> None:
    from omni_runtime.stage.cost_model import CostModel

    model = CostModel()
    curve: Callable[[int], float] = lambda n: 100.0 * n  # noqa: E731 - flat: capped at 1
    for n in (1, 2, 3, 4):
        for _ in range(4):
            model.observe("k", n, curve(n))
    kw = {"explore_every": 8} if policy == "waves" else {"explore_every": 1000, "explore_after_s": 1.0}
    s = make(clock, max_num_seqs=4, cost_model=model, **kw)
    curve = lambda n: 100.0 + 10.0 * n  # noqa: E731 - the machine changed: a batch now pays
    sizes = []
    for i in range(40):
        for j in range(4 - s.num_waiting):
            s.add(f"r{i}-{j}", "k")
        wave = s.schedule()
        assert isinstance(wave, Wave)
        sizes.append(len(wave))
        clock.advance(curve(len(wave)))
        model.observe("k", len(wave), curve(len(wave)))
        s.finish(wave.batch_id)
    first_two = sizes.index(2)
    assert set(sizes[:first_two]) == {1} and first_two <= 10
    assert s.stats()["explored_waves"] >= 1
    # Within the sizes' freshness (32 samples) and an exploration: the cap is back at max_num_seqs.
    assert model.best_batch("k", 4) == 4 and sizes[-4:] == [4] * 4


def test_re_exploration_is_rare_while_the_curve_stays_flat(clock: FakeClock) -> None:
    s = learned(clock, lambda n: 100.0 * n, explore_every=8, explore_after_s=3600.0)
    sizes = []
    for i in range(81):
        s.add(f"a{i}", "k")
        s.add(f"b{i}", "k")
        sizes += [len(w) for w in drain(s)]
    assert sizes.count(2) == s.stats()["explored_waves"] <= 81 * 2 // 9 + 1
