"""The learned cost of a batch, fed synthetic curves (times in ms)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_runtime.stage.cost_model import CostFit, CostModel, key_label


def feed(model: CostModel, curve: Callable[[int], float], sizes: range = range(1, 5), rounds: int = 3) -> None:
    for _ in range(rounds):
        for n in sizes:
            model.observe("k", n, curve(n))


def test_flat_per_item_cost_fits_no_fixed_cost_and_best_batch_one() -> None:
    m = CostModel()
    feed(m, lambda n: 150.0 * n)
    f = m.fit("k")
    assert f is not None
    assert f.fixed_ms == pytest.approx(0.0, abs=1e-6)
    assert f.per_item_ms == pytest.approx(150.0)
    assert f.gain_of_one_more(1) == pytest.approx(0.0, abs=1e-6)
    assert m.best_batch("k", 8) == 1


def test_sublinear_gpu_like_cost_has_fixed_cost_and_batches_to_the_limit() -> None:
    m = CostModel()
    feed(m, lambda n: 100.0 + 10.0 * n)
    f = m.fit("k")
    assert f is not None
    assert (f.fixed_ms, f.per_item_ms) == (pytest.approx(100.0), pytest.approx(10.0))
    assert f.throughput(4) > f.throughput(1) * 3
    # Saves the fixed cost shared over the batch: fixed / n.
    assert f.gain_of_one_more(1) == pytest.approx(100.0)
    assert f.gain_of_one_more(4) == pytest.approx(25.0)
    assert m.best_batch("k", 4) == 4
    assert m.best_batch("k", 2) == 2


def test_superlinear_cost_is_clamped_monotone_and_never_batches() -> None:
    m = CostModel()
    feed(m, lambda n: 100.0 * n**1.5)
    f = m.fit("k")
    assert f is not None
    assert f.fixed_ms == 0.0
    assert f.per_item_ms > 0
    assert m.best_batch("k", 8) == 1


def test_best_batch_stops_where_throughput_stops_rising() -> None:
    # t = 20 + 100 n: going 1 -> 2 gains 20 / 220 = 9 %, 2 -> 3 gains 20 / 640 = 3 % (< 5 %).
    f = CostFit(fixed_ms=20.0, per_item_ms=100.0, samples=10)
    assert f.best_batch(8, margin=0.05) == 2
    assert f.best_batch(8, margin=0.0) == 8


def test_no_fit_without_evidence() -> None:
    m = CostModel(min_samples=3)
    assert m.fit("unknown") is None and m.best_batch("unknown", 4) is None
    m.observe("k", 1, 100.0)
    m.observe("k", 2, 150.0)
    assert m.fit("k") is None  # two samples
    for _ in range(5):
        m.observe("one-size", 1, 100.0)
    assert m.fit("one-size") is None  # a single batch size: the intercept is unknowable
    m.observe("k", 1, 100.0)
    assert m.fit("k") is not None


def test_sizes_seen_long_ago_are_kept_when_only_one_size_runs_since() -> None:
    m = CostModel()
    feed(m, lambda n: 150.0 * n)
    for _ in range(500):
        m.observe("k", 1, 150.0)
    f = m.fit("k")
    assert f is not None and f.per_item_ms == pytest.approx(150.0)


def test_follows_drift() -> None:
    m = CostModel()
    feed(m, lambda n: 150.0 * n)
    feed(m, lambda n: 100.0 + 10.0 * n, rounds=20)
    f = m.fit("k")
    assert f is not None and f.fixed_ms == pytest.approx(100.0, rel=0.01)


def test_snapshot_names_fitted_keys_bounded() -> None:
    m = CostModel()
    for i in range(100):
        for n in (1, 2, 3):
            m.observe((512, 512, i), n, 10.0 + n)
    m.observe("lonely", 1, 5.0)
    snap = m.snapshot()
    assert snap.num_keys == 64
    assert len(snap.keys) == 8
    assert snap.keys[0].key == "512x512x99"
    assert snap.keys[0].fixed_ms == pytest.approx(10.0) and snap.keys[0].best_batch == 3


@given(
    key=st.one_of(st.text(), st.tuples(st.integers(), st.text(), st.booleans(), st.none()), st.integers()),
    samples=st.lists(
        st.tuples(st.integers(-3, 64), st.floats(allow_nan=True, allow_infinity=True)), min_size=0, max_size=30
    ),
)
def test_any_samples_give_a_sane_fit(key: object, samples: list[tuple[int, float]]) -> None:
    m = CostModel()
    for n, ms in samples:
        m.observe(key, n, ms)  # type: ignore[arg-type]
    f = m.fit(key)  # type: ignore[arg-type]
    if f is not None:
        assert f.fixed_ms >= 0 and f.per_item_ms >= 0
        assert math.isfinite(f.fixed_ms) and math.isfinite(f.per_item_ms)
        assert 1 <= f.best_batch(16, 0.05) <= 16
    assert len(key_label(key)) <= 48  # type: ignore[arg-type]
    m.snapshot()


def test_stale_sizes_step_aside_once_fresher_sizes_exist() -> None:
    m = CostModel()
    feed(m, lambda n: 100.0 * n)  # flat: sizes 1..4
    for _ in range(40):  # since then only 1 and 2 ran, on a curve that turned fixed-dominated
        m.observe("k", 1, 110.0)
        m.observe("k", 2, 120.0)
    f = m.fit("k")
    assert f is not None and (f.fixed_ms, f.per_item_ms) == pytest.approx((100.0, 10.0), abs=0.5)
    m.observe("k", 4, 140.0)  # a stale size fed again starts afresh, not from its old 400 ms
    assert m.fit("k").time_ms(4) == pytest.approx(140.0, abs=0.5)  # type: ignore[union-attr]
