"""Runners for the multi-stage tests, named in configs as ``module:Class`` so they run in real
stage processes: a source that injects a tensor of a requested size at the first stage."""

from __future__ import annotations

from typing import ClassVar

import msgspec
import numpy as np

from omni_runtime.params import EchoSamplingParams
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from tests.helpers import FlakyRunner


class TensorParams(EchoSamplingParams):
    """Echo params plus the tensor the source makes: ``nbytes`` of float32, as torch or numpy."""

    nbytes: int | None = None
    torch: bool | None = None
    #: Added to every element, so each request's tensor is its own.
    fill: float | None = None


class TensorSourceRunner(FlakyRunner):
    """FlakyRunner (``poison`` raises, ``crash`` exits, ``hang`` blocks) that also returns
    ``tensors["payload"]``: ``arange(nbytes / 4) + fill`` as float32."""

    params_cls: ClassVar[type[msgspec.Struct]] = TensorParams

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        outputs = super().execute(batch, ctx)
        for req, out in zip(batch, outputs, strict=True):
            nbytes = req.params.nbytes
            if out.error is None and nbytes:
                out.tensors["payload"] = payload(nbytes, req.params.fill or 0.0, bool(req.params.torch))
        return outputs


def payload(nbytes: int, fill: float = 0.0, as_torch: bool = False):
    arr = np.arange(nbytes // 4, dtype=np.float32) + np.float32(fill)
    if as_torch:
        import torch

        return torch.from_numpy(arr)
    return arr
