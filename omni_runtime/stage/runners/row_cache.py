"""Step caching per request inside one batched denoiser call, for step execution: first-block
caching and MagCache.

diffusers' cache hooks (``enable_cache`` with ``FirstBlockCacheConfig`` / ``MagCacheConfig``) hold
one state per module: one previous residual and one skip decision for the whole batch. In step
execution a batch mixes requests at different steps, with different settings or none, so that
state would be shared between strangers. diffusers offers no per-row state; this module keeps it
per request instead, with diffusers' own rules:

0) MagCache: each request's accumulated error from its magnitude ratios decides, before any block
   runs, whether it skips the whole step (:class:`RowMagState`);
1) the rows of the requests that do not skip it run the denoiser's first block;
2) each first-block request compares its rows' first-block residual with its own from its last
   full step (mean absolute change over the mean absolute previous residual) against its own
   threshold (:class:`RowCacheState`);
3) only the rows that must recompute run the other blocks, as a sub-batch; the others add what
   the blocks added at their own last full step.

A request's decision depends on its own rows only, so it takes the same steps alone as in any
batch. The state lives in the request's step state and goes with it.

Runs in the stage worker's forward thread, inside the step loop of
:mod:`omni_runtime.stage.runners.diffusion_steps`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

#: Attributes of a denoiser that hold its transformer blocks, in the order they run.
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")


@dataclass(eq=False)
class RowCacheState:
    """One request's first-block cache between its steps (its rows of the denoiser batch, in order)."""

    threshold: float
    #: The first block's hidden-state residual at the last step whose blocks all ran.
    head_residual: torch.Tensor | None = None
    #: What the other blocks added to the first one's output then (hidden states, encoder states).
    tail_residual: tuple[torch.Tensor, torch.Tensor | None] | None = None
    #: Steps taken with and without the other blocks.
    steps_run: int = 0
    steps_skipped: int = 0
    #: Denoiser blocks called for this request, and those that really ran on its rows.
    blocks_called: int = 0
    blocks_run: int = 0


@dataclass(eq=False)
class RowMagState:
    """One request's MagCache between its steps: whole steps skipped (every block, the first too)
    while the change its magnitude ratios predict stays small; diffusers' ``MagCacheConfig`` rule,
    its accumulators kept per request."""

    threshold: float
    max_skip_steps: int
    #: Steps run in full first (diffusers: ``int(retention_ratio * steps + 0.5)``).
    retention_steps: int
    #: The ratio of each of the request's steps (diffusers interpolates them to the step count).
    mag_ratios: list[float]
    step_index: int = 0
    accumulated_ratio: float = 1.0
    accumulated_err: float = 0.0
    accumulated_steps: int = 0
    #: What the blocks added to the first block's input at the last step they ran.
    residual: torch.Tensor | None = None
    steps_run: int = 0
    steps_skipped: int = 0
    blocks_called: int = 0
    blocks_run: int = 0

    def decide(self) -> bool:
        """Whether this step runs the blocks (before any block runs)."""
        compute = True
        if self.step_index >= self.retention_steps:
            scale = self.mag_ratios[self.step_index] if self.step_index < len(self.mag_ratios) else 1.0
            self.accumulated_ratio *= scale
            self.accumulated_steps += 1
            self.accumulated_err += abs(1.0 - self.accumulated_ratio)
            if (
                self.residual is not None
                and self.accumulated_err <= self.threshold
                and self.accumulated_steps <= self.max_skip_steps
            ):
                compute = False
            else:
                self.accumulated_ratio, self.accumulated_steps, self.accumulated_err = 1.0, 0, 0.0
        self.step_index += 1
        if compute:
            self.steps_run += 1
        else:
            self.steps_skipped += 1
        return compute


RowState = RowCacheState | RowMagState


@dataclass(eq=False)
class _Group:
    """One request's rows of a denoiser call; ``state`` None: uncached, always runs. ``whole``:
    the request skips this step's every block (MagCache), its first block too."""

    state: RowState | None
    rows: torch.Tensor
    run: bool = True
    whole: bool = False


class _Call:
    """The groups of one denoiser call and what its first block decided."""

    def __init__(self, groups: list[_Group], batch: int) -> None:
        self.groups = groups
        self.batch = batch
        self.run_rows: torch.Tensor | None = None
        self.head_in: torch.Tensor | None = None
        self.head_out: tuple[torch.Tensor, torch.Tensor | None] | None = None


