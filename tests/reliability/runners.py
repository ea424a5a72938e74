"""Fault-injecting runners for the reliability tests, named in configs as ``module:Class`` so they
run in a real stage process. A prompt word picks the fault; every other prompt is echoed."""

from __future__ import annotations

import ctypes
import os
import resource
import threading
import time
from typing import Any

import numpy as np

from omni_runtime.params import DiffusionSamplingParams
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner
from tests.helpers import FlakyRunner


def _no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class FaultRunner(FlakyRunner):
    """FlakyRunner (``poison`` raises, ``crash`` exits, ``hang`` blocks until aborted) plus:

    * ``abort``: ``os.abort()`` (SIGABRT), as a C library assertion would;
    * ``segfault``: a real SIGSEGV (a read of address 0);
    * ``systemexit``: ``SystemExit`` escaping the forward;
    * ``garble``: returns no outputs for its batch, a runner bug that breaks the worker's own loop.

    Faults always run in the forward thread (never inline on the worker's loop), as a model does,
    so the worker keeps answering aborts and control calls while ``hang`` blocks.
    """

    def runs_inline(self, batch: list[RunnerRequest]) -> bool:
        return False

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        prompts = [str(r.prompt) for r in batch]
        if any("segfault" in p for p in prompts):
            _no_core_dump()
            ctypes.string_at(0)
        if any(p == "abort" for p in prompts):
            _no_core_dump()
            os.abort()
        if any("systemexit" in p for p in prompts):
            raise SystemExit(3)
        outputs = super().execute(batch, ctx)
        return [] if any("garble" in p for p in prompts) else outputs


class TinyImageRunner(StageRunner):
    """An image stage without a model, for HTTP tests: it validates like the diffusion stage (its
    params, a size multiple of 8, the pixel limit) and answers with small images (8x8, one per
    ``num_images_per_prompt``) after ``runner_args.delay_ms``."""

    params_cls = DiffusionSamplingParams

    def constraints(self) -> dict[str, Any]:
        return {"size_multiple": 8, "max_pixels": self.stage.engine_args.max_pixels}

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        deadline = time.monotonic() + float(self.stage.runner_args.get("delay_ms", 0)) / 1000.0
        idle = threading.Event()
        while time.monotonic() < deadline and not all(ctx.is_aborted(r.request_id) for r in batch):
            idle.wait(0.01)
        outputs = []
        for r in batch:
            seed = r.params.get("seed") or 0
            image = np.full((8, 8, 3), seed % 256, dtype=np.uint8)
            n = r.params.get("num_images_per_prompt") or 1
            outputs.append(RunnerOutput(images=[image] * n, metrics={"seed": seed}))
        return outputs
