"""The step counts a scheduler really runs, found by running it, and the check that refuses the rest
before a request is queued."""

from __future__ import annotations

import pytest
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
)

from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints
from omni_runtime.params import check_constraints
from omni_runtime.stage.runners.step_limits import _runs, step_constraints, step_range

pytestmark = pytest.mark.unit

#: Stable Diffusion's schedule (tiny-sd's too): 1,000 training timesteps, steps_offset 1.
SD = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1}


@pytest.mark.parametrize(
    ("scheduler", "expected"),
    [
        (DDIMScheduler(**SD, clip_sample=False, set_alpha_to_one=False), (1, 999)),  # tiny-sd's
        (PNDMScheduler(**SD, skip_prk_steps=True), (1, 999)),  # SD 1.x's
        (PNDMScheduler(**SD), (4, 999)),  # its Runge-Kutta warm-up needs 4 steps
        (DDIMScheduler(num_train_timesteps=100, steps_offset=1), (1, 99)),
        (EulerDiscreteScheduler(**SD), (1, 1000)),
        (DPMSolverMultistepScheduler(**SD), (1, 1000)),
        (FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), (1, 1000)),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, tuple) else str(v),
)
def test_the_range_is_what_the_scheduler_runs(scheduler, expected):
    fewest, most = step_range(scheduler)
    assert (fewest, most) == expected
    assert _runs(scheduler, fewest) and _runs(scheduler, most)
    assert most == 1000 or not _runs(scheduler, most + 1)  # 1000 is the params' own cap
    assert fewest == 1 or not _runs(scheduler, fewest - 1)


def test_a_count_past_the_range_is_refused_naming_the_param_and_the_limit():
    constraints = step_constraints(DDIMScheduler(**SD))
    assert constraints.max_inference_steps == 999
    check_constraints({"num_inference_steps": 999}, constraints)
    check_constraints({}, constraints)  # the pipeline's default
    with pytest.raises(InvalidRequestError) as err:
        check_constraints({"num_inference_steps": 1000}, constraints)
    assert err.value.param == "num_inference_steps"
    assert "1..999" in str(err.value) and "DDIMScheduler (1000 training timesteps)" in str(err.value)
    with pytest.raises(InvalidRequestError, match=r"outside 4\.\.999"):
        check_constraints({"num_inference_steps": 3}, step_constraints(PNDMScheduler(**SD)))


def test_a_scheduler_the_probe_cannot_run_claims_no_limit():
    class NeedsArguments(DDIMScheduler):
        def set_timesteps(self, num_inference_steps, device=None, *, sigmas):  # a pipeline passes these
            super().set_timesteps(num_inference_steps, device)

    assert step_range(NeedsArguments(**SD)) is None and step_constraints(NeedsArguments(**SD)) == StageConstraints()
    check_constraints({"num_inference_steps": 1000}, StageConstraints())