class _Block:
    """How to read a block's hidden states (and encoder states) from its arguments and output."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.forward: Callable[..., Any] = block.forward
        self.signature = inspect.signature(self.forward)
        from diffusers.hooks._helpers import TransformerBlockRegistry

        meta = TransformerBlockRegistry.get(type(block))
        self.hidden_index: int = meta.return_hidden_states_index
        self.encoder_index: int | None = meta.return_encoder_hidden_states_index

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        return dict(self.signature.bind(*args, **kwargs).arguments)

    def states(self, output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.encoder_index is None:
            return (output[self.hidden_index] if isinstance(output, tuple) else output), None
        return output[self.hidden_index], output[self.encoder_index]

    def output(self, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
        if self.encoder_index is None:
            return hidden
        out: list[Any] = [None, None]
        out[self.hidden_index], out[self.encoder_index] = hidden, encoder
        return tuple(out)


def _rows_of(arguments: dict[str, Any], rows: torch.Tensor, batch: int) -> dict[str, Any]:
    """The arguments of a block call for a sub-batch: per-sample tensors (dim 0 the batch) indexed,
    token positions (rotary embeddings, per token, not per sample) and the rest as they are."""
    out = {}
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch and "rotary" not in name:
            value = value.index_select(0, rows)
        out[name] = value
    return out


def _scatter(full: torch.Tensor, rows: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    out = full.clone()
    out.index_copy_(0, rows, part)
    return out


def _relative_change(now: torch.Tensor, before: torch.Tensor) -> float:
    """diffusers' first-block measure: mean |now - before| / mean |before|."""
    return float((now - before).abs().mean() / before.abs().mean())


