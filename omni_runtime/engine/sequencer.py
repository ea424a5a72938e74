"""The chunk sequencer: the chunked hand-off of every request in flight, for the orchestrator.

A stage with ``input_chunking`` takes its upstream's output as it streams: each delta goes into
a chunker (:mod:`omni_runtime.engine.chunking`), each chunk cut is submitted as a sub-request of
its own (``<request id>#chunk<i>``), at most ``max_buffered`` at a time per request, and the
chunks' outputs, in whatever order they come back, go on in chunk order: each as the stage's next
partial output, and their join as the stage's output once the last is in. A streaming-input
request's source stages are fed the same way, from the caller's updates.

:class:`ChunkSequencer` keeps that state (one feed per request and chunked stage) and knows
nothing of pools, backends or the stage graph: the orchestrator tells it what arrived
(:meth:`~ChunkSequencer.on_delta`, :meth:`~ChunkSequencer.on_end`,
:meth:`~ChunkSequencer.on_input`, :meth:`~ChunkSequencer.on_output`) and which request ended
(:meth:`~ChunkSequencer.forget`), and it calls back to submit a chunk, to deliver a stage's
next partial output or its whole output, and to fail a request. Used in the orchestrator
thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from omni_runtime.config import InputChunking
from omni_runtime.engine.chunking import Chunk, Chunker, join_outputs
from omni_runtime.messages import StageOutput

#: How a source stage takes a streaming-input request (the caller is its upstream): a sentence
#: at a time, or 32 words where no sentence ends sooner.
STREAMING_INPUT_CHUNKING = InputChunking(policy="sentence", size=32, max_buffered=2)

#: ``(request_id, stage_id, chunk_request_id, chunk, inputs)``: submit ``chunk`` to the stage as
#: the sub-request ``chunk_request_id``; ``inputs`` (the chunk's tensors, its index, whether it is
#: the last, a streaming update's inputs) complete the stage input made from it. Raises if it
#: cannot: the request then fails.
Submit = Callable[[str, int, str, Chunk, dict[str, Any]], None]
#: ``(request_id, stage_id, output)``: a chunked stage's next partial output (in chunk order), or
#: its whole output (the join of its chunks').
Deliver = Callable[[str, int, StageOutput], None]
#: ``(request_id, error, stage_id)``: end the request with ``error``; the orchestrator calls
#: :meth:`ChunkSequencer.forget` for it.
Fail = Callable[[str, BaseException, int], None]
#: ``(request_id, stage_id, output, then)``: ``then(output)`` once the output's arrays are plain
#: values, after every earlier output of the request (never, if the request ends meanwhile).
Settle = Callable[[str, int, StageOutput, Callable[[StageOutput], None]], None]


def _settle_at_once(request_id: str, stage_id: int, out: StageOutput, then: Callable[[StageOutput], None]) -> None:
    then(out)


class _Feed:
    """One request's chunked hand-off into one stage: chunks cut and not yet sent, chunks sent
    and not yet done (at most ``max_buffered``), outputs waiting for an earlier chunk's."""

    __slots__ = (
        "chunker",
        "extras",
        "fed",
        "last_index",
        "next_out",
        "outputs",
        "outstanding",
        "ready",
        "results",
        "source",
    )

    def __init__(self, chunker: Chunker, *, source: bool = False) -> None:
        self.chunker = chunker
        self.source = source  # a source stage fed by the caller (streaming input)
        self.fed = False  # the upstream streamed something into it
        self.ready: deque[Chunk] = deque()
        self.outstanding: dict[str, int] = {}  # sub-request id -> chunk index
        self.results: dict[int, StageOutput] = {}  # done out of order, by chunk index
        self.next_out = 0  # the chunk whose output goes on next
        self.outputs: list[StageOutput] = []  # gone on, in chunk order
        self.last_index: int | None = None  # known once the last chunk is sent
        self.extras: dict[str, Any] = {}  # streaming updates' inputs, for the next chunk sent

    @property
    def room(self) -> int:
        """Chunks worth cutting now: what the stage can take beyond those cut and waiting. The
        chunker cuts no more (the rest when outputs make room), so one long delta costs the
        orchestrator's thread the few chunks it can send, not thousands of cuts at once."""
        return max(self.chunker.policy.max_buffered - len(self.outstanding) - len(self.ready), 0)

    def take(self, text: str | None, tensors: dict[str, Any] | None = None) -> None:
        """One upstream delta into the chunker; the chunks it can send now into ``ready``."""
        self.ready.extend(self.chunker.feed(text, tensors, limit=self.room))

    def cut_last(self) -> None:
        """The input is complete: what the chunker holds goes, the last chunk last."""
        self.ready.extend(self.chunker.finish(limit=self.room))


