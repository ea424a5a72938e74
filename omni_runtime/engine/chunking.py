"""Chunkers: an upstream stage's streamed output cut into the chunks a chunked stage takes.

Pure (no I/O, no clock): the orchestrator feeds a request's upstream deltas in (:meth:`Chunker.feed`)
and takes ready chunks out; :meth:`Chunker.finish` hands what is left as the last chunk. Used in the
orchestrator thread, one chunker per request and chunked edge.

The convention every streaming upstream follows (text and tensors alike): a partial output holds
only what is NEW since the previous one — a text delta, or arrays of the new items along axis 0 —
and the final output holds the whole. A chunk of tensors is the concatenation of its deltas' items
along axis 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import numpy as np

from omni_runtime.config import InputChunking
from omni_runtime.media import AudioItem, MediaItem
from omni_runtime.messages import Payload, StageMetrics

#: Where a sentence (or a clause worth speaking on its own) ends: its punctuation, then a space.
_SENTENCE_END = re.compile(r"[.!?;:\u3002\uff01\uff1f]+[\"')\]]*\s|\n")


@dataclass
class Chunk:
    """One chunk of one request's upstream output."""

    index: int
    last: bool
    text: str | None = None
    tensors: dict[str, Any] = field(default_factory=dict)


class Chunker:
    """Cuts one request's upstream deltas into chunks by an :class:`InputChunking` policy.

    A cut is handed on once something more (a speakable character, an item) follows it, or when
    the upstream finishes: so ``last`` is exact — the last chunk is the one that says so, and no
    empty chunk follows it — at the price of one upstream delta of delay.
    """

    def __init__(self, policy: InputChunking) -> None:
        self.policy = policy
        self._text = ""  # text not yet cut
        self._deltas = 0  # text deltas in ``_text`` (``tokens``)
        self._tensors: dict[str, list[Any]] = {}  # per name: deltas not yet cut
        self._held: Chunk | None = None  # the newest cut, until something follows it
        self._cuts = 0  # cuts made (held or handed on): the first is ``first_size``
        self._count = 0
        self.finished = False

    def _size(self) -> int:
        """Words, deltas or items of the next cut."""
        first = self.policy.first_size
        return first if first is not None and self._cuts == 0 else self.policy.size

    @property
    def chunks_made(self) -> int:
        """Chunks handed on so far."""
        return self._count

    def feed(self, text: str | None = None, tensors: dict[str, Any] | None = None) -> list[Chunk]:
        """Take one upstream delta; the chunks it completes, in order."""
        if self.finished:
            raise ValueError("the chunker is finished")
        cuts: list[Chunk] = []
        if self.policy.policy == "items":
            for name, value in (tensors or {}).items():
                self._tensors.setdefault(name, []).append(np.asarray(value))
            cuts = self._cut_items()
            pending = any(_items(p) for p in self._tensors.values())
        else:
            if text:
                self._text += text
                self._deltas += 1
            cuts = self._cut_text()
            pending = _speakable(self._text)
        return self._release(cuts, pending)

    def finish(self) -> list[Chunk]:
        """The upstream is done: the chunks still held, the last marked ``last``. A request
        whose upstream made nothing at all gets one empty last chunk."""
        if self.finished:
            return []
        self.finished = True
        rest: Chunk | None = None
        if self.policy.policy == "items":
            if any(_items(p) for p in self._tensors.values()):
                rest = Chunk(0, False, tensors={n: _concat(p) for n, p in self._tensors.items()})
            self._tensors = {}
        else:
            if _speakable(self._text) or self._held is None:
                rest = Chunk(0, False, text=self._text)
            elif self._held is not None:
                self._held.text = (self._held.text or "") + self._text  # trailing punctuation
            self._text, self._deltas = "", 0
        queue = ([self._held] if self._held is not None else []) + ([rest] if rest is not None else [])
        self._held = None
        if not queue:  # an items upstream that made nothing
            queue = [Chunk(0, False)]
        queue[-1].last = True
        for chunk in queue:
            chunk.index = self._count
            self._count += 1
        return queue

    def _release(self, cuts: list[Chunk], pending: bool) -> list[Chunk]:
        """Hand on the held cut and ``cuts`` but the newest, which waits for what follows it
        (``pending``: something already does)."""
        queue = ([self._held] if self._held is not None else []) + cuts
        self._held = None
        if queue and not pending and not queue[-1].last:
            self._held = queue.pop()
        for chunk in queue:
            chunk.index = self._count
            self._count += 1
        return queue

    # ------------------------------------------------------------------ text

    def _cut_text(self) -> list[Chunk]:
        out: list[Chunk] = []
        if self.policy.policy == "tokens":
            # Every ``size`` deltas, with something speakable in it (punctuation or spaces alone
            # wait for the next words).
            if self._deltas >= self._size() and _speakable(self._text):
                out.append(self._take_text(len(self._text)))
            return out
        while True:
            cut = self._sentence_cut(self._size())
            if cut is None:
                return out
            out.append(self._take_text(cut))

    def _sentence_cut(self, words: int) -> int | None:
        """Where the next sentence chunk of the pending text ends, or None if it is not ready."""
        for m in _SENTENCE_END.finditer(self._text):
            if _speakable(self._text[: m.end()]):
                return m.end()
        # No sentence end yet: cut after ``words`` whole words (a word is whole once a space follows).
        spans = [m.end() for m in re.finditer(r"\S+\s", self._text)]
        if len(spans) >= words and _speakable(self._text[: spans[words - 1]]):
            return spans[words - 1]
        return None

    def _take_text(self, end: int) -> Chunk:
        text, self._text = self._text[:end], self._text[end:]
        self._deltas = 0
        self._cuts += 1
        return Chunk(0, False, text=text)

    # ------------------------------------------------------------------ tensors

    def _cut_items(self) -> list[Chunk]:
        out: list[Chunk] = []
        while self._tensors and all(_items(parts) >= self._size() for parts in self._tensors.values()):
            size = self._size()
            tensors = {}
            for name, parts in self._tensors.items():
                whole = _concat(parts)
                tensors[name] = whole[:size]
                self._tensors[name] = [whole[size:]] if len(whole) > size else []
            out.append(Chunk(0, False, tensors=tensors))
            self._cuts += 1
        return out


