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

from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.media import ImageItem
from omni_runtime.messages import StageConstraints
from omni_runtime.params import DiffusionSamplingParams, GenericSamplingParams
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner
from omni_runtime.stage.runners.echo import EchoRunner
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

    def constraints(self) -> StageConstraints:
        return StageConstraints(size_multiple=8, max_pixels=self.stage.engine_args.max_pixels)

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        deadline = time.monotonic() + float(self.stage.runner_args.get("delay_ms", 0)) / 1000.0
        idle = threading.Event()
        while time.monotonic() < deadline and not all(ctx.is_aborted(r.request_id) for r in batch):
            idle.wait(0.01)
        outputs = []
        for r in batch:
            seed = r.params.seed or 0
            image = np.full((8, 8, 3), seed % 256, dtype=np.uint8)
            n = r.params.per_prompt
            outputs.append(RunnerOutput(media=[ImageItem(data=image, seed=seed)] * n, metrics={"seed": seed}))
        return outputs


class WedgeRunner(FlakyRunner):
    """FlakyRunner plus ``wedge``: the forward blocks without ever calling ``ctx.is_aborted``,
    as a model stuck in native code would (``time.sleep`` releases the GIL, like a kernel)."""

    def runs_inline(self, batch: list[RunnerRequest]) -> bool:
        return False

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        if any("wedge" in str(r.prompt) for r in batch):
            time.sleep(3600)
        return super().execute(batch, ctx)


class LoadFailRunner(FlakyRunner):
    """Fails to load on the replicas listed in ``runner_args.fail_replicas`` (all if absent); a
    replica that loads takes ``runner_args.load_s`` seconds to do it."""

    def load(self) -> None:
        fail = self.stage.runner_args.get("fail_replicas")
        if fail is None or self.replica_id in fail:
            raise OSError(f"weights not found (replica {self.replica_id})")
        time.sleep(float(self.stage.runner_args.get("load_s", 0)))


class SlowRestartRunner(FlakyRunner):
    """Loads at once the first time; every later load (a restart) takes ``runner_args.load_s``.
    The first load leaves a marker file at ``runner_args.marker``."""

    def load(self) -> None:
        marker = self.stage.runner_args["marker"]
        if os.path.exists(marker):
            time.sleep(float(self.stage.runner_args.get("load_s", 5)))
        else:
            with open(marker, "w") as f:
                f.write(str(os.getpid()))


class SleepyRunner(FlakyRunner):
    """A runner whose ``sleep`` takes ``runner_args.sleep_s`` and really frees its "model": a wave
    that runs on a freed model raises a plain RuntimeError (a 500, were it ever reached)."""

    def __init__(self, stage: Any) -> None:
        super().__init__(stage)
        self.model: object | None = object()

    def runs_inline(self, batch: list[RunnerRequest]) -> bool:
        return False

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        if self.model is None:
            raise RuntimeError("forward on a freed model")
        if any("refuse" in str(r.prompt) for r in batch):
            raise InvalidRequestError("this prompt is refused by the model", param="prompt")
        return super().execute(batch, ctx)

    def sleep(self) -> dict[str, Any]:
        time.sleep(float(self.stage.runner_args.get("sleep_s", 0.5)))
        self.model = None
        return {}

    def wake_up(self) -> dict[str, Any]:
        self.model = object()
        return {}


class OneAtATimeRunner(FlakyRunner):
    """Declares ``max_batch_size = 1`` (a pipeline that cannot take lists) and records wave sizes."""

    max_batch_size = 1

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        if len(batch) > 1:
            raise AssertionError(f"a wave of {len(batch)} reached a runner that takes 1")
        return super().execute(batch, ctx)


class BadOutputRunner(FlakyRunner):
    """Answers ``surrogate`` with text UTF-8 cannot encode and ``bigint`` with an integer past 64
    bits in its metrics (a tokenizer or a model's counters can produce either)."""

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        outputs = super().execute(batch, ctx)
        for r, out in zip(batch, outputs, strict=True):
            if "surrogate" in str(r.prompt):
                out.text = "half a pair: \ud83d"
            if "bigint" in str(r.prompt):
                out.metrics["count"] = 2**70
        return outputs

    def rpc_bigint(self) -> int:
        return 2**70


class AnyParamsRunner(EchoRunner):
    """Echo with the generic params of a custom runner: any JSON-like fields are accepted."""

    params_cls = GenericSamplingParams


def exit_on_die(prompt: Any, upstream: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A custom_process_input_func that raises SystemExit for ``die`` (user code run inside the
    orchestrator thread: the one way left to kill that thread)."""
    if "die" in str(prompt):
        raise SystemExit("input function exited")
    return {"prompt": prompt}
