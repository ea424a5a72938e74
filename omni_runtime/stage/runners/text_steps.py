"""Token-level continuous batching for the ``text`` stage: one step is one token of every running request.

With ``engine_args.step_execution`` the stage worker drives the decode loop (see
:mod:`omni_runtime.stage.step_scheduler`): between two tokens a request may join (its prompt is
prefilled, batched with the others joining with it), leave (max_tokens, EOS, a stop string, or an
abort), or pause (a request of higher priority took its slot).

Each request owns its KV cache (one key and one value tensor per layer, only its real tokens). The
requests that decode together are one :class:`_Group`: their caches left-padded to a common width in
one ``DynamicCache``, with an attention mask that hides the padding and position ids that count real
tokens only, as the request-level wave does. The group is kept from token to token while its members
stay the same, shrunk in place when some leave, and rebuilt from the per-request caches only when a
request joins or resumes. A request's last picked token is not yet in its cache: the next step feeds
it, so every step is one uniform forward of one token per request.

Sampling stays per request (its own params and ``torch.Generator``, :meth:`TextRunner._pick`), so a
request's text does not depend on the batch it decodes in, up to float round-off of other matmul
shapes (~1e-5 in the logits on CPU), which changes a pick only on a near-tie that close.

Runs in the stage worker's forward thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from omni_runtime.exceptions import InvalidRequestError, StageAsleepError
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StepResult

if TYPE_CHECKING:
    from omni_runtime.stage.runners.text import TextRunner, _Row


@dataclass(eq=False)
class TextStepState:
    """One request's decoding state between tokens."""

    row: _Row
    #: Per layer, the request's cached keys and values (``1 x heads x length x dim``); empty while
    #: the request is a member of the running group (its cache lives there then).
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    #: Tokens in the cache: also the position of ``pending``.
    length: int = 0
    #: The token the next step feeds (the prompt's last, then each picked one).
    pending: int = 0


@dataclass(eq=False)
class _Group:
    """The requests that decoded the last token together, their caches padded into one."""

    ids: list[str]
    cache: Any  # a transformers DynamicCache, or None while every member's cache is empty
    #: ``batch x width``: 1 where the cache holds a real token of that row.
    mask: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])