class RowStepCache:
    """Per-request first-block caching and MagCache on one denoiser (a transformer with a
    registered block list).

    The blocks' forwards are wrapped at the first cached call and pass through untouched outside
    :meth:`call`. ``count(called, run)`` receives, per block call, how many requests it served and
    for how many the block really ran.
    """

    def __init__(self, module: torch.nn.Module, count: Callable[[int, int], None]) -> None:
        self.module = module
        self.count = count
        self.blocks: list[torch.nn.Module] = [
            b for name in BLOCK_LISTS for b in (getattr(module, name, None) or ()) if isinstance(b, torch.nn.Module)
        ]
        self._installed = False
        self._call: _Call | None = None

    @property
    def active(self) -> bool:
        """Whether a cached denoiser call is under way (its blocks are counted here)."""
        return self._call is not None

    @staticmethod
    def unsupported(module: torch.nn.Module) -> str | None:
        """Why this denoiser cannot cache per request, or None."""
        blocks = [b for name in BLOCK_LISTS for b in (getattr(module, name, None) or ())]
        if len(blocks) < 2:
            return f"{type(module).__name__} has {len(blocks)} transformer block(s); first-block caching needs two"
        from diffusers.hooks._helpers import TransformerBlockRegistry

        for b in {type(b) for b in blocks}:
            try:
                TransformerBlockRegistry.get(b)
            except ValueError:
                return f"diffusers has no block metadata for {b.__name__}"
        return None

    def _install(self) -> None:
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            info = _Block(block)
            role = "head" if i == 0 else "tail" if i == last else "middle"
            # An instance attribute: nn.Module.__call__ reaches it after its own hooks.
            block.forward = self._wrapped(info, role)
        self._installed = True

    @contextmanager
    def call(self, groups: list[tuple[RowState | None, torch.Tensor]], batch: int) -> Iterator[None]:
        """One denoiser call of ``batch`` rows whose groups (a request's rows each) are given."""
        if not self._installed:
            self._install()
        call = _Call([_Group(state, rows) for state, rows in groups], batch)
        # The states as they were: a call that raises is retried request by request (the step
        # loop's isolation), which must start from them, not from a half-taken step.
        saved = [(g.state, copy.copy(g.state)) for g in call.groups if g.state is not None]
        for g in call.groups:  # MagCache decides before any block runs
            if isinstance(g.state, RowMagState):
                g.run = g.state.decide()
                g.whole = not g.run
        self._call = call
        try:
            yield
        except BaseException:
            for state, before in saved:
                vars(state).update(vars(before))
            raise
        finally:
            self._call = None

    def _wrapped(self, block: _Block, role: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = self._call
            if call is None:
                return block.forward(*args, **kwargs)
            if role == "head":
                return self._head(call, block, args, kwargs)
            return self._rest(call, block, role == "tail", args, kwargs)

        return forward

    def _head(self, call: _Call, block: _Block, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        arguments = block.bind(args, kwargs)
        hidden_in: torch.Tensor = arguments["hidden_states"]
        # 1) The first block, for every row but those of requests that skip the whole step.
        whole = [g for g in call.groups if g.whole]
        active = [g.rows for g in call.groups if not g.whole]
        rows = torch.cat(active) if whole and active else None
        hidden, encoder = self._run(call, block, arguments, rows if active else False)
        residual = hidden - hidden_in
        # 2) Each first-block request decides on its own rows, against its own last full step.
        for g in call.groups:
            s = g.state
            if not isinstance(s, RowCacheState):
                continue
            mine = residual.index_select(0, g.rows)
            before = s.head_residual
            g.run = before is None or s.tail_residual is None or _relative_change(mine, before) > s.threshold
            if g.run:
                s.head_residual = mine
                s.steps_run += 1
            else:
                s.steps_skipped += 1
        run = [g.rows for g in call.groups if g.run]
        call.run_rows = torch.cat(run) if run else None
        call.head_in = hidden_in
        call.head_out = (hidden, encoder)
        self._tally(call, [not g.whole for g in call.groups])
        return block.output(hidden, encoder)

    def _tally(self, call: _Call, ran: list[bool]) -> None:
        """One block call: counted for the stage and for each cached request it served."""
        for g, r in zip(call.groups, ran, strict=True):
            if g.state is not None:
                g.state.blocks_called += 1
                g.state.blocks_run += r
        self.count(len(ran), sum(ran))

    @staticmethod
    def _run(
        call: _Call, block: _Block, arguments: dict[str, Any], rows: torch.Tensor | Literal[False] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block on ``rows`` (None: every row; False: none), the other rows passed through."""
        hidden_in: torch.Tensor = arguments["hidden_states"]
        encoder_in: torch.Tensor | None = None
        if block.encoder_index is not None:  # blocks that update the text states too (Flux)
            encoder_in = arguments["encoder_hidden_states"]
        if rows is False:
            return hidden_in, encoder_in
        if rows is None:
            return block.states(block.forward(**arguments))
        part_h, part_e = block.states(block.forward(**_rows_of(arguments, rows, call.batch)))
        hidden = _scatter(hidden_in, rows, part_h)
        encoder = None if part_e is None or encoder_in is None else _scatter(encoder_in, rows, part_e)
        return hidden, encoder

    def _rest(self, call: _Call, block: _Block, tail: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        arguments = block.bind(args, kwargs)
        rows = call.run_rows
        self._tally(call, [g.run for g in call.groups])
        # 3) The rows that recompute run the block (as a sub-batch when some rows skip); the others
        #    pass through and take their cached residual after the last block.
        if rows is None:
            hidden, encoder = self._run(call, block, arguments, False)
        else:
            hidden, encoder = self._run(call, block, arguments, None if rows.numel() == call.batch else rows)
        if tail:
            hidden, encoder = self._finish(call, hidden, encoder)
        return block.output(hidden, encoder)

    @staticmethod
    def _finish(
        call: _Call, hidden: torch.Tensor, encoder: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the last block: cached requests that ran keep what the blocks added; those that
        skipped add what they kept to their first block's output."""
        assert call.head_out is not None and call.head_in is not None
        head_h, head_e = call.head_out
        for g in call.groups:
            s = g.state
            if isinstance(s, RowMagState):
                if g.run:
                    s.residual = hidden.index_select(0, g.rows) - call.head_in.index_select(0, g.rows)
                else:  # the step's input plus what the blocks added last time; text states as they came
                    assert s.residual is not None  # a request skips only once it has one
                    hidden = _scatter(hidden, g.rows, call.head_in.index_select(0, g.rows) + s.residual)
                continue
            if s is None:
                continue
            if g.run:
                tail_e = None
                if encoder is not None and head_e is not None:
                    tail_e = encoder.index_select(0, g.rows) - head_e.index_select(0, g.rows)
                s.tail_residual = (hidden.index_select(0, g.rows) - head_h.index_select(0, g.rows), tail_e)
            else:
                assert s.tail_residual is not None  # a request skips only once it has one
                cached_h, cached_e = s.tail_residual
                hidden = _scatter(hidden, g.rows, head_h.index_select(0, g.rows) + cached_h)
                if encoder is not None and head_e is not None and cached_e is not None:
                    encoder = _scatter(encoder, g.rows, head_e.index_select(0, g.rows) + cached_e)
        return hidden, encoder
