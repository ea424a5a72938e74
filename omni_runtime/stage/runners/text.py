"""The ``text`` stage: batched autoregressive generation with a causal LM.

Runs in the stage worker's executor thread. One ``execute()`` decodes a whole wave of requests
together (left-padded, one KV cache), but every row keeps its own sampling params and its own
``torch.Generator``, so a request's text does not depend on what it was batched with. Text is
streamed as deltas after every step through ``ExecuteContext.emit``.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, cast

import msgspec
import torch

from omni_runtime.checks import check_prompt_tokens
from omni_runtime.exceptions import (
    InvalidRequestError,
    StageAsleepError,
)
from omni_runtime.messages import StageConstraints, TextBound
from omni_runtime.models.builtin import resolve_model
from omni_runtime.params import TextSamplingParams, in_force
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StepResult
from omni_runtime.stage.runners.text_steps import TextSteps
from omni_runtime.stage.runners.torch_common import TransformersRunner, live_rows, wave_rows

#: Prompt tokens kept in front of the generated ones when detokenizing, so that tokenizers whose
#: decoding depends on the left context (e.g. a leading-space marker) decode the first token right.
_DETOKENIZE_CONTEXT = 5

#: The Unicode normalizations whose effect on a prompt's bytes :class:`TextBound` computes.
_NORMALIZATIONS = ("NFC", "NFD", "NFKC", "NFKD")


def _pre_tokenizers(spec: Any) -> list[str]:
    """The types of a tokenizer.json pre-tokenizer and of those of a sequence of them."""
    if not isinstance(spec, dict):
        return []
    return [spec.get("type", ""), *(t for p in spec.get("pretokenizers") or [] for t in _pre_tokenizers(p))]


def prompt_token_bound(tokenizer: Any) -> dict[str, Any]:
    """What bounds the tokens ``tokenizer`` makes of a text from below (the fields of
    :class:`~omni_runtime.messages.TextBound` but the lengths): given for a byte-level BPE only,
    whose tokens each stand for a run of at most ``bytes_per_token`` bytes of the (normalized) text
    and together for all of it, and whose special tokens are plain ASCII and take no spaces beside
    them; anything else (another model, a normalizer that drops or folds characters) gives no bound
    (``bytes_per_token`` None) and the stage alone checks."""
    extra = len(tokenizer("")["input_ids"])
    none: dict[str, Any] = {"extra_tokens": extra}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return none
    spec = json.loads(backend.to_str())
    model, normalizer = spec.get("model") or {}, spec.get("normalizer")
    if model.get("type") != "BPE" or "ByteLevel" not in _pre_tokenizers(spec.get("pre_tokenizer")):
        return none
    form = normalizer.get("type") if isinstance(normalizer, dict) else None
    if normalizer is not None and form not in _NORMALIZATIONS:
        return none
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return none  # such a token takes the spaces beside it too
    if not all(t.get("content", "").isascii() for t in added):
        return none
    # A byte-level vocabulary spells each byte as one character.
    longest = max((len(token) for token in model.get("vocab") or {}), default=0)
    if longest < 1:
        return none
    return {
        "bytes_per_token": longest,
        "normalization": form,
        "special_tokens": tuple(sorted({t["content"] for t in added if t.get("content")})),
        "extra_tokens": extra,
    }


class _Detokenizer:
    """Turns a growing token list into text deltas, holding back incomplete characters.

    Decodes only a small window: ``tokens[prefix:read]`` is text already returned, used as context;
    the delta is what ``tokens[prefix:]`` adds to it. A window ending in U+FFFD is a multi-byte
    character cut in half, so it waits for the next token.
    """

    def __init__(self, tokenizer: Any, context: list[int]) -> None:
        self.tokenizer = tokenizer
        self.tokens = list(context)
        self.prefix = 0
        self.read = len(self.tokens)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int, final: bool = False) -> str:
        if token >= 0:
            self.tokens.append(token)
        seen = self._decode(self.tokens[self.prefix : self.read])
        text = self._decode(self.tokens[self.prefix :])
        if len(text) <= len(seen) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return text[len(seen) :]


@dataclass
class _Row:
    """Decoding state of one request of the wave."""

    index: int
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    seed: int
    generator: torch.Generator
    detok: _Detokenizer
    completion_tokens: int = 0
    text: str = ""
    emitted: int = 0
    done: bool = False
    error: BaseException | None = None
    held: int = field(default=0, repr=False)  # trailing chars that may start a stop string

    def add_text(self, delta: str) -> None:
        """Append a delta; cut before the first stop string, or hold back a possible start of one."""
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += delta
        cuts = [i for i in (self.text.find(s, start) for s in self.stop if s) if i >= 0]
        if cuts:
            self.text, self.done, self.held = self.text[: min(cuts)], True, 0
            return
        # A tail that might be the beginning of a stop string is not streamed until it is not.
        self.held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), self.held, -1):
                if self.text.endswith(s[:n]):
                    self.held = n
                    break


class TextRunner(TransformersRunner):
    """Text generation with any local causal LM (``AutoModelForCausalLM``) and its tokenizer."""

    params_cls: ClassVar[type[msgspec.Struct]] = TextSamplingParams
    needs_model = True
    #: Token-level decode state (``engine_args.step_execution``): per-request caches between tokens.
    _steps: TextSteps | None = None

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        assert self.stage.model is not None  # needs_model: checked when the config is resolved
        path = resolve_model(self.stage.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # Batched generation appends on the right, so prompts are aligned on the left padding.
        self.tokenizer.padding_side = "left"
        dtype = getattr(torch, self.stage.engine_args.dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.model = model.to(self.device).eval()
        self._read_decoding_settings()
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)

    @cached_property
    def text_bound(self) -> TextBound:
        """The READY bound of a request's tokens: the model's context, ``engine_args.max_output_tokens``
        and what bounds a prompt's tokens from its text (the tokenizer, read once)."""
        return TextBound(
            context=self.max_positions or None,
            max_tokens=self.stage.engine_args.max_output_tokens,
            **prompt_token_bound(self.tokenizer),
        )

    def constraints(self) -> StageConstraints:
        return StageConstraints(text=self.text_bound)

    def _read_decoding_settings(self) -> None:
        """End, pad and start ids and the suppressed tokens, from the loaded model's generation
        config and tokenizer."""
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)
        # A row needs at least one token to condition on; an empty prompt starts from BOS (or EOS).
        bos = self.tokenizer.bos_token_id
        self.start_id = bos if bos is not None else min(self.eos_ids, default=self.pad_id)
        self.suppress = torch.tensor(list(gen.suppress_tokens or []), dtype=torch.long, device=self.device)

    def batch_key(self, request: RunnerRequest) -> tuple[()]:
        return ()  # params are applied per row, so every text request can join a wave

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        started = time.perf_counter()
        if self.model is None:
            return [RunnerOutput(error=StageAsleepError("the text stage is asleep")) for _ in batch]
        outputs, rows = wave_rows(batch, self._new_row)
        if rows:
            self._generate(rows, ctx)
        elapsed_ms = (time.perf_counter() - started) * 1000
        for row in rows:
            # An aborted row's text is what it streamed; otherwise the whole (stop-cut) text.
            outputs[row.index] = RunnerOutput(
                text=row.text[: row.emitted] if row.error else row.text,
                error=row.error,
                metrics={
                    "seed": row.seed,
                    "batch_size": len(batch),
                    "execution_ms": elapsed_ms,
                    "prompt_tokens": len(row.prompt_ids),
                    "completion_tokens": row.completion_tokens,
                },
            )
        return cast(list[RunnerOutput], outputs)  # every slot is filled above

    def _new_row(self, index: int, req: RunnerRequest[TextSamplingParams]) -> _Row:
        if not isinstance(req.prompt, str):
            raise InvalidRequestError(
                f"a text stage takes a string prompt, got {type(req.prompt).__name__}", param="prompt"
            )
        bound = self.text_bound
        p = req.params
        max_tokens = in_force(p.max_tokens)
        prompt_ids = self.tokenizer(req.prompt)["input_ids"] or [self.start_id]
        # The exact check; the caller's counted the fewest tokens the prompt could make.
        check_prompt_tokens(len(prompt_ids), max_tokens, bound, f"the prompt ({len(prompt_ids)} tokens)")
        # A fresh seed is drawn when none is given, and reported, so any result can be replayed.
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        return _Row(
            index=index,
            request_id=req.request_id,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            temperature=in_force(p.temperature),
            top_p=in_force(p.top_p),
            top_k=in_force(p.top_k),
            stop=list(in_force(p.stop)),
            seed=seed,
            generator=torch.Generator(device=self.device).manual_seed(seed),
            detok=_Detokenizer(self.tokenizer, prompt_ids[-_DETOKENIZE_CONTEXT:]),
        )

    @torch.inference_mode()
    def _generate(self, rows: list[_Row], ctx: ExecuteContext) -> None:
        # Left-pad the prompts into one batch. Positions count real tokens only, so a padded row
        # sees exactly the positions (and, masked, exactly the keys) of its solo run. What remains
        # is float round-off from other matmul shapes (~1e-5 in the logits on CPU): a row's pick
        # changes only on a near-tie that close, so batched texts equal solo ones in practice, and
        # repeating the same batch is bitwise reproducible.
        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            mask[b, width - len(row.prompt_ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = None
        active = list(rows)  # rows still in the batch, in batch order
        while active:
            # 1) drop aborted rows before paying for their forward
            keep = live_rows(active, ctx)
            if not keep:
                break
            # 2) shrink the batch to the live rows (cache included) so finished rows cost nothing
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=self.device)
                active = [active[b] for b in keep]
                input_ids, mask, positions = input_ids[idx], mask[idx], positions[idx]
                if cache is not None:
                    cache.batch_select_indices(idx)
            # 3) one forward: the whole prompt first, then one token per row against the cache
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            if self.suppress.numel():
                logits[:, self.suppress] = float("-inf")
            # 4) pick each row's token with its own params and generator; detokenize, stop, stream
            next_ids = []
            for b, row in enumerate(active):
                token = self._pick(logits[b], row)
                next_ids.append(token)
                row.completion_tokens += 1
                finished = token in self.eos_ids or row.completion_tokens >= row.max_tokens
                row.add_text(row.detok.add(-1 if token in self.eos_ids else token, final=finished))
                row.done = row.done or finished
                end = len(row.text) if row.done else len(row.text) - row.held
                if end > row.emitted:
                    ctx.emit(row.request_id, RunnerOutput(text=row.text[row.emitted : end]))
                    row.emitted = end
            # 5) next input: the picked tokens, one position further
            input_ids = torch.tensor(next_ids, device=self.device).unsqueeze(1)
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)

    @staticmethod
    def _pick(logits: torch.Tensor, row: _Row) -> int:
        """The next token of one row: greedy at temperature 0, else sampled from top-k / top-p."""
        if row.temperature == 0:
            return int(logits.argmax())
        logits = logits / row.temperature
        if 0 < row.top_k < logits.numel():
            logits[logits < torch.topk(logits, row.top_k).values[-1]] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if row.top_p < 1.0:
            # Keep the smallest set of most likely tokens whose mass reaches top_p.
            sorted_probs, order = torch.sort(probs, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= row.top_p
            probs[order[drop]] = 0.0
        # argmax(p / E) with E ~ Exp(1) is a sample from p. It draws exactly one number per vocab
        # entry from the row's own generator each step, so the stream of draws, and the text,
        # is the same whatever the row is batched with.
        noise = torch.empty_like(probs).exponential_(generator=row.generator)
        return int((probs / noise).argmax())

    # ------------------------------------------------------------------ token-level batching

    @property
    def steps(self) -> TextSteps:
        if self._steps is None:
            self._steps = TextSteps(self)
        return self._steps

    def step_support(self) -> str | None:
        return self.steps.support()

    def step_key(self, request: RunnerRequest) -> tuple[()]:
        return ()  # one token of any request can be decoded with one of any other

    def step_admit(self, requests: list[RunnerRequest], ctx: ExecuteContext) -> dict[str, RunnerOutput]:
        return self.steps.admit(requests)

    def step_run(self, request_ids: list[str], ctx: ExecuteContext) -> dict[str, StepResult]:
        return self.steps.step(request_ids, ctx)

    def step_drop(self, request_ids: list[str]) -> None:
        self.steps.drop(request_ids)

    def sleep(self) -> dict[str, Any]:
        self.steps.clear()  # the caches are the model's: they go with it
        return super().sleep()
