"""Typed events (``omni_runtime.events``): what each engine output says, in order, for every
combination of its fields, and, over random streams folded as the engine folds them, that the
events give back each output's deltas and its end."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrypoints.async_omni import apply_output
from omni_runtime.events import Event, Final, MediaDelta, Progress, StageDone, TextDelta, events_of
from omni_runtime.exceptions import StageExecutionError
from omni_runtime.media import AudioItem
from omni_runtime.messages import EngineOutput, Payload, StageMetrics
from omni_runtime.messages import Progress as WireProgress
from omni_runtime.outputs import OmniRequestOutput, RequestProgress, StageResult

pytestmark = pytest.mark.unit

CLIP = AudioItem(data=np.zeros((1, 4), dtype=np.float32), sample_rate=16_000)
ERROR = StageExecutionError("boom")


def fold(*messages: EngineOutput) -> list[OmniRequestOutput]:
    """What ``AsyncOmni.generate`` yields for these messages: a snapshot after each."""
    out = OmniRequestOutput(request_id="r", stage_id=-1)
    snapshots = []
    for msg in messages:
        apply_output(out, msg)
        snapshots.append(out.snapshot())
    return snapshots


def msg(stage_id: int, payload: Payload, *, finished: bool = False, stage_finished: bool = False) -> EngineOutput:
    return EngineOutput(
        request_id="r", stage_id=stage_id, finished=finished, stage_finished=stage_finished, payload=payload
    )


# ---------------------------------------------------------------------------- what the engine sends


def test_a_denoising_step_is_progress() -> None:
    (out,) = fold(msg(1, Payload(progress=WireProgress(step=2, steps=8))))
    assert events_of(out) == (Progress(stage=1, step=2, steps=8),)


def test_an_inner_stage_done_carries_its_metrics_and_no_result() -> None:
    (out,) = fold(msg(0, Payload(stage_done=True, metrics=StageMetrics(execution_ms=3.0, batch_size=2))))
    assert events_of(out) == (StageDone(stage=0, metrics={"execution_ms": 3.0, "batch_size": 2}),)


def test_streamed_text_then_the_stage_then_the_end() -> None:
    first, second, done = fold(
        msg(0, Payload(text="a red")),
        msg(0, Payload(text=" fox")),
        msg(0, Payload(text="a red fox", metrics=StageMetrics(seed=3)), finished=True, stage_finished=True),
    )
    assert events_of(first) == (TextDelta(stage=0, text="a red"),)
    assert events_of(second) == (TextDelta(stage=0, text=" fox"),)
    stage, final = events_of(done)
    assert stage == StageDone(stage=0, metrics=done.metrics, result=done.outputs_by_stage[0])
    assert stage.result is not None and stage.result.text == "a red fox" and stage.metrics["seed"] == 3
    assert final == Final(done) and final.output is done and final.error is None


def test_a_chunk_of_audio_is_a_media_delta_and_a_chunk_with_text_is_both_in_order() -> None:
    audio, both = fold(msg(2, Payload(media=[CLIP])), msg(2, Payload(text="hi", media=[CLIP])))
    assert events_of(audio) == (MediaDelta(stage=2, items=(CLIP,)),)
    assert events_of(both) == (TextDelta(stage=2, text="hi"), MediaDelta(stage=2, items=(CLIP,)))


def test_a_final_stage_that_is_not_the_last_is_done_without_ending_the_request() -> None:
    text, image = fold(
        msg(0, Payload(text="a fox"), stage_finished=True),
        msg(1, Payload(media=[CLIP]), finished=True, stage_finished=True),
    )
    assert events_of(text) == (StageDone(stage=0, metrics={}, result=text.outputs_by_stage[0]),)
    stage, final = events_of(image)
    assert isinstance(stage, StageDone) and stage.result is not None and stage.result.media == [CLIP]
    assert isinstance(final, Final) and final.output.media == [CLIP] and final.output.text == "a fox"


def test_a_streamed_piece_with_neither_text_nor_media_says_nothing() -> None:
    (out,) = fold(msg(0, Payload(tensors={"codes": np.zeros(2)})))
    assert events_of(out) == ()


def test_an_output_that_failed_ends_its_request_with_the_error() -> None:
    # Omni.generate returns such an output for a prompt whose request failed.
    out = OmniRequestOutput(request_id="r", stage_id=-1, finished=True, error=ERROR)
    (final,) = events_of(out)
    assert final == Final(out) and isinstance(final, Final) and final.error is ERROR
    # An error ends the request even on an output that does not say it is finished.
    assert [type(e) for e in events_of(OmniRequestOutput(request_id="r", stage_id=-1, error=ERROR))] == [Final]


# ---------------------------------------------------------------------------- every combination

PROGRESS = {
    "none": None,
    "step": RequestProgress(stage_id=1, step=3, steps=9),
    "stage_done": RequestProgress(stage_id=0, stage_done=True),
    "empty": RequestProgress(stage_id=1),  # neither a step nor done: says nothing
}
TEXT = {"none": None, "empty": "", "text": "hi"}
MEDIA = {"none": [], "clip": [CLIP]}


@pytest.mark.parametrize(
    ("progress", "text", "media", "stage_finished", "finished", "error"),
    list(itertools.product(PROGRESS, TEXT, MEDIA, (False, True), (False, True), (False, True))),
)
def test_every_combination_of_fields_maps_to_its_events_in_order(
    progress: str, text: str, media: str, stage_finished: bool, finished: bool, error: bool
) -> None:
    result = StageResult(stage_id=2, text="whole")
    out = OmniRequestOutput(
        request_id="r",
        stage_id=2,
        finished=finished,
        text_delta=TEXT[text],
        media_delta=list(MEDIA[media]),
        error=ERROR if error else None,
        metrics={"execution_ms": 1.0},
        outputs_by_stage={2: result},
        progress=PROGRESS[progress],
        stage_finished=stage_finished,
    )
    expected: list[Event] = []
    if progress == "step":
        expected.append(Progress(stage=1, step=3, steps=9))
    if progress == "stage_done":
        expected.append(StageDone(stage=0, metrics={"execution_ms": 1.0}))
    if text != "none":
        expected.append(TextDelta(stage=2, text=TEXT[text] or ""))
    if media == "clip":
        expected.append(MediaDelta(stage=2, items=(CLIP,)))
    if stage_finished:
        expected.append(StageDone(stage=2, metrics={"execution_ms": 1.0}, result=result))
    if finished or error:
        expected.append(Final(out))
    events = events_of(out)
    assert list(events) == expected
    if stage_finished:
        assert next(e for e in events if isinstance(e, StageDone) and e.result is not None).result is result


def test_a_finished_stage_missing_from_the_output_still_has_a_result() -> None:
    out = OmniRequestOutput(request_id="r", stage_id=4, stage_finished=True)
    assert events_of(out) == (StageDone(stage=4, metrics={}, result=StageResult(stage_id=4)),)


def test_events_are_frozen_and_match_by_type() -> None:
    event: Event = TextDelta(stage=0, text="x")
    with pytest.raises(AttributeError):
        event.text = "y"  # type: ignore[misc]
    match event:
        case Progress() | StageDone():
            kind = "notice"
        case TextDelta(stage=0, text=text):
            kind = f"text {text}"
        case _:
            kind = "other"
    assert kind == "text x"


# ---------------------------------------------------------------------------- random streams

CLIPS = st.builds(lambda n: AudioItem(data=np.zeros((1, n), dtype=np.float32), sample_rate=8_000), st.integers(1, 3))
TEXTS = st.one_of(st.none(), st.text(max_size=4))
METRICS = st.builds(StageMetrics, execution_ms=st.one_of(st.none(), st.floats(0, 10)), seed=st.integers(0, 3))
STAGES = st.integers(0, 2)


@st.composite
def engine_messages(draw: st.DrawFn) -> list[EngineOutput]:
    """What the engine can send for one request: progress, inner stages done, streamed pieces
    (text, media, both or neither), final stages' outputs, the last one finishing the request."""
    kinds = draw(st.lists(st.sampled_from(["progress", "stage_done", "piece", "stage"]), max_size=12))
    messages = []
    for kind in kinds:
        sid = draw(STAGES)
        if kind == "progress":
            steps = draw(st.integers(1, 9))
            payload = Payload(progress=WireProgress(step=draw(st.integers(1, steps)), steps=steps))
            messages.append(msg(sid, payload))
        elif kind == "stage_done":
            messages.append(msg(sid, Payload(stage_done=True, metrics=draw(METRICS))))
        elif kind == "piece":
            payload = Payload(text=draw(TEXTS), media=draw(st.lists(CLIPS, max_size=2)), metrics=draw(METRICS))
            messages.append(msg(sid, payload))
        else:
            payload = Payload(text=draw(TEXTS), media=draw(st.lists(CLIPS, max_size=2)), metrics=draw(METRICS))
            messages.append(msg(sid, payload, stage_finished=True))
    last = Payload(text=draw(TEXTS), media=draw(st.lists(CLIPS, max_size=2)), metrics=draw(METRICS))
    messages.append(msg(draw(STAGES), last, finished=True, stage_finished=True))
    return messages


