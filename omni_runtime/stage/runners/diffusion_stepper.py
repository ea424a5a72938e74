"""The diffusion runner's step execution (``engine_args.step_execution``): each admitted request's
:class:`~omni_runtime.stage.runners.diffusion_steps.StepState`, made and encoded at admission
(its prompt's encoder outputs from the runner's prompt cache when it holds them:
:mod:`~omni_runtime.stage.runners.prompt_cache`), stepped in one batched denoiser call per step
with the others of its key, decoded when done, and dropped when aborted. The runner's ``step_*``
methods call it; the per-family loop it drives is :mod:`omni_runtime.stage.runners.diffusion_steps`.

Runs in the stage worker's forward thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from omni_runtime.exceptions import RequestError, StageAsleepError
from omni_runtime.params import DiffusionSamplingParams, in_force
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StepResult
from omni_runtime.stage.runners.diffusion_pipeline import decoded_output
from omni_runtime.stage.runners.diffusion_steps import StepFamily, StepState
from omni_runtime.stage.runners.lora import LoraAdapters
from omni_runtime.stage.runners.torch_common import image_generators, request_seeds

if TYPE_CHECKING:
    from omni_runtime.stage.runners.diffusion import DiffusionRunner

logger = logging.getLogger(__name__)


class DiffusionStepper:
    """Step execution over a :class:`~omni_runtime.stage.runners.diffusion.DiffusionRunner`'s
    loaded model; the states live in the runner's ``_states`` (freed with its model on sleep)."""

    def __init__(self, runner: DiffusionRunner) -> None:
        self.runner = runner

    @property
    def family(self) -> StepFamily:
        """The loaded model's step loop; asleep (none), StageAsleepError."""
        family = self.runner._step_family
        if self.runner.pipe is None or family is None:
            raise StageAsleepError("the diffusion stage is asleep; call wake_up first")
        return family

    def new_state(self, request: RunnerRequest[DiffusionSamplingParams]) -> StepState:
        runner, p = self.runner, request.params
        # Seeds and generators as in a wave: image j of a request uses seed + j.
        (seed,) = request_seeds([request])
        rows = p.per_prompt
        guidance = runner.guidance_of(p)
        steps = runner.steps_of(p)
        if not steps:
            raise ValueError("num_inference_steps is not set and the pipeline has no default")
        if p.mask_image is not None or (p.image is not None and not self.family.takes_images):
            # Refused before the queue (constraints); a direct call still gets a clear error.
            raise ValueError("this input image request does not run step by step (see the stage's image_inputs)")
        height, width = runner.size_of(p)
        if height is None or width is None:
            raise ValueError("height and width are not set and the pipeline has no native size")
        cache = runner.cache.step_cache(p.cache, int(steps)) if runner.cache is not None else None
        return StepState(
            request_id=request.request_id,
            prompt=request.prompt,
            negative_prompt=p.negative_prompt or None,
            seed=seed,
            rows=rows,
            guidance=guidance,
            cfg=self.family.uses_cfg(guidance),
            height=height,
            width=width,
            num_inference_steps=int(steps),
            output_type=in_force(p.output_type),
            generators=image_generators([seed], rows, runner.device),
            image=p.image,
            strength=p.strength,
            # Pinned to the file its name points at now: re-pointing the name mid-denoise must
            # not switch this request's adapter between two of its steps.
            lora=runner.loras.pin(p.lora),
            num_frames=runner.frames_of(p),
            fps=runner.fps_of(p) if runner._video else None,
            cache=cache,
        )

    def admit(self, requests: list[RunnerRequest[DiffusionSamplingParams]]) -> dict[str, RunnerOutput]:
        family = self.family
        failed: dict[str, RunnerOutput] = {}
        states: list[StepState] = []
        for r in requests:
            try:
                states.append(self.new_state(r))
            except Exception as e:
                failed[r.request_id] = RunnerOutput(error=e)
        with torch.inference_mode():
            # 1) Prompts encoded once, one encoder call per adapter and guidance mode for all that
            #    join now (a text encoder may carry the adapter too), except those the prompt
            #    cache holds.
            for group in self._lora_groups(states, failed):
                for cfg in (False, True):
                    self._encode([s for s in group if s.cfg == cfg], family, failed)
            # 2) Per request: timesteps, noise from its generators, a scheduler of its own.
            for s in states:
                if s.request_id not in failed:
                    self.isolated([s], lambda group: family.prepare(group[0]), failed)
        for s in states:
            if s.request_id not in failed:
                self.runner._states[s.request_id] = s
        return failed

    def _encode(self, states: list[StepState], family: StepFamily, failed: dict[str, RunnerOutput]) -> None:
        """``family.encode`` for ``states`` (one adapter and guidance mode), through the prompt
        cache: 1) hits filled from it  2) one encoder call for the rest, one request per prompt
        3) what it made stored, and copied to the requests of a prompt encoded for another."""
        cache = self.runner.prompt_cache
        if cache is None or not states:
            self.isolated(states, family.encode, failed)
            return
        plan = cache.plan(states, family.encode_reads_image)
        self.isolated(plan.encode, family.encode, failed)
        cache.remember([s for s in plan.encode if s.request_id not in failed])
        for follower, leader in plan.followers:
            if leader.request_id in failed:  # the same prompt would fail the same way
                failed[follower.request_id] = RunnerOutput(error=failed[leader.request_id].error)
            else:
                cache.follow(follower, leader)

    def run(self, request_ids: list[str], ctx: ExecuteContext) -> dict[str, StepResult]:
        family, runner = self.family, self.runner
        # Aborted since the plan was made: skipped now, dropped at the next boundary.
        states = [runner._states[rid] for rid in request_ids if rid in runner._states and not ctx.is_aborted(rid)]
        failed: dict[str, RunnerOutput] = {}
        if runner.cache is not None:  # a wave's diffusers hooks hold one state for all: off here
            runner.cache.use(None, 0)
        with torch.inference_mode():
            # 1) One batched denoiser call (per adapter: a step's requests share one, it is in the
            #    key); if it raises, each request alone, so only the culprit fails.
            preds: dict[str, torch.Tensor] = {}

            def predict(group: list[StepState]) -> None:
                for s, pred in zip(group, runner._step_denoise(group), strict=True):
                    preds[s.request_id] = pred

            for group in self._lora_groups(states, failed):
                self.isolated(group, predict, failed)
            # 2) Each request's own scheduler takes its step.
            for s in states:
                if s.request_id in preds:
                    self.isolated([s], lambda group: family.advance(group[0], preds[group[0].request_id]), failed)
            # 3) Requests past their last step leave: decoded together.
            done = [s for s in states if s.done and s.request_id not in failed]
            outputs = self._outputs(done, failed)
        results: dict[str, StepResult] = {}
        for s in states:
            output = failed.get(s.request_id) or outputs.get(s.request_id)
            results[s.request_id] = StepResult(step=s.index, steps=s.steps, output=output)
            if output is not None:
                runner._states.pop(s.request_id, None)
        return results

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.runner._states.pop(rid, None)

    def _lora_groups(self, states: list[StepState], failed: dict[str, RunnerOutput]) -> Iterator[list[StepState]]:
        """``states`` by adapter, each group yielded with its adapter active (a step's requests share
        one key, so there is one group); the requests of a group whose adapter fails fail."""
        groups: dict[Hashable, list[StepState]] = {}
        for s in states:
            groups.setdefault(LoraAdapters.key(s.lora), []).append(s)
        for group in groups.values():
            try:
                self.runner.loras.activate(group[0].lora)
            except RequestError as e:
                failed.update({s.request_id: RunnerOutput(error=e) for s in group})
                continue
            yield group

    @staticmethod
    def isolated(states: list[StepState], fn: Any, failed: dict[str, RunnerOutput]) -> None:
        """``fn(states)``; if it raises, ``fn([s])`` for each, so only the failing requests fail."""
        if not states:
            return
        try:
            fn(states)
            return
        except Exception as e:
            if len(states) == 1:
                logger.warning("request %s failed: %s", states[0].request_id, e)
                failed[states[0].request_id] = RunnerOutput(error=e)
                return
            logger.warning("a batched call for %d requests failed (%s); retrying one by one", len(states), e)
        for s in states:
            DiffusionStepper.isolated([s], fn, failed)

    def _outputs(self, done: list[StepState], failed: dict[str, RunnerOutput]) -> dict[str, RunnerOutput]:
        """Final outputs of finished requests; images of one size (videos of one size and frame count)
        are decoded in one VAE call."""
        outputs: dict[str, RunnerOutput] = {}
        to_decode: dict[tuple[int, int, int | None], list[StepState]] = {}
        for s in done:
            if s.output_type == "latent":
                assert s.latents is not None  # set by prepare
                outputs[s.request_id] = decoded_output(s.latents, "latent", s.seed)
            else:
                to_decode.setdefault((s.height, s.width, s.num_frames), []).append(s)
        decoded: dict[str, np.ndarray] = {}
        decode_ms: dict[str, float] = {}

        def decode(group: list[StepState]) -> None:
            start = time.perf_counter()
            for s, floats in zip(group, self.family.decode(group), strict=True):
                decoded[s.request_id] = np.asarray(floats, dtype=np.float32)
            for s in group:
                decode_ms[s.request_id] = (time.perf_counter() - start) * 1e3

        for group in to_decode.values():
            self.isolated(group, decode, failed)
        for s in done:
            if s.request_id in decoded:
                fps = (s.fps or self.runner._fps) if s.num_frames is not None else None
                outputs[s.request_id] = decoded_output(decoded[s.request_id], s.output_type, s.seed, fps=fps)
        prompts = self.runner.prompt_cache
        for s in done:  # the request's own cache blocks and prompt (/metrics counts them per request)
            if s.request_id not in outputs:
                continue
            metrics = outputs[s.request_id].metrics
            if s.cache is not None:
                metrics["request_cache_blocks_called"] = s.cache.blocks_called
                metrics["request_cache_blocks_run"] = s.cache.blocks_run
            if prompts is not None:
                metrics.update(prompts.metrics(s))
        for rid, out in outputs.items():
            out.metrics["seed"] = self.runner._states[rid].seed
            if rid in decode_ms:
                out.metrics["decode_ms"] = decode_ms[rid]
        return outputs
