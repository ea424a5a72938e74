"""What the torch runners share: per-request seeds and generators, leaving a wave early, and
giving memory back on ``sleep``, a wave's per-request rows. Imported by runners only (it imports torch)."""

from __future__ import annotations

import gc
import importlib
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import InvalidRequestError, RequestAbortedError
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner


class WaveAborted(Exception):
    """Raised from a step callback to leave the denoising loop once every request is aborted."""


def request_seeds(batch: list[RunnerRequest]) -> list[int]:
    """Each request's own seed, or a fresh one (reported back, so its image can be made again)."""
    return [int(r.params.seed) if r.params.seed is not None else secrets.randbelow(2**32) for r in batch]


def image_generators(seeds: list[int], per_prompt: int, device: str) -> list[torch.Generator]:
    """One generator per output image in a pipeline's prompt-major order (the first request's k
    images, then the next request's...): image j of a request uses seed + j, so a request's
    images do not depend on what it was batched with."""
    return [torch.Generator(device=device).manual_seed(seed + j) for seed in seeds for j in range(per_prompt)]


def release_memory() -> dict[str, Any]:
    """After a runner dropped its model: collect it, and hand cached GPU memory back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"released": True}


def import_model_libraries(diffusers: bool) -> None:
    """Import what loading a transformers (and, with ``diffusers``, a diffusers) model imports
    first: most of a stage's start-up (torch._dynamo, the quantizers, the modeling utilities)."""
    importlib.import_module("transformers.modeling_utils")
    if diffusers:
        importlib.import_module("diffusers.models.modeling_utils")
        importlib.import_module("diffusers.pipelines.pipeline_utils")


R = TypeVar("R")


def live_rows(active: list[Any], ctx: ExecuteContext) -> list[int]:
    """The batch positions of the decoding rows still running: a row whose request was aborted
    is marked done with its error first (a row has ``request_id``, ``done`` and ``error``), so a
    token loop drops it before paying for its next forward."""
    for row in active:
        if ctx.is_aborted(row.request_id):
            row.done, row.error = True, RequestAbortedError(f"request {row.request_id} aborted")
    return [b for b, row in enumerate(active) if not row.done]


def wave_rows(batch: list[RunnerRequest], new_row: Callable[[int, RunnerRequest], R]) -> tuple[list[Any], list[R]]:
    """Each request's decoding row (``new_row(index, request)``), and an output list with the
    error of each request whose row was refused (InvalidRequestError): that request alone fails,
    the wave goes on. The other slots are None, for the caller to fill."""
    outputs: list[Any] = [None] * len(batch)
    rows: list[R] = []
    for i, req in enumerate(batch):
        try:
            rows.append(new_row(i, req))
        except InvalidRequestError as e:
            outputs[i] = RunnerOutput(error=e)
    return outputs, rows


class TransformersRunner(StageRunner):
    """A runner of one transformers model and its tokenizer: asleep, both are dropped and their
    memory released; awake again, :meth:`load` reads them back."""

    model: Any = None
    tokenizer: Any = None

    @classmethod
    def preload(cls, stage: StageConfig) -> None:
        import_model_libraries(diffusers=False)

    def profile_request(self) -> RunnerRequest:
        """A short prompt at the stage's defaults (its every request shares one batch key)."""
        return self._default_request("Hello, how are you today?")

    def sleep(self) -> dict[str, Any]:
        self.model = self.tokenizer = None
        return release_memory()

    def wake_up(self) -> dict[str, Any]:
        if self.model is None:
            self.load()
        return {"reloaded": True}