class ChunkSequencer:
    """The feeds of every request in flight, by request and chunked stage; the chunks they have
    out, by sub-request id.

    The caller tells it of every request that ends (:meth:`forget`, which hands back the chunks
    still out) and feeds it nothing of a request after that: state made for an unknown request id
    is a new request's."""

    def __init__(
        self,
        chunked: Mapping[int, InputChunking],
        *,
        submit: Submit,
        deliver: Deliver,
        finish: Deliver,
        fail: Fail,
        settle: Settle = _settle_at_once,
    ) -> None:
        #: The chunked stages' policies, by stage id.
        self.chunked = dict(chunked)
        self._submit = submit
        self._deliver = deliver
        self._finish = finish
        self._fail = fail
        self._settle = settle
        #: Request id -> stage id -> feed; a request is here once something was fed for it.
        self._feeds: dict[str, dict[int, _Feed]] = {}
        #: A chunk's sub-request id -> (its request's id, the stage's id).
        self._subs: dict[str, tuple[str, int]] = {}

    def __contains__(self, request_id: object) -> bool:
        """Whether any state of ``request_id`` is held here."""
        return request_id in self._feeds

    @property
    def in_flight(self) -> int:
        """Chunks submitted whose output has not come back (of every request)."""
        return len(self._subs)

    def owner(self, chunk_request_id: str) -> str | None:
        """The request a chunk's sub-request belongs to; None if it is no chunk in flight."""
        owner = self._subs.get(chunk_request_id)
        return None if owner is None else owner[0]

    # ------------------------------------------------------------------ what the orchestrator tells

    def open_input(self, request_id: str, stage_ids: Iterable[int]) -> None:
        """A streaming-input request: the caller's text is cut into chunks for these source stages
        (:data:`STREAMING_INPUT_CHUNKING`), fed by :meth:`on_input`."""
        feeds = self._feeds.setdefault(request_id, {})
        for stage_id in stage_ids:
            feeds[stage_id] = _Feed(Chunker(STREAMING_INPUT_CHUNKING), source=True)

    def on_input(self, request_id: str, text: str | None, inputs: Mapping[str, Any], final: bool) -> None:
        """More of a streaming-input request's input: into each source stage's chunker; ``inputs``
        go with the next chunk each sends."""
        feeds = self._feeds.get(request_id)
        if feeds is None:
            return
        for stage_id, feed in list(feeds.items()):
            if not feed.source or feed.chunker.finished:
                continue
            feed.extras.update(inputs)
            feed.fed = True
            feed.take(text)
            if final:
                feed.cut_last()
            self._pump(request_id, stage_id)
            if self._feeds.get(request_id) is not feeds:
                return  # the request ended

    def on_delta(self, request_id: str, stage_ids: Iterable[int], out: StageOutput) -> None:
        """A streamed delta of an upstream (its arrays plain values): into the chunker of each
        chunked stage of ``stage_ids`` (those of the request that the upstream feeds)."""
        for stage_id in stage_ids:
            feeds = self._feeds.setdefault(request_id, {})
            feed = self._feed(feeds, stage_id)
            if feed.chunker.finished:
                continue
            if out.payload.text or out.payload.tensors:
                feed.fed = True
            feed.take(out.payload.text, out.payload.tensors)
            self._pump(request_id, stage_id)
            if self._feeds.get(request_id) is not feeds:
                return  # the request ended

    def on_end(self, request_id: str, stage_id: int, out: StageOutput) -> None:
        """The upstream of chunked stage ``stage_id`` finished with ``out``: the chunker's last
        chunks go. An upstream that streamed nothing (a runner that does not stream) is fed its
        whole output first, so it is chunked too."""
        feed = self._feed(self._feeds.setdefault(request_id, {}), stage_id)
        if not feed.fed:
            feed.take(out.payload.text, out.payload.tensors)
        feed.cut_last()
        self._pump(request_id, stage_id)

    def on_output(self, stage_id: int, out: StageOutput) -> None:
        """The final output of a chunk's sub-request (see :meth:`owner`): its request's next
        partial output once every earlier chunk's is in; the stage's output after the last."""
        owner = self._subs.pop(out.request_id, None)
        if owner is None:
            return
        request_id = owner[0]
        feeds = self._feeds.get(request_id)
        feed = feeds.get(stage_id) if feeds is not None else None
        if feeds is None or feed is None or out.request_id not in feed.outstanding:
            return
        index = feed.outstanding.pop(out.request_id)
        if out.error is not None:
            self._fail(request_id, out.error.to_exception(), stage_id)
            return
        self._pump(request_id, stage_id)  # room for the next chunk
        self._settle(request_id, stage_id, out, lambda o: self._chunk_done(request_id, feeds, stage_id, index, o))

    def forget(self, request_id: str) -> list[tuple[int, str]]:
        """Drop a request's state (it ended): the chunks it still has out, ``(stage id,
        sub-request id)``, for the caller to abort. Their outputs are dropped if they come."""
        feeds = self._feeds.pop(request_id, None)
        if feeds is None:
            return []
        out: list[tuple[int, str]] = []
        for stage_id, feed in feeds.items():
            for sub in feed.outstanding:
                self._subs.pop(sub, None)
                out.append((stage_id, sub))
            feed.outstanding.clear()
        return out

    # ------------------------------------------------------------------ sequencing

    def _feed(self, feeds: dict[int, _Feed], stage_id: int) -> _Feed:
        feed = feeds.get(stage_id)
        if feed is None:
            feed = feeds[stage_id] = _Feed(Chunker(self.chunked[stage_id]))
        return feed

    def _pump(self, request_id: str, stage_id: int) -> None:
        """Submit ready chunks to the stage in order while fewer than ``max_buffered`` run there,
        cutting more from what the chunker holds as they go."""
        feed = self._feeds[request_id][stage_id]
        limit = feed.chunker.policy.max_buffered
        while len(feed.outstanding) < limit:
            if not feed.ready and feed.chunker.has_more:
                feed.ready.extend(feed.chunker.more(limit - len(feed.outstanding)))
            if not feed.ready:
                return
            chunk = feed.ready.popleft()
            if chunk.last:
                feed.last_index = chunk.index
            inputs = {**feed.extras, **chunk.tensors, "chunk_index": chunk.index, "last_chunk": chunk.last}
            feed.extras = {}
            sub = f"{request_id}#chunk{chunk.index}"
            try:
                self._submit(request_id, stage_id, sub, chunk, inputs)
            except Exception as e:  # no stage input, no live replica, or a value no message can carry
                self._fail(request_id, e, stage_id)
                return
            feed.outstanding[sub] = chunk.index
            self._subs[sub] = (request_id, stage_id)

    def _chunk_done(
        self, request_id: str, feeds: dict[int, _Feed], stage_id: int, index: int, out: StageOutput
    ) -> None:
        if self._feeds.get(request_id) is not feeds:
            return  # the request ended while the output settled
        feed = feeds[stage_id]
        feed.results[index] = out
        while feed.next_out in feed.results:
            piece = feed.results.pop(feed.next_out)
            feed.next_out += 1
            feed.outputs.append(piece)
            self._deliver(request_id, stage_id, msgspec.structs.replace(piece, request_id=request_id, finished=False))
            if self._feeds.get(request_id) is not feeds:
                return  # the delta ended the request (an error downstream)
        if feed.last_index is None or feed.next_out <= feed.last_index:
            return
        # Every chunk is in: the stage's output is their concatenation.
        whole = StageOutput(request_id=request_id, payload=join_outputs([o.payload for o in feed.outputs]))
        self._finish(request_id, stage_id, whole)
