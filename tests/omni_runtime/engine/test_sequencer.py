"""The chunk sequencer on its own: fake submit / deliver / finish / fail callbacks, no orchestrator,
no process. Milliseconds each.

The harness plays the orchestrator's part: it records what the sequencer submits and delivers, and
on a failure forgets the request and records the chunks it would abort, as the orchestrator does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from omni_runtime.config import InputChunking
from omni_runtime.engine.chunking import Chunk
from omni_runtime.engine.sequencer import STREAMING_INPUT_CHUNKING, ChunkSequencer
from omni_runtime.exceptions import StageExecutionError
from omni_runtime.messages import ErrorInfo, Payload, StageOutput

pytestmark = pytest.mark.unit

UP, CHUNKED = 0, 1  # stage 0 streams into stage 1, which takes it in chunks
RID = "req"


class Harness:
    def __init__(self, policy: InputChunking, *, settle_later: bool = False, refuse: set[int] | None = None) -> None:
        self.submitted: list[tuple[str, int, str, Chunk, dict[str, Any]]] = []
        self.delivered: list[tuple[str, int, StageOutput]] = []
        self.finished: list[tuple[str, int, StageOutput]] = []
        self.failed: list[tuple[str, BaseException, int]] = []
        self.aborted: list[tuple[int, str]] = []
        self.pending_settles: list[Callable[[], None]] = []
        self.refuse = refuse or set()  # chunk indexes whose submit raises
        self.ended = False  # the request failed: the orchestrator drops its upstream's deltas
        self.seq = ChunkSequencer(
            {CHUNKED: policy},
            submit=self.submit,
            deliver=lambda rid, sid, out: self.delivered.append((rid, sid, out)),
            finish=lambda rid, sid, out: self.finished.append((rid, sid, out)),
            fail=self.fail,
            settle=self.settle_later if settle_later else self.settle_now,
        )

    def submit(self, rid: str, stage_id: int, chunk_id: str, chunk: Chunk, inputs: dict[str, Any]) -> None:
        if chunk.index in self.refuse:
            raise StageExecutionError("no live replica")
        self.submitted.append((rid, stage_id, chunk_id, chunk, inputs))

    def fail(self, rid: str, exc: BaseException, stage_id: int) -> None:
        self.failed.append((rid, exc, stage_id))
        self.aborted += self.seq.forget(rid)
        self.ended = True

    @staticmethod
    def settle_now(rid: str, stage_id: int, out: StageOutput, then: Callable[[StageOutput], None]) -> None:
        then(out)

    def settle_later(self, rid: str, stage_id: int, out: StageOutput, then: Callable[[StageOutput], None]) -> None:
        self.pending_settles.append(lambda: then(out))

    # what the upstream and the chunked stage say
    def delta(self, text: str | None = None, **tensors: Any) -> None:
        if not self.ended:
            out = StageOutput(request_id=RID, finished=False, payload=Payload(text=text, tensors=tensors))
            self.seq.on_delta(RID, [CHUNKED], out)

    def chunk_output(self, index: int, text: str | None = None, error: BaseException | None = None) -> None:
        sub = f"{RID}#chunk{index}"
        info = None if error is None else ErrorInfo.from_exception(error, CHUNKED)
        self.seq.on_output(CHUNKED, StageOutput(request_id=sub, payload=Payload(text=text), error=info))

    def texts(self) -> list[str | None]:
        return [chunk.text for _, _, _, chunk, _ in self.submitted]


def one_delta_per_chunk(max_buffered: int = 8) -> InputChunking:
    return InputChunking(policy="tokens", size=1, max_buffered=max_buffered)


def test_deltas_are_cut_into_chunks_submitted_in_order_at_most_max_buffered_at_a_time() -> None:
    h = Harness(one_delta_per_chunk(max_buffered=2))
    for piece in ("a", "b", "c", "d"):
        h.delta(piece)
    # A cut goes once something follows it; two are out, the third waits for room.
    assert h.texts() == ["a", "b"]
    assert [sub for _, _, sub, _, _ in h.submitted] == [f"{RID}#chunk0", f"{RID}#chunk1"]
    assert h.seq.in_flight == 2 and h.seq.owner(f"{RID}#chunk1") == RID
    h.chunk_output(0, "A")  # room for the next
    assert h.texts() == ["a", "b", "c"]
    h.seq.on_end(RID, CHUNKED, StageOutput(request_id=RID, payload=Payload(text="abcd")))
    h.chunk_output(1, "B")
    h.chunk_output(2, "C")
    # Every chunk carries its index; exactly the last says so.
    assert h.texts() == ["a", "b", "c", "d"]
    assert [(inputs["chunk_index"], inputs["last_chunk"]) for *_, inputs in h.submitted] == [
        (0, False),
        (1, False),
        (2, False),
        (3, True),
    ]
    assert not h.finished
    h.chunk_output(3, "D")
    assert [out.payload.text for _, _, out in h.delivered] == ["A", "B", "C", "D"]
    assert all(out.request_id == RID and not out.finished for _, _, out in h.delivered)
    [(rid, stage_id, whole)] = h.finished
    assert (rid, stage_id, whole.payload.text, whole.finished) == (RID, CHUNKED, "ABCD", True)
    assert h.seq.in_flight == 0 and not h.failed


def test_outputs_that_come_back_out_of_order_go_on_in_chunk_order() -> None:
    h = Harness(one_delta_per_chunk())
    for piece in ("a", "b", "c"):
        h.delta(piece)
    h.seq.on_end(RID, CHUNKED, StageOutput(request_id=RID, payload=Payload(text="abc")))
    assert len(h.submitted) == 3
    h.chunk_output(2, "C")
    assert not h.delivered  # held until every earlier chunk's is in
    h.chunk_output(0, "A")
    assert [out.payload.text for _, _, out in h.delivered] == ["A"]
    h.chunk_output(1, "B")
    assert [out.payload.text for _, _, out in h.delivered] == ["A", "B", "C"]
    [(_, _, whole)] = h.finished
    assert whole.payload.text == "ABC"


def test_tensor_chunks_carry_their_items_and_an_upstream_that_streamed_nothing_is_chunked_whole() -> None:
    h = Harness(InputChunking(policy="items", size=2, max_buffered=4))
    h.seq.on_end(RID, CHUNKED, StageOutput(request_id=RID, payload=Payload(tensors={"codes": np.arange(5)})))
    assert [inputs["codes"].tolist() for *_, inputs in h.submitted] == [[0, 1], [2, 3], [4]]
    assert [inputs["last_chunk"] for *_, inputs in h.submitted] == [False, False, True]


def test_an_error_in_one_chunk_fails_the_request_once_and_aborts_the_rest() -> None:
    h = Harness(one_delta_per_chunk())
    for piece in ("a", "b", "c", "d"):
        h.delta(piece)
    assert len(h.submitted) == 3
    h.chunk_output(0, "A")
    h.chunk_output(1, error=StageExecutionError("the speech model failed"))
    [(rid, exc, stage_id)] = h.failed
    assert (rid, type(exc), stage_id) == (RID, StageExecutionError, CHUNKED)
    assert h.aborted == [(CHUNKED, f"{RID}#chunk2")]  # the chunk still out, to abort
    # What comes after is dropped: no second failure, nothing delivered, nothing submitted.
    h.chunk_output(2, error=StageExecutionError("aborted"))
    assert len(h.failed) == 1 and len(h.submitted) == 3
    assert RID not in h.seq and h.seq.in_flight == 0
    assert [out.payload.text for _, _, out in h.delivered] == ["A"]


def test_a_chunk_that_cannot_be_submitted_fails_the_request_once() -> None:
    h = Harness(one_delta_per_chunk(), refuse={1})
    for piece in ("a", "b", "c", "d"):
        h.delta(piece)
    [(rid, exc, stage_id)] = h.failed
    assert (rid, str(exc), stage_id) == (RID, "no live replica", CHUNKED)
    assert h.texts() == ["a"] and h.aborted == [(CHUNKED, f"{RID}#chunk0")]
    assert RID not in h.seq and h.seq.in_flight == 0


def test_forget_releases_the_request_and_its_late_outputs_are_dropped() -> None:
    h = Harness(one_delta_per_chunk(), settle_later=True)
    for piece in ("a", "b", "c"):
        h.delta(piece)
    h.chunk_output(0, "A")  # settling when the request is aborted
    assert RID in h.seq
    assert sorted(h.seq.forget(RID)) == [(CHUNKED, f"{RID}#chunk1")]
    assert RID not in h.seq and h.seq.in_flight == 0 and h.seq.owner(f"{RID}#chunk1") is None
    for then in h.pending_settles:
        then()
    h.chunk_output(1, "B")
    assert not h.delivered and not h.finished and not h.failed
    assert h.seq.forget(RID) == []


def test_streaming_input_goes_a_sentence_at_a_time_with_each_updates_inputs() -> None:
    h = Harness(one_delta_per_chunk())
    h.seq.open_input(RID, [UP])
    h.seq.on_input(RID, "One. Two", {}, final=False)
    h.seq.on_input(RID, " three. Four", {"voice": "b"}, final=False)
    h.seq.on_input(RID, ".", {}, final=True)
    # Two out (STREAMING_INPUT_CHUNKING.max_buffered); the last waits for room.
    assert STREAMING_INPUT_CHUNKING.max_buffered == 2
    assert [(sid, chunk.text) for _, sid, _, chunk, _ in h.submitted] == [(UP, "One. "), (UP, "Two three. ")]
    h.seq.on_output(UP, StageOutput(request_id=f"{RID}#chunk0", payload=Payload(text="1")))
    h.seq.on_output(UP, StageOutput(request_id=f"{RID}#chunk1", payload=Payload(text="2")))
    assert [chunk.text for _, _, _, chunk, _ in h.submitted] == ["One. ", "Two three. ", "Four."]
    assert [inputs.get("voice") for *_, inputs in h.submitted] == [None, "b", None]
    assert [inputs["last_chunk"] for *_, inputs in h.submitted] == [False, False, True]
    h.seq.on_output(UP, StageOutput(request_id=f"{RID}#chunk2", payload=Payload(text="3")))
    [(_, stage_id, whole)] = h.finished
    assert (stage_id, whole.payload.text) == (UP, "123")
    h.seq.on_input(RID, "more", {}, final=True)  # after the final update: nothing more goes
    assert len(h.submitted) == 3


def test_one_huge_delta_is_cut_as_the_stage_makes_room_and_nothing_is_lost() -> None:
    """33,333 one-word sentences in one delta: the sequencer cuts what the stage can take
    (``max_buffered``), and the next as each output comes back, never the whole text at once."""
    h = Harness(InputChunking(policy="sentence", size=32, max_buffered=2))
    text = "a. " * 33_333
    h.delta(text)
    assert len(h.submitted) == 2
    chunker = h.seq._feeds[RID][CHUNKED].chunker
    assert chunker.chunks_made <= 3  # two sent, at most one cut and waiting
    h.seq.on_end(RID, CHUNKED, StageOutput(request_id=RID, payload=Payload(text=text)))
    done = 0
    while done < len(h.submitted):
        h.chunk_output(done, h.submitted[done][3].text)
        done += 1
        assert len(h.submitted) - done <= 2  # never more than max_buffered out
    assert h.texts()[-1] == "a. " and len(h.submitted) == 33_333
    assert [inputs["last_chunk"] for *_, inputs in h.submitted].count(True) == 1
    [(_, _, whole)] = h.finished
    assert whole.payload.text == text and not h.failed
