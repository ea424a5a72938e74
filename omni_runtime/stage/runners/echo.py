"""The ``echo`` runner: returns its input after an optional delay.

For overhead tests and benchmarks: it measures everything the runtime adds around a model.
Text prompts come back as ``text``; upstream tensors come back unchanged as ``tensors``.
"""

from __future__ import annotations

import threading
import time

from omni_runtime.exceptions import RequestAbortedError
from omni_runtime.params import EchoSamplingParams, GenericSamplingParams, in_force
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner


def delay_ms(params: EchoSamplingParams | GenericSamplingParams) -> float:
    """A request's ``delay_ms``: its echo params', or, for a custom echo whose params are generic,
    that field among its others (0 when unset)."""
    if isinstance(params, GenericSamplingParams):
        return float(params.get("delay_ms") or 0.0)
    return in_force(params.delay_ms)


class EchoRunner(StageRunner):
    params_cls = EchoSamplingParams

    def profile_request(self) -> RunnerRequest:
        return self._default_request("profile")

    def runs_inline(self, batch: list[RunnerRequest]) -> bool:
        return not any(delay_ms(r.params) for r in batch)

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        start = time.perf_counter()
        delay_s = max(delay_ms(r.params) for r in batch) / 1000.0
        if delay_s:
            # Wait in short slices so an aborted wave stops early, like a model between steps.
            deadline = time.monotonic() + delay_s
            idle = threading.Event()
            while (left := deadline - time.monotonic()) > 0:
                if all(ctx.is_aborted(r.request_id) for r in batch):
                    break
                idle.wait(min(left, 0.01))
        outputs = []
        for r in batch:
            if ctx.is_aborted(r.request_id):
                outputs.append(RunnerOutput(error=RequestAbortedError("aborted")))
                continue
            text = r.prompt if isinstance(r.prompt, str) else r.inputs.get("text")
            tensors = {k: v for k, v in r.inputs.items() if k != "text"}
            outputs.append(
                RunnerOutput(
                    text=text,
                    tensors=tensors,
                    metrics={"batch_size": len(batch), "execution_ms": (time.perf_counter() - start) * 1000.0},
                )
            )
        return outputs
