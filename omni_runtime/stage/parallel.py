"""What a rank of a multi-device diffusion stage does to its loaded pipeline (``runtime.parallel``).

Every rank of a group loads the same pipeline and runs the same calls in lock step
(:mod:`omni_runtime.stage.rank_group`); this module makes those calls share the work:

* **Ulysses / ring** (sequence parallelism): diffusers' own ``enable_parallelism`` on the
  denoiser, for the families whose transformer declares a context-parallel plan (Flux, Wan,
  LTX). Each rank attends over its share of the tokens' heads; diffusers gathers the output,
  so every rank holds the whole result after each call.
* **CFG-parallel** (written here: diffusers has none): the denoiser call's batch rows are split
  between the ranks, each runs its share, and one ``all_gather`` per call gives every rank the
  whole output. A guided step's batch is the unconditional rows, then the conditional ones: with
  two ranks, one runs the first half and the other the second, and they exchange once per step.
  It works for every family whose pipeline (or step loop) concatenates the two branches, UNets
  (SD, SDXL) as well as transformers (SD3, PixArt, Sana). A call whose rows do not divide
  evenly (no guidance on an odd batch) runs whole on every rank.
* **Both**: the group is a ``(cfg, ring, ulysses)`` device mesh; the rows are split between its
  CFG halves, then each half's tokens among the ranks of that half.

The helpers that split and join rows are pure (tested without a process group).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from omni_runtime.config_types import ParallelConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Keyword arguments of a denoiser call that are not per row however their first dimension reads
#: (position tables of packed latents: one row per token).
NOT_PER_ROW = frozenset({"img_ids", "txt_ids", "image_rotary_emb", "rotary_emb"})


def batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The rows of a denoiser call: the first dimension of its first tensor argument (the latents:
    ``sample`` or ``hidden_states``), or None where there is none."""
    import torch

    first = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
    if isinstance(first, torch.Tensor) and first.ndim >= 1:
        return int(first.shape[0])
    return None


def slice_rows(value: Any, rows: int, lo: int, hi: int) -> Any:
    """``value`` with every tensor of ``rows`` rows cut to rows ``lo:hi``, through tuples, lists
    and mappings (SDXL's ``added_cond_kwargs``); anything else (a scalar timestep, None, a flag)
    as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        return value[lo:hi] if value.ndim >= 1 and value.shape[0] == rows else value
    if isinstance(value, dict):
        return {k: v if k in NOT_PER_ROW else slice_rows(v, rows, lo, hi) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(slice_rows(v, rows, lo, hi) for v in value)
    return value


def join_output(out: Any, gather: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A denoiser's output with its prediction (a tensor, the first item of a tuple, or a
    ``.sample`` field) replaced by ``gather(prediction)``: the whole batch's."""
    import torch

    if isinstance(out, torch.Tensor):
        return gather(out)
    if isinstance(out, tuple):
        return (gather(out[0]), *out[1:])
    if hasattr(out, "sample"):
        out.sample = gather(out.sample)
        return out
    raise TypeError(f"cannot join a denoiser output of type {type(out).__name__}")


def split_rows_forward(module: Any, rank: int, size: int, group: Any = None) -> None:
    """Make ``module``'s forward run only this rank's share of its batch rows and gather the rest
    (CFG-parallel). Every rank must call the module in lock step with the same inputs."""
    import torch
    import torch.distributed as dist

    original = module.forward

    def gather(part: torch.Tensor) -> torch.Tensor:
        part = part.contiguous()
        parts = [torch.empty_like(part) for _ in range(size)]
        dist.all_gather(parts, part, group=group)
        return torch.cat(parts)

    def forward(*args: Any, **kwargs: Any) -> Any:
        rows = batch_rows(args, kwargs)
        if rows is None or rows % size:
            return original(*args, **kwargs)  # the whole call on every rank: same result everywhere
        lo, hi = rank * rows // size, (rank + 1) * rows // size
        out = original(*slice_rows(args, rows, lo, hi), **slice_rows(kwargs, rows, lo, hi))
        return join_output(out, gather)

    module.forward = forward


@contextlib.contextmanager
def _one_device_on_cpu(device: str) -> Iterator[None]:
    """diffusers picks a rank's device as ``rank % torch.accelerator.device_count()``, which is a
    division by zero in a process with no accelerator: there, it is told there is one (the CPU)."""
    import torch

    if not device.startswith("cpu") or torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def denoiser_of(pipe: Any) -> tuple[str, Any]:
    """The pipeline's denoiser and its attribute name (``transformer`` or ``unet``)."""
    for name in ("transformer", "unet"):
        module = getattr(pipe, name, None)
        if module is not None:
            return name, module
    raise ValueError(f"{type(pipe).__name__} has no transformer or unet to run in parallel")


#: This process's device mesh, made once (making one is a collective every rank joins in step).
_MESHES: dict[tuple[int, int, int], Any] = {}


def group_mesh(parallel: ParallelConfig, device: str) -> Any:
    """The group's ranks as a ``(cfg, ring, ulysses)`` device mesh: rank ``r`` is in CFG half
    ``r // (ring x ulysses)``, and the ranks of one half share its sequence."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (parallel.cfg_parallel_size, parallel.ring_degree, parallel.ulysses_degree)
    if shape not in _MESHES:
        kind = "cuda" if device.startswith("cuda") else "cpu"
        _MESHES[shape] = init_device_mesh(kind, shape, mesh_dim_names=("cfg", "ring", "ulysses"))
    return _MESHES[shape]


def apply_parallelism(pipe: Any, parallel: ParallelConfig, device: str) -> str:
    """Make this rank's loaded ``pipe`` share its denoiser calls with the other ranks (the process
    group is initialised). Returns what was applied, for the log. ValueError where the model
    cannot: a denoiser with no context-parallel plan asked for Ulysses or ring."""
    name, denoiser = denoiser_of(pipe)
    sequence = parallel.ulysses_degree * parallel.ring_degree
    if sequence > 1 and getattr(denoiser, "_cp_plan", None) is None:
        raise ValueError(
            f"{type(denoiser).__name__} declares no context-parallel plan: ulysses_degree and ring_degree "
            "need a transformer that does (Flux, Wan, LTX); use cfg_parallel_size"
        )
    if parallel.world_size == 1:
        return "nothing (world size 1)"
    applied = []
    with _one_device_on_cpu(device):
        mesh = group_mesh(parallel, device)
        if sequence > 1:
            from diffusers import ContextParallelConfig

            config = ContextParallelConfig(
                ulysses_degree=parallel.ulysses_degree, ring_degree=parallel.ring_degree, mesh=mesh
            )
            denoiser.enable_parallelism(config=config)
            applied.append(f"ulysses {parallel.ulysses_degree} x ring {parallel.ring_degree}")
    if parallel.cfg_parallel_size > 1:
        # Outermost: the rows are split first, then each half's tokens among its ranks.
        halves = mesh["cfg"]
        split_rows_forward(denoiser, halves.get_local_rank(), parallel.cfg_parallel_size, halves.get_group())
        applied.append(f"cfg-parallel {parallel.cfg_parallel_size}")
    return f"{name}: " + " + ".join(applied)
