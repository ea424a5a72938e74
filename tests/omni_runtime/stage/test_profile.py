"""The start-up profile of the cost of a batch: a runner whose forwards advance an injected clock
by a synthetic curve, so what is timed, fitted and cut short at ``max_s`` is exact, in
milliseconds."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omni_runtime.config import BatchProfile
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.stage.cost_model import CostModel
from omni_runtime.stage.profile import profile_batches
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner
from tests.conftest import FakeClock, echo_stage, make_config

pytestmark = pytest.mark.unit


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class CurveRunner(StageRunner):
    """Each forward of n requests takes ``curve(n)`` ms of the fake clock, in 10 steps that check
    for an abort as a model does between steps."""

    def __init__(self, clock: FakeClock, curve: Callable[[int], float], request: RunnerRequest | None) -> None:
        super().__init__(make_config([echo_stage()]).stage_args[0])
        self.clock, self.curve, self.request, self.sizes = clock, curve, request, []
        self.fail = False

    def profile_request(self) -> RunnerRequest | None:
        return self.request

    def batch_key(self, request: RunnerRequest) -> tuple[int, int]:
        return (64, 20)

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        self.sizes.append(len(batch))
        for _ in range(10):
            if all(ctx.is_aborted(r.request_id) for r in batch):
                break
            self.clock.advance(self.curve(len(batch)) / 10)
        if self.fail:
            return [RunnerOutput(error=InvalidRequestError("needs an image")) for _ in batch]
        return [RunnerOutput(text="ok") for _ in batch]


def request() -> RunnerRequest:
    return RunnerRequest(request_id="p", prompt="x", params={})


def test_a_profile_seeds_the_fit_of_the_runners_key(clock: FakeClock) -> None:
    runner, model = CurveRunner(clock, lambda n: 100.0 + 10.0 * n, request()), CostModel()
    report = profile_batches(runner, model, BatchProfile(sizes=[1, 2, 4], repeats=2), clock=clock)
    assert runner.sizes == [1, 1, 1, 2, 2, 4, 4]  # an untimed warm-up first
    assert report.forwards == {1: 2, 2: 2, 4: 2} and report.note is None and report.key == "64x20"
    fit = model.fit((64, 20))
    assert fit is not None and (fit.fixed_ms, fit.per_item_ms) == pytest.approx((100.0, 10.0))
    assert (report.fixed_ms, report.per_item_ms) == pytest.approx((100.0, 10.0))
    assert report.seconds == pytest.approx(7 * 0.001 * 100 + 0.01 * (1 + 1 + 1 + 2 + 2 + 4 + 4))


def test_a_profile_stops_at_max_s_and_keeps_what_it_measured(clock: FakeClock) -> None:
    runner, model = CurveRunner(clock, lambda n: 100.0 * n, request()), CostModel()
    # Warm-up 100 ms, 1: 100, 2: 200, then a forward of 4 (400 ms) would end past 0.5 s.
    report = profile_batches(runner, model, BatchProfile(sizes=[1, 2, 4], max_s=0.5), clock=clock)
    assert report.forwards == {1: 1, 2: 1} and report.note is not None and "max_s" in report.note
    # The forward of 4 was aborted at the step that crossed the bound, not run to its end.
    assert report.seconds == pytest.approx(0.5, abs=0.04)
    assert model.fit((64, 20)) is None  # two samples: too little evidence, and the policy waits for more


def test_sizes_past_the_runners_cap_are_not_timed(clock: FakeClock) -> None:
    runner = CurveRunner(clock, lambda n: 10.0 * n, request())
    runner.max_batch_size = 2
    report = profile_batches(runner, CostModel(), BatchProfile(sizes=[1, 2, 4, 8]), clock=clock)
    assert report.forwards == {1: 1, 2: 1} and max(runner.sizes) == 2


def test_no_request_or_a_failing_one_leaves_the_model_empty(clock: FakeClock) -> None:
    model = CostModel()
    report = profile_batches(CurveRunner(clock, lambda n: 10.0, None), model, BatchProfile(), clock=clock)
    assert report.forwards == {} and report.note is not None
    failing = CurveRunner(clock, lambda n: 10.0, request())
    failing.fail = True
    report = profile_batches(failing, model, BatchProfile(), clock=clock)
    assert report.forwards == {} and report.note is not None and "needs an image" in report.note
    assert failing.sizes == [1] and model.snapshot().num_keys == 0


@pytest.mark.parametrize("profile", [{"sizes": [1, 2]}, {"sizes": [4], "repeats": 3}, {"sizes": [2, 2, 2]}])
def test_a_profile_that_cannot_seed_a_fit_is_refused_naming_it(profile: dict) -> None:
    """Two forwards, or one size: the cost model fits nothing from it (3 samples at 2 sizes), yet
    the stage would have paid for it at every start."""
    from omni_runtime.config import parse_config
    from omni_runtime.exceptions import ConfigError

    echo = {"stage_id": 0, "stage_type": "echo", "final_output": True, "final_output_type": "text"}
    echo["engine_args"] = {"batch_profile": profile}
    with pytest.raises(ConfigError, match=r"engine_args\.batch_profile: a fit needs at least 3 forwards at 2 sizes"):
        parse_config({"stage_args": [echo]})
