"""Fault-injecting runners for the reliability tests, named in configs as ``module:Class`` so they
run in a real stage process. A prompt word picks the fault; every other prompt is echoed."""

from __future__ import annotations

import ctypes
import os
import resource

from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
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
