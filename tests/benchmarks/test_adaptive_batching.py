"""The cost-aware batching benchmark's guard: a baseline that serves fewer requests per second batched
than one at a time is named, in the loads where that means something; and the ratios of a row."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.adaptive_batching import ONE_AT_A_TIME, annotate, baseline_warnings

pytestmark = pytest.mark.unit

CLOSED = "closed 16 clients"


def row(server: str, load: str, req_s: float, offered: float | None = None, runner: str = "tiny-sd") -> dict[str, Any]:
    return {"runner": runner, "load": load, "server": server, "req_s": req_s, "offered_req_s": offered}


def solo(**req_s: float) -> list[dict[str, Any]]:
    return [row(server, ONE_AT_A_TIME, r) for server, r in req_s.items()]


def test_a_baseline_slower_batched_than_one_at_a_time_is_named() -> None:
    rows = [*solo(fcfs=2.76, window=2.70, learned=2.75), row("fcfs", CLOSED, 1.65), row("window", CLOSED, 3.0)]
    [warning] = baseline_warnings(rows)
    assert (warning["server"], warning["load"], warning["runner"]) == ("fcfs", CLOSED, "tiny-sd")
    assert warning["one_at_a_time_req_s"] == 2.76
    assert warning["ratio"] == pytest.approx(1.65 / 2.76)
    assert warning["message"].startswith("WARNING: baseline fcfs")
    assert "loses to sequential" in warning["message"]


def test_noise_and_the_policy_under_test_are_not_flagged() -> None:
    rows = [
        *solo(fcfs=2.0, window=2.0, learned=2.0),
        row("fcfs", CLOSED, 1.85),  # 7.5 % below: noise
        row("window", CLOSED, 1.81),  # 9.5 % below: noise
        row("learned", CLOSED, 1.0),  # not a baseline: the verdict reports it, the guard does not
    ]
    assert baseline_warnings(rows) == []
    assert [w["server"] for w in baseline_warnings(rows, noise=0.05)] == ["fcfs", "window"]


def test_an_open_load_is_checked_only_where_it_offers_at_least_twice_one_at_a_time() -> None:
    rows = [
        *solo(fcfs=2.0, window=2.0),
        row("fcfs", "poisson below 1.2/s", 1.2, offered=1.2),  # the arrival rate: nothing to serve faster
        row("window", "poisson above 3.0/s", 1.5, offered=3.0),  # 1.5x: not checked
        row("window", "poisson far above 6.0/s", 1.5, offered=6.0),  # 3x: a loss
    ]
    assert [w["load"] for w in baseline_warnings(rows)] == ["poisson far above 6.0/s"]


def test_each_server_is_held_to_its_own_one_at_a_time_figure_in_its_own_runner() -> None:
    rows = [
        *solo(fcfs=2.0, window=1.5),
        row("fcfs", ONE_AT_A_TIME, 8.0, runner="synthetic"),
        row("window", CLOSED, 1.6),  # above its own 1.5, below fcfs's 2.0
        row("fcfs", CLOSED, 7.0, runner="synthetic"),  # below synthetic's 8.0, above tiny-sd's 2.0
        row("fcfs", "closed", 0.5, runner="other"),  # no one-at-a-time figure: nothing to judge by
    ]
    [warning] = baseline_warnings(rows)
    assert (warning["runner"], warning["server"], warning["one_at_a_time_req_s"]) == ("synthetic", "fcfs", 8.0)


def test_rows_carry_their_ratios_to_their_own_one_at_a_time_and_to_fcfs() -> None:
    rows = annotate([*solo(fcfs=2.0, learned=2.5), row("fcfs", CLOSED, 3.0), row("learned", CLOSED, 4.5)])
    learned = next(r for r in rows if r["server"] == "learned" and r["load"] == CLOSED)
    assert (learned["solo_req_s"], learned["x_solo"], learned["x_fcfs"]) == (2.5, 1.8, 1.5)
    learned_solo = next(r for r in rows if r["server"] == "learned" and r["load"] == ONE_AT_A_TIME)
    assert (learned_solo["x_solo"], learned_solo["x_fcfs"]) == (1.0, 1.25)