def _speakable(text: str) -> bool:
    return any(c.isalnum() for c in text)


def _items(parts: list[Any]) -> int:
    return sum(len(p) for p in parts)


def _concat(parts: list[Any]) -> Any:
    if not parts:
        return np.zeros((0,), dtype=np.float32)
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def join_outputs(pieces: list[Payload]) -> Payload:
    """A chunked stage's whole output from its chunks' outputs, in chunk order: the texts joined,
    each array concatenated along axis 0, and the audio clips joined into one clip (the chunks'
    clips end to end; other media listed in order; a scalar, the last chunk's). Metrics are the last chunk's, with the
    counts summed over the chunks (``execution_ms``, tokens, ``audio_samples``) and ``chunks``."""
    texts = [p.text for p in pieces if p.text is not None]
    media: list[MediaItem] = [m for p in pieces for m in p.media]
    clips = [m for m in media if isinstance(m, AudioItem)]
    if clips and len(clips) == len(media) and len({(c.sample_rate, c.channels) for c in clips}) == 1:
        data = np.concatenate([c.samples for c in clips], axis=1)
        media = [AudioItem(data=data, sample_rate=clips[0].sample_rate, seed=clips[0].seed)]
    tensors: dict[str, Any] = {}
    for name in dict.fromkeys(n for p in pieces for n in p.tensors):
        values = [np.asarray(p.tensors[name]) for p in pieces if name in p.tensors]
        # Arrays of items join along axis 0; a scalar (a chunk's ``chunk_index``) stays the last's.
        tensors[name] = _concat(values) if all(v.ndim >= 1 for v in values) else values[-1]
    return Payload(
        text="".join(texts) if texts else None,
        media=media,
        tensors=tensors,
        metrics=_joined_metrics([p.metrics for p in pieces]) if pieces else StageMetrics(),
    )


#: Runner metrics that count what a chunk made (tokens, samples, codec codes, frames): a chunked
#: stage's joined output reports their sum; any other runner metric is the last chunk's.
SUMMED_METRICS = ("_tokens", "_samples", "codes", "frames")


def _joined_metrics(all_metrics: list[StageMetrics]) -> StageMetrics:
    last = all_metrics[-1]
    extra = dict(last.extra)
    for key in {k for m in all_metrics for k in m.extra}:
        values = [m.extra.get(key) for m in all_metrics]
        if key.endswith(SUMMED_METRICS) and all(isinstance(v, int) for v in values):
            extra[key] = sum(cast(list[int], values))
    extra["chunks"] = len(all_metrics)
    executions = [m.execution_ms for m in all_metrics if m.execution_ms is not None]
    return msgspec.structs.replace(
        last,
        execution_ms=sum(executions) if executions else None,
        prompt_tokens=_sum_of([m.prompt_tokens for m in all_metrics]),
        completion_tokens=_sum_of([m.completion_tokens for m in all_metrics]),
        extra=extra,
    )


def _sum_of(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None
