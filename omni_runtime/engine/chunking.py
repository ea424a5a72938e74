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
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import numpy as np

from omni_runtime.config import InputChunking
from omni_runtime.media import AudioItem, MediaItem
from omni_runtime.messages import Payload, StageMetrics

#: What ends a sentence (or a clause worth speaking on its own), and what may close it after.
_MARKS = ".!?;:\u3002\uff01\uff1f"
_CLOSERS = "\"')]"
_M, _C = re.escape(_MARKS), re.escape(_CLOSERS)
#: Where a sentence ends: its marks, closers, then a space; or a newline. A match of the marks
#: that reaches the end of the text is one that the next delta may complete. It starts only at
#: the first mark of a run (a later start in the run would end the same way), so no search
#: passes a run more than once; and it starts with a character class, which the regex engine
#: skips ahead to (five times faster than trying the pattern at every character).
_SENTENCE_END = re.compile(rf"[{_M}\n](?:(?<=\n)|(?<![{_M}][{_M}])[{_M}]*+[{_C}]*+(?:\s|\Z))")
#: The rest of a sentence end that reached the end of the text: more marks and closers, or more
#: closers, as the next delta brings them.
_MORE_MARKS = re.compile(rf"[{_M}]*+[{_C}]*+")
_MORE_CLOSERS = re.compile(rf"[{_C}]*+")
#: Where a word ends: the space after it (the space first: the engine skips ahead to it).
_WORD_END = re.compile(r"\s(?<=\S\s)")
#: What ``str.isalnum`` says of one character (``\w`` is the same, and ``_``).
_ALNUM = re.compile(r"[^\W_]")


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

    Cutting text is linear in the text fed: each scanner (sentence ends, word ends, the first
    letter or digit) keeps where it stopped and goes on from there with the next delta, so no
    character is looked at again however the text is split (``scanned`` counts what they passed).
    One delta costs the orchestrator's thread time in proportion to that delta, never to what is
    pending before it.
    """

    def __init__(self, policy: InputChunking) -> None:
        self.policy = policy
        #: Characters the text scanners passed, all told: at most three times the text fed (a
        #: measure of the cutter's work, for its tests).
        self.scanned = 0
        # The text fed and not yet cut is ``_buf[_start:]``; the cut part is dropped once it is the
        # larger (so the copy is paid for by the text cut). Positions below are into ``_buf``.
        self._buf = ""
        self._start = 0
        self._deltas = 0  # text deltas since the last cut (``tokens``)
        self._sentence_at = 0  # where the search for a sentence end goes on
        self._open_end: int | None = None  # where a sentence end that the text's end cut short starts
        self._word_at = 0  # where the search for a word end goes on
        self._word_ends: deque[int] = deque()  # word ends found after ``_start``
        self._alnum: int | None = None  # the first letter or digit after ``_start``, once found
        self._alnum_at = 0  # where the search for it goes on
        self._tensors: dict[str, list[Any]] = {}  # per name: deltas not yet cut
        self._held: Chunk | None = None  # the newest cut, until something follows it
        self._cuts = 0  # cuts made (held or handed on): the first is ``first_size``
        self._count = 0
        self._backlog = False  # a call stopped at its limit: more cuts wait in the text or items
        self.finished = False  # the input is complete
        self._done = False  # the last chunk is handed on

    def _size(self) -> int:
        """Words, deltas or items of the next cut."""
        first = self.policy.first_size
        return first if first is not None and self._cuts == 0 else self.policy.size

    @property
    def chunks_made(self) -> int:
        """Chunks handed on so far."""
        return self._count

    def feed(
        self, text: str | None = None, tensors: dict[str, Any] | None = None, limit: int | None = None
    ) -> list[Chunk]:
        """Take one upstream delta; the chunks it completes, in order: all of them, or with
        ``limit`` at most that many cuts (the held one may come with them), the rest cut by later
        calls (:attr:`has_more`, :meth:`more`), so that one delta's work is bounded by what the
        caller can use now, not by the delta's size."""
        if self.finished:
            raise ValueError("the chunker is finished")
        if self.policy.policy == "items":
            for name, value in (tensors or {}).items():
                self._tensors.setdefault(name, []).append(np.asarray(value))
        elif text:
            self._append(text)
            self._deltas += 1
        return self._release(self._cut(limit), self._pending())

    @property
    def has_more(self) -> bool:
        """Whether :meth:`more` has chunks to give without more input: a call stopped at its
        ``limit``, or the input is finished and its last chunk is not handed on yet."""
        return self._backlog or (self.finished and not self._done)

    def more(self, limit: int | None = None) -> list[Chunk]:
        """The chunks an earlier call's ``limit`` left uncut (after :meth:`finish`, up to and
        including the last), at most ``limit`` cuts of them."""
        if self.finished:
            return self._finish_part(limit)
        if not self._backlog:
            return []
        return self._release(self._cut(limit), self._pending())

    def finish(self, limit: int | None = None) -> list[Chunk]:
        """The upstream is done: the chunks still held, the last marked ``last`` (with ``limit``,
        at most that many cuts now, the rest by :meth:`more`). A request whose upstream made
        nothing at all gets one empty last chunk."""
        if self.finished:
            return []
        self.finished = True
        return self._finish_part(limit)

    def _cut(self, limit: int | None) -> list[Chunk]:
        cuts = self._cut_items(limit) if self.policy.policy == "items" else self._cut_text(limit)
        self._backlog = limit is not None and len(cuts) >= limit
        return cuts

    def _pending(self) -> bool:
        """Whether something follows the newest cut: a speakable character, or an item."""
        if self.policy.policy == "items":
            return any(_items(p) for p in self._tensors.values())
        return self._speakable_before(len(self._buf))

    def _finish_part(self, limit: int | None) -> list[Chunk]:
        """After :meth:`finish`: the next cuts, and once none is left, the rest as the last."""
        if self._done:
            return []
        queue = self._release(self._cut(limit), self._pending())
        if self._backlog:
            return queue
        rest: Chunk | None = None
        if self.policy.policy == "items":
            if any(_items(p) for p in self._tensors.values()):
                rest = Chunk(0, False, tensors={n: _concat(p) for n, p in self._tensors.items()})
            self._tensors = {}
        else:
            text = self._buf[self._start :]
            if self._speakable_before(len(self._buf)) or self._held is None:
                rest = Chunk(0, False, text=text)
            elif self._held is not None:
                self._held.text = (self._held.text or "") + text  # trailing punctuation
            self._buf, self._start, self._deltas = "", 0, 0
        tail = ([self._held] if self._held is not None else []) + ([rest] if rest is not None else [])
        self._held = None
        if not tail and not queue and not self._count:  # an items upstream that made nothing
            tail = [Chunk(0, False)]
        for chunk in tail:
            chunk.index = self._count
            self._count += 1
        queue += tail
        if queue:
            queue[-1].last = True
        self._done = True
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

    def _cut_text(self, limit: int | None = None) -> list[Chunk]:
        out: list[Chunk] = []
        if self.policy.policy == "tokens":
            # Every ``size`` deltas, with something speakable in it (punctuation or spaces alone
            # wait for the next words).
            if self._deltas >= self._size() and self._speakable_before(len(self._buf)):
                out.append(self._take_text(len(self._buf)))
            return out
        while limit is None or len(out) < limit:
            # The first sentence end with something speakable before it, wherever it is; if there
            # is none yet, the end of the ``size``-th word, if something speakable comes before it.
            cut = self._sentence_cut()
            if cut is None:
                cut = self._word_cut(self._size())
            if cut is None:
                return out
            out.append(self._take_text(cut))
        return out

    def _append(self, text: str) -> None:
        if self._start and self._start >= len(self._buf) - self._start:
            self._shift(self._start)
        self._buf += text

    def _shift(self, by: int) -> None:
        """Drop the first ``by`` characters (cut already) from the buffer."""
        self._buf = self._buf[by:]
        self._start -= by
        self._sentence_at -= by
        self._word_at -= by
        self._alnum_at -= by
        if self._open_end is not None:
            self._open_end -= by
        if self._alnum is not None:
            self._alnum -= by
        self._word_ends = deque(end - by for end in self._word_ends)

    def _sentence_cut(self) -> int | None:
        """Where the first sentence end with something speakable before it ends, or None."""
        while (end := self._next_sentence_end()) is not None:
            if self._speakable_before(end):
                return end
        return None

    def _next_sentence_end(self) -> int | None:
        """Where the next sentence end in the text fed ends, or None until one comes."""
        buf, at = self._buf, self._sentence_at
        if self._open_end is not None:
            # 1) a run of marks that reached the text's end: does the new text complete it?
            more = (_MORE_CLOSERS if buf[at - 1] in _CLOSERS else _MORE_MARKS).match(buf, at)
            stop = more.end() if more is not None else at
            self.scanned += stop - at
            if stop == len(buf):
                self._sentence_at = stop
                return None
            self._open_end = None
            if buf[stop].isspace():
                self.scanned += 1
                self._sentence_at = stop + 1
                return stop + 1
            at = stop  # no space after it: not a sentence end
        # 2) the next one after it
        m = self._search(_SENTENCE_END, at)
        stop = m.end() if m is not None else len(buf)
        self._sentence_at = stop
        if m is None:
            return None
        if not buf[stop - 1].isspace():  # the text ended inside it
            self._open_end = m.start()
            return None
        return stop

    def _word_cut(self, words: int) -> int | None:
        """The end of the ``words``-th word (a word ends where a space follows it), if something
        speakable comes before it; else None."""
        ends = self._word_ends
        while len(ends) < words:
            m = self._search(_WORD_END, self._word_at)
            self._word_at = m.end() if m is not None else len(self._buf)
            if m is None:
                return None
            ends.append(m.end())
        end = ends[words - 1]
        return end if self._speakable_before(end) else None

    def _speakable_before(self, end: int) -> bool:
        """Whether a letter or digit comes between the pending text's start and ``end``."""
        if self._alnum is None:
            m = self._search(_ALNUM, self._alnum_at)
            self._alnum_at = m.end() if m is not None else len(self._buf)
            if m is None:
                return False
            self._alnum = m.start()
        return self._alnum < end

    def _search(self, pattern: re.Pattern[str], at: int) -> re.Match[str] | None:
        """``pattern``'s first match in the text fed from ``at`` on, counting what it passed."""
        m = pattern.search(self._buf, at)
        self.scanned += (m.end() if m is not None else len(self._buf)) - at
        return m

    def _take_text(self, end: int) -> Chunk:
        # The sentence search is at or past ``end`` (a word cut is made only where it found
        # nothing), the search for a letter or digit is not past it (it stops at the one before
        # ``end`` that made the cut speakable); the word search may be either.
        text = self._buf[self._start : end]
        self._start = end
        self._alnum = None
        self._alnum_at = end
        self._word_at = max(self._word_at, end)
        while self._word_ends and self._word_ends[0] <= end:
            self._word_ends.popleft()
        self._deltas = 0
        self._cuts += 1
        return Chunk(0, False, text=text)

    # ------------------------------------------------------------------ tensors

    def _cut_items(self, limit: int | None = None) -> list[Chunk]:
        """Cuts of ``size`` items while every name has them (at most ``limit``); each name's
        parts are joined once per call, so cutting is linear in the items however many cuts they
        make."""
        if not self._tensors:
            return []
        wholes = {name: _concat(parts) for name, parts in self._tensors.items()}
        out: list[Chunk] = []
        at = 0
        while limit is None or len(out) < limit:
            size = self._size()
            if not all(len(whole) - at >= size for whole in wholes.values()):
                break
            out.append(Chunk(0, False, tensors={name: whole[at : at + size] for name, whole in wholes.items()}))
            at += size
            self._cuts += 1
        self._tensors = {name: [whole[at:]] if len(whole) > at else [] for name, whole in wholes.items()}
        return out


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