def cache_tensors(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-layer key and value tensors of a DynamicCache of plain full-attention layers."""
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def plain_cache_reason(cache: Any) -> str | None:
    """None if ``cache`` is a DynamicCache whose layers all hold full-attention ``batch x heads x
    length x dim`` keys and values (what the group padding needs), else why not."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache:
        return f"the model's cache is a {type(cache).__name__}, not a DynamicCache"
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if kinds:
        return f"the model's cache has {', '.join(sorted(kinds))} layers (only full attention is padded per token)"
    return None


class TextSteps:
    """The token-level decode state of one :class:`TextRunner`: per-request caches and the running group."""

    def __init__(self, runner: TextRunner) -> None:
        self.runner = runner
        self.states: dict[str, TextStepState] = {}
        self.group: _Group | None = None

    @property
    def device(self) -> str:
        return self.runner.device

    def clear(self) -> None:
        """Forget every request (the model is going away)."""
        self.states.clear()
        self.group = None

    # ------------------------------------------------------------------ support

    @torch.inference_mode()
    def support(self) -> str | None:
        """None if the loaded model's cache can be padded per token, else why not."""
        model = self.runner.model
        if model is None:
            return "the text stage is asleep"
        ids = torch.tensor([[self.runner.start_id]], device=self.device)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return plain_cache_reason(out.past_key_values)

    # ------------------------------------------------------------------ admit

    def admit(self, requests: list[RunnerRequest]) -> dict[str, RunnerOutput]:
        """Make a state for each request and prefill their prompts (all but the last token) in one
        left-padded forward. Returns the error of each request that cannot start."""
        if self.runner.model is None:
            err = StageAsleepError("the text stage is asleep")
            return {r.request_id: RunnerOutput(error=err) for r in requests}
        failed: dict[str, RunnerOutput] = {}
        new: list[TextStepState] = []
        for req in requests:
            try:
                row = self.runner._new_row(0, req)
            except InvalidRequestError as e:  # this request alone fails
                failed[req.request_id] = RunnerOutput(error=e)
                continue
            state = TextStepState(row=row, pending=row.prompt_ids[-1])
            self.states[req.request_id] = state
            new.append(state)
        self._prefill([s for s in new if len(s.row.prompt_ids) > 1])
        return failed

    @torch.inference_mode()
    def _prefill(self, states: list[TextStepState]) -> None:
        if not states:
            return
        prompts = [s.row.prompt_ids[:-1] for s in states]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(states), width), self.runner.pad_id, dtype=torch.long)
        mask = torch.zeros((len(states), width), dtype=torch.long)
        for b, p in enumerate(prompts):
            input_ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        out = self.runner.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
        )
        keys, values = cache_tensors(out.past_key_values)
        for b, (state, p) in enumerate(zip(states, prompts, strict=True)):
            state.length = len(p)
            cut = slice(width - len(p), width)
            state.keys = [k[b : b + 1, :, cut].clone() for k in keys]
            state.values = [v[b : b + 1, :, cut].clone() for v in values]

    # ------------------------------------------------------------------ one token

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    @torch.inference_mode()
    def step(self, request_ids: list[str], ctx: ExecuteContext) -> dict[str, StepResult]:
        """One token for every request of ``request_ids`` that is live: 1) the group becomes exactly
        these requests  2) one forward of their pending tokens  3) each picks its token with its own
        params and generator, streams its text, and leaves when done."""
        runner = self.runner
        if runner.model is None:
            raise StageAsleepError("the text stage is asleep")
        # An aborted request is skipped: it leaves with the next plan, which drops its state.
        ids = [rid for rid in request_ids if rid in self.states and not ctx.is_aborted(rid)]
        if not ids:
            return {}
        # 1) the group
        group = self._regroup(ids)
        states = [self.states[rid] for rid in ids]
        mask = torch.cat([group.mask, group.mask.new_ones((len(ids), 1))], dim=1)
        # 2) one forward
        out = runner.model(
            input_ids=torch.tensor([[s.pending] for s in states], device=self.device),
            attention_mask=mask,
            position_ids=torch.tensor([[s.length] for s in states], device=self.device),
            past_key_values=group.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        group.cache, group.mask = out.past_key_values, mask
        logits = out.logits[:, -1, :].float()
        if runner.suppress.numel():
            logits[:, runner.suppress] = float("-inf")
        # 3) pick, stream, finish
        results: dict[str, StepResult] = {}
        for b, (rid, state) in enumerate(zip(ids, states, strict=True)):
            row = state.row
            token = runner._pick(logits[b], row)
            state.length += 1
            state.pending = token
            row.completion_tokens += 1
            finished = token in runner.eos_ids or row.completion_tokens >= row.max_tokens
            row.add_text(row.detok.add(-1 if token in runner.eos_ids else token, final=finished))
            row.done = row.done or finished
            end = len(row.text) if row.done else len(row.text) - row.held
            if end > row.emitted:
                ctx.emit(rid, RunnerOutput(text=row.text[row.emitted : end]))
                row.emitted = end
            result = StepResult(step=row.completion_tokens, steps=row.max_tokens)
            if row.done:
                result.output = RunnerOutput(
                    text=row.text,
                    metrics={
                        "seed": row.seed,
                        "prompt_tokens": len(row.prompt_ids),
                        "completion_tokens": row.completion_tokens,
                    },
                )
                del self.states[rid]
            results[rid] = result
        return results

    # ------------------------------------------------------------------ the group

    def _regroup(self, ids: list[str]) -> _Group:
        """The group of exactly ``ids`` (in order): the current one as is, shrunk when only some of
        its members left, or rebuilt from the per-request caches when anyone joins or resumes."""
        group = self.group
        if group is not None and group.ids == ids:
            return group
        if group is not None and _is_subsequence(ids, group.ids):
            self.group = self._shrink(group, ids)
            return self.group
        if group is not None:
            self._split(group, group.ids)
        self.group = self._build(ids)
        return self.group

    def _shrink(self, group: _Group, ids: list[str]) -> _Group:
        # A member left out but still alive (paused) takes its own cache back first.
        kept = set(ids)
        self._split(group, [rid for rid in group.ids if rid not in kept])
        keep = {rid: b for b, rid in enumerate(group.ids)}
        idx = torch.tensor([keep[rid] for rid in ids], device=self.device)
        mask = group.mask[idx]
        # Columns that are padding in every remaining row cost attention for nothing: cut them.
        width = max(self.states[rid].length for rid in ids)
        cut = group.width - width
        mask = mask[:, cut:]
        if group.cache is not None:
            for layer in group.cache.layers:
                layer.keys = layer.keys[idx, :, cut:]
                layer.values = layer.values[idx, :, cut:]
        return _Group(ids=ids, cache=group.cache, mask=mask)

    def _split(self, group: _Group, members: list[str]) -> None:
        """Give each of ``members`` still alive its own cache back (its real tokens only)."""
        if group.cache is None:
            return
        keys, values = cache_tensors(group.cache)
        width = group.width
        for b, rid in enumerate(group.ids):
            state = self.states.get(rid)
            if state is None or rid not in members:  # finished or dropped, or staying
                continue
            cut = slice(width - state.length, width)
            state.keys = [k[b : b + 1, :, cut].clone() for k in keys]
            state.values = [v[b : b + 1, :, cut].clone() for v in values]

    def _build(self, ids: list[str]) -> _Group:
        """Left-pad the members' caches to the longest into one DynamicCache."""
        from transformers.cache_utils import DynamicCache

        states = [self.states[rid] for rid in ids]
        width = max(s.length for s in states)
        mask = torch.zeros((len(ids), width), dtype=torch.long, device=self.device)
        for b, s in enumerate(states):
            mask[b, width - s.length :] = 1
        if width == 0:
            return _Group(ids=ids, cache=None, mask=mask)
        template = next(s for s in states if s.length)
        layers = []
        for n in range(len(template.keys)):
            k0, v0 = template.keys[n], template.values[n]
            k = k0.new_zeros((len(ids), k0.shape[1], width, k0.shape[3]))
            v = v0.new_zeros((len(ids), v0.shape[1], width, v0.shape[3]))
            for b, s in enumerate(states):
                if s.length:
                    k[b, :, width - s.length :] = s.keys[n][0]
                    v[b, :, width - s.length :] = s.values[n][0]
            layers.append((k, v))
        for s in states:  # the group holds them now
            s.keys, s.values = [], []
        return _Group(ids=ids, cache=DynamicCache(layers), mask=mask)


def _is_subsequence(ids: list[str], of: list[str]) -> bool:
    """Whether ``ids`` is ``of`` with some members left out (same order)."""
    it = iter(of)
    return all(rid in it for rid in ids)
