"""The start-up profile of the cost of a batch (``engine_args.batch_profile``): before READY, the
stage worker times forwards of its runner's representative request at a few batch sizes, on the
forward thread, and feeds them to the replica's :class:`~omni_runtime.stage.cost_model.CostModel`,
so the learned policy acts from the first request instead of after a few waves.

Bounded: one untimed warm-up forward (a first forward pays one-off costs, lazy allocations, that
would overstate a batch of one), then ``repeats`` forwards per size, in order; once ``max_s`` has
passed, the running forward is aborted at its next step (the runner's abort check) and discarded,
and the profile stops, keeping what it measured. A forward that fails ends the profile too: a
stage whose requests need upstream inputs cannot be profiled from a prompt alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from omni_runtime.config import BatchProfile
from omni_runtime.messages import BatchProfileReport
from omni_runtime.stage.cost_model import CostModel, key_label
from omni_runtime.stage.runners.base import ExecuteContext, StageRunner


def profile_batches(
    runner: StageRunner,
    model: CostModel,
    spec: BatchProfile,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> BatchProfileReport:
    """Time the runner's representative request at ``spec.sizes`` (those the runner can take in
    one forward), feed ``model``, and say what was measured. Runs on the forward thread."""
    start = clock()
    deadline = start + spec.max_s
    request = runner.profile_request()
    if request is None:
        return BatchProfileReport(key="", seconds=0.0, forwards={}, note="the runner offers no profile request")
    key = runner.batch_key(request)
    cap = runner.max_batch_size
    sizes = [n for n in spec.sizes if cap is None or n <= cap]
    ctx = ExecuteContext(lambda rid: clock() >= deadline)
    forwards: dict[int, int] = {}
    note: str | None = None

    def forward(n: int, tag: str) -> float | None:
        """One forward of ``n`` copies (ms), or None (and ``note`` says why) if it did not finish."""
        nonlocal note
        batch = [dataclasses.replace(request, request_id=f"batch-profile-{tag}-{i}") for i in range(n)]
        t0 = clock()
        try:
            outputs = runner.execute(batch, ctx)
            error = next((o.error for o in outputs if o.error is not None), None)
        except Exception as e:
            error = e
        elapsed_ms = (clock() - t0) * 1000.0
        if clock() >= deadline:
            note = f"stopped at max_s ({spec.max_s:g} s)"
            return None
        if error is not None:
            note = f"the profile request failed: {type(error).__name__}: {error}"[:200]
            return None
        return elapsed_ms

    # 1) Warm-up (untimed)  2) each size, repeats times, while time is left.
    if sizes and forward(min(sizes), "warmup") is not None:
        for n in sizes:
            for r in range(spec.repeats):
                elapsed_ms = forward(n, f"{n}-{r}")
                if elapsed_ms is None:
                    break
                model.observe(key, n, elapsed_ms)
                forwards[n] = forwards.get(n, 0) + 1
            if note is not None:
                break
    fit = model.fit(key)
    return BatchProfileReport(
        key=key_label(key),
        seconds=round(clock() - start, 3),
        forwards=forwards,
        fixed_ms=None if fit is None else round(fit.fixed_ms, 3),
        per_item_ms=None if fit is None else round(fit.per_item_ms, 3),
        note=note,
    )
