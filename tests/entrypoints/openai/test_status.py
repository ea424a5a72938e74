"""The arithmetic of ``GET /v1/status``: latency quantiles and waves per second (the route itself
runs against a real server in test_pages.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from omni_runtime.entrypoints.openai.status import RATE_WINDOW_S, WaveRates, quantile_ms

pytestmark = pytest.mark.unit


def test_quantiles_by_nearest_rank() -> None:
    assert quantile_ms([], 0.5) is None
    values = [i / 1000.0 for i in range(1, 101)]  # 1..100 ms
    assert quantile_ms(values, 0.5) == 50.0
    assert quantile_ms(values, 0.99) == 99.0
    assert quantile_ms([0.25], 0.99) == 250.0


@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=200), st.sampled_from([0.0, 0.5, 0.99, 1.0]))
def test_a_quantile_is_one_of_the_values(values: list[float], q: float) -> None:
    result = quantile_ms(values, q)
    assert result is not None and min(values) * 1000 - 1e-3 <= result <= max(values) * 1000 + 1e-3


def test_waves_per_second_over_the_window() -> None:
    rates = WaveRates()
    assert rates.rate(0, 100.0, 5) == 0.0  # one sample: no rate yet
    assert rates.rate(0, 101.0, 7) == 2.0
    assert rates.rate(0, 102.0, 9) == 2.0
    assert rates.rate(1, 102.0, 3) == 0.0  # per stage
    # Samples older than the window stop counting.
    assert rates.rate(0, 102.0 + RATE_WINDOW_S, 9) == 0.0
    assert rates.rate(0, 103.0 + RATE_WINDOW_S, 19) == pytest.approx(10 / (RATE_WINDOW_S + 1), abs=1e-3)
    # A restarted replica starts its counters again: no negative rate.
    assert rates.rate(0, 104.0 + RATE_WINDOW_S, 0) == 0.0
