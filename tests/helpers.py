"""Runners and input functions named in test configs (``module:Class``), so they also work in a
spawned stage process: faults are injected at the runner seam, not by patching internals."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from omni_runtime.params import DiffusionSamplingParams, EchoSamplingParams, resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StepResult
from omni_runtime.stage.runners.echo import EchoRunner

#: A small tiny-sd request: 4 steps at 64 x 64 under guidance.
SD_DEFAULTS = {"num_inference_steps": 4, "guidance_scale": 7.5, "height": 64, "width": 64}


def tiny_sd_stage(**engine_args: object) -> dict[str, Any]:
    """One tiny-sd stage in a process of one torch thread, at :data:`SD_DEFAULTS`, batching up to
    4 (``engine_args`` added)."""
    return {
        "stage_id": 0,
        "stage_type": "diffusion",
        "model": "builtin:tiny-sd",
        "runtime": {"backend": "process", "torch_threads": 1},
        "final_output": True,
        "final_output_type": "image",
        "default_sampling_params": SD_DEFAULTS,
        "engine_args": {"max_num_seqs": 4, **engine_args},
    }


def diffusion_params(params: dict[str, Any]) -> DiffusionSamplingParams:
    """``params`` as a diffusion runner gets them from the engine: resolved (validated, the
    params class's fallbacks filled in)."""
    return resolve_params(DiffusionSamplingParams, {}, params)


class FlakyRunner(EchoRunner):
    """Echo, but a prompt containing ``poison`` raises (failing the whole fused wave), and
    ``crash`` kills the process mid-forward, ``hang`` blocks until aborted."""

    params_cls = EchoSamplingParams
    calls: list[int] = []

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        prompts = [str(r.prompt) for r in batch]
        if any("crash" in p for p in prompts):
            os._exit(13)
        if any("hang" in p for p in prompts):
            stop = threading.Event()
            while not all(ctx.is_aborted(r.request_id) for r in batch):
                stop.wait(0.01)
        if any("poison" in p for p in prompts):
            raise RuntimeError(f"poisoned batch of {len(batch)}")
        return super().execute(batch, ctx)

    def rpc_boom(self) -> None:
        raise ValueError("boom")

    def rpc_slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"


class SteppingEcho(EchoRunner):
    """Echo that runs step by step for step execution: ``STEPS`` steps of ``delay_ms`` each (a sleep,
    as a model computes), then the prompt comes back. Any custom runner can implement the step
    interface; the worker drives it like the diffusion runner."""

    params_cls = EchoSamplingParams
    STEPS = 8

    def __init__(self, stage: Any) -> None:
        super().__init__(stage)
        self._left: dict[str, tuple[int, RunnerRequest]] = {}

    def step_support(self) -> str | None:
        return None

    def step_admit(self, requests: list[RunnerRequest], ctx: ExecuteContext) -> dict[str, RunnerOutput]:
        for r in requests:
            self._left[r.request_id] = (self.STEPS, r)
        return {}

    def step_run(self, request_ids: list[str], ctx: ExecuteContext) -> dict[str, StepResult]:
        delay = max((self._left[rid][1].params.delay_ms or 0.0) for rid in request_ids) / 1000.0
        time.sleep(delay)
        results = {}
        for rid in request_ids:
            left, r = self._left[rid]
            left -= 1
            self._left[rid] = (left, r)
            output = None
            if left == 0:
                del self._left[rid]
                output = RunnerOutput(text=str(r.prompt))
            results[rid] = StepResult(step=self.STEPS - left, steps=self.STEPS, output=output)
        return results

    def step_drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._left.pop(rid, None)


class ForgetfulStepper(SteppingEcho):
    """SteppingEcho with a bug: a prompt containing ``lost`` never gets a step result."""

    def step_run(self, request_ids: list[str], ctx: ExecuteContext) -> dict[str, StepResult]:
        results = super().step_run(request_ids, ctx)
        return {rid: r for rid, r in results.items() if "lost" not in str(self._prompt_of.get(rid, ""))}

    def step_admit(self, requests: list[RunnerRequest], ctx: ExecuteContext) -> dict[str, RunnerOutput]:
        self._prompt_of = {**getattr(self, "_prompt_of", {}), **{r.request_id: r.prompt for r in requests}}
        return super().step_admit(requests, ctx)


class ImportProbe(EchoRunner):
    """Echo that imports what a diffusion stage imports (transformers, diffusers) before it loads, and
    answers ``imported(name)``: whether its own process holds a module (a stage-side check)."""

    params_cls = EchoSamplingParams

    @classmethod
    def preload(cls, stage: Any) -> None:
        from omni_runtime.stage.runners.torch_common import import_model_libraries

        import_model_libraries(diffusers=True)

    def load(self) -> None:
        self.preload(self.stage)

    def rpc_imported(self, name: str) -> bool:
        return sys.modules.get(name) is not None


def shout(prompt: Any, upstream: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A custom_process_input_func: upper-cases upstream text and tags its source stages."""
    texts = [f"{sid}:{out['text']}" for sid, out in sorted(upstream.items())]
    return {"prompt": " | ".join(texts).upper(), "inputs": {"original": prompt}}


def _poisonable():
    from omni_runtime.stage.runners.diffusion import DiffusionRunner

    class PoisonableDiffusion(DiffusionRunner):
        """tiny-sd, but a prompt containing ``poison`` makes the pipeline call raise, as a model bug
        triggered by one request's input would: the whole fused forward fails."""

        def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
            if any("poison" in str(r.prompt) for r in batch):
                raise RuntimeError("NaN in the UNet for a poisoned prompt")
            return super().execute(batch, ctx)

    return PoisonableDiffusion


def __getattr__(name: str) -> Any:
    if name == "PoisonableDiffusion":
        return _poisonable()
    raise AttributeError(name)