ORDER = {Progress: 0, TextDelta: 1, MediaDelta: 2, Final: 4}


def rank(event: Event) -> int:
    if isinstance(event, StageDone):
        return 0 if event.result is None else 3
    return ORDER[type(event)]


@given(engine_messages())
def test_events_give_back_each_outputs_deltas_and_the_end(messages: list[EngineOutput]) -> None:
    outputs = fold(*messages)
    texts: dict[int, str | None] = {}  # each stage's text, from the events alone
    media: dict[int, list[Any]] = {}
    finals = []
    for out in outputs:
        events = events_of(out)
        assert [rank(e) for e in events] == sorted(rank(e) for e in events)
        # The output's deltas and notices, as the events say them.
        notices = [e for e in events if isinstance(e, Progress) or (isinstance(e, StageDone) and e.result is None)]
        deltas = [e for e in events if isinstance(e, TextDelta)]
        pieces = [e for e in events if isinstance(e, MediaDelta)]
        done = [e for e in events if isinstance(e, StageDone) and e.result is not None]
        assert len(notices) <= 1 and len(deltas) <= 1 and len(pieces) <= 1 and len(done) <= 1
        match notices:
            case [Progress(stage=sid, step=step, steps=steps)]:
                assert out.progress == RequestProgress(stage_id=sid, step=step, steps=steps)
            case [StageDone(stage=sid, metrics=metrics)]:
                assert out.progress == RequestProgress(stage_id=sid, stage_done=True) and metrics == out.metrics
            case _:
                assert out.progress is None
        assert out.text_delta == (deltas[0].text if deltas else None)
        assert out.media_delta == (list(pieces[0].items) if pieces else [])
        assert out.stage_finished == bool(done)
        for event in events:
            match event:
                case TextDelta(stage=sid, text=text):
                    texts[sid] = (texts.get(sid) or "") + text
                case StageDone(stage=sid, result=StageResult() as result):
                    assert result is out.outputs_by_stage[sid] and event.metrics == out.metrics
                    texts[sid], media[sid] = result.text, list(result.media)
                case Final(output=final):
                    assert final is out and out.finished
                    finals.append(final)
        # Every stage's text and media so far, folded from the events, are the output's.
        for sid, result in out.outputs_by_stage.items():
            assert result.text == texts.get(sid) and result.media == media.get(sid, [])
    assert finals == [outputs[-1]] and finals[0].error is None
