"""How many denoising steps a loaded model's scheduler can really run, found once at load.

``num_inference_steps`` is capped at 1,000 for every request, but what a model takes is its
scheduler's: DDIM and PNDM with ``steps_offset: 1`` (as Stable Diffusion ships them) index past
their 1,000 training timesteps at 1,000 steps and raise ``IndexError`` mid-denoise; PNDM with its
Runge-Kutta warm-up (``skip_prk_steps: false``) cannot run fewer than 4. Rather than a table per
scheduler class and config, the range is found by running the scheduler itself: a copy of it is set
to ``n`` steps and steps through a 1-element sample, as a pipeline would (scale the input, step),
for the few ``n`` that decide the range. Cheap (well under a second for 1,000-step probes on CPU)
and true for any scheduler class and config, including ones this module has never seen.

Runs in the stage worker's forward thread, at load.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from omni_runtime.messages import StageConstraints

#: The largest ``num_inference_steps`` any request may ask for (``DiffusionSamplingParams``).
MAX_STEPS = 1000
#: The smallest step counts tried when 1 step fails (PNDM's warm-up needs 4).
_SMALL = 8


def _runs(scheduler: Any, steps: int) -> bool:
    """Whether a copy of ``scheduler`` set to ``steps`` steps runs all of them."""
    import torch

    probe = copy.deepcopy(scheduler)
    kwargs = {"mu": 0.0} if probe.config.get("use_dynamic_shifting", False) else {}
    sample = torch.zeros(1, 1, 1, 1)
    try:
        probe.set_timesteps(steps, **kwargs)
        for t in probe.timesteps:
            x = probe.scale_model_input(sample, t) if hasattr(probe, "scale_model_input") else sample
            sample = probe.step(torch.zeros_like(x), t, sample, return_dict=False)[0]
    except Exception:
        return False
    return True


def step_range(scheduler: Any, upper: int = MAX_STEPS) -> tuple[int, int] | None:
    """``(fewest, most)`` denoising steps ``scheduler`` runs, within ``1..upper``; None when it
    runs none of the small counts tried (a scheduler whose pipeline passes arguments this probe
    cannot know: no limit is claimed then)."""
    # The schedulers warn at every step that a pipeline would have scaled the input first, and
    # similar; the probe is not a pipeline.
    quiet = logging.getLogger("diffusers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        fewest = next((n for n in range(1, _SMALL + 1) if _runs(scheduler, n)), None)
        if fewest is None:
            return None
        # Failures past a limit come from timesteps beyond the training range, which grow with
        # the step count: the top two are tried first (999 is the answer for DDIM and PNDM), then
        # a bisection between the largest count that runs and the smallest that does not.
        if _runs(scheduler, upper):
            return fewest, upper
        good, bad = fewest, upper
        if upper - 1 > good and _runs(scheduler, upper - 1):
            return fewest, upper - 1
        bad = min(bad, upper - 1)
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if _runs(scheduler, mid) else (good, mid)
        return fewest, good
    finally:
        quiet.setLevel(level)


def step_constraints(scheduler: Any) -> StageConstraints:
    """The READY constraints for :func:`~omni_runtime.params.check_constraints`: the step counts
    ``scheduler`` runs, and a description of it for the error (nothing when no range was found)."""
    found = step_range(scheduler)
    if found is None:
        return StageConstraints()
    trained = scheduler.config.get("num_train_timesteps")
    reason = type(scheduler).__name__ + (f" ({trained} training timesteps)" if trained else "")
    return StageConstraints(min_inference_steps=found[0], max_inference_steps=found[1], inference_steps_reason=reason)
