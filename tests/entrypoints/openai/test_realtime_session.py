"""The realtime session's state machine (entrypoints/openai/realtime_session.py), without a socket or
an engine: client messages in, server events and effects out; engine events fed by hand. Hostile
messages (hypothesis) each give one ``error`` event and leave the session as it was."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from omni_runtime.entrypoints.capabilities import ModelCapabilities
from omni_runtime.entrypoints.openai.protocol import ApiError
from omni_runtime.entrypoints.openai.realtime_session import (
    MAX_ITEMS,
    MAX_SEGMENTS_IN_FLIGHT,
    AbortResponse,
    RealtimeLimits,
    RealtimeSession,
    SessionModel,
    StartResponse,
    Transcribe,
)

from omni_runtime.events import Final, MediaDelta, StageDone, TextDelta
from omni_runtime.exceptions import StageDeadError
from omni_runtime.media import AudioItem
from omni_runtime.outputs import OmniRequestOutput, StageResult

pytestmark = pytest.mark.unit

SPEAKS = SessionModel("tiny-omni-speech", "chat", text=True, audio=True)
RATE = 24_000


def session(model: SessionModel = SPEAKS, **limits: Any) -> RealtimeSession:
    s = RealtimeSession(model, RealtimeLimits(**limits))
    assert [e["type"] for e in drain(s)] == ["session.created"]
    return s


def drain(s: RealtimeSession) -> list[dict[str, Any]]:
    out = list(s.outbox)
    s.outbox.clear()
    return out


def send(s: RealtimeSession, **event: Any) -> list[Any]:
    return s.receive(json.dumps(event))


def ask(s: RealtimeSession, text: str = "hello") -> StartResponse:
    send(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": text}]})  # fmt: skip
    (start,) = send(s, type="response.create")
    assert isinstance(start, StartResponse) and start.prompt == text
    return start


def pcm(ms: int, amplitude: float, rate: int = RATE) -> str:
    n = rate * ms // 1000
    wave = amplitude * np.sin(2 * np.pi * 300 * np.arange(n) / rate)
    return base64.b64encode(np.round(wave * 32767).astype("<i2").tobytes()).decode()


def clip(seconds: float, rate: int = 16_000) -> AudioItem:
    return AudioItem(data=np.full((1, int(seconds * rate)), 0.25, dtype=np.float32), sample_rate=rate)


def finish(s: RealtimeSession, start: StartResponse, text: str, audio: AudioItem | None) -> None:
    results = {0: StageResult(0, text=text, metrics={"prompt_tokens": 3, "completion_tokens": 4})}
    s.on_event(start.response_id, StageDone(0, {}, results[0]))
    if audio is not None:
        results[1] = StageResult(1, media=[audio], metrics={"input_tokens": 50})  # the answer it spoke
        s.on_event(start.response_id, StageDone(1, {}, results[1]))
    s.on_event(start.response_id, Final(OmniRequestOutput("r", 1, finished=True, outputs_by_stage=results)))


def test_a_text_turn_gets_transcript_then_audio_then_done_with_usage() -> None:
    s = session()
    start = ask(s)
    assert start.modalities == ("text", "audio") and start.voice is None
    s.on_event(start.response_id, TextDelta(0, "hi "))
    s.on_event(start.response_id, TextDelta(0, "there"))
    finish(s, start, "hi there", clip(0.5))
    events = drain(s)
    types = [e["type"] for e in events]
    assert types[:3] == ["conversation.item.created", "response.created", "response.audio_transcript.delta"]
    assert types[-1] == "response.done" and types.count("response.done") == 1
    assert types.index("response.audio.delta") > types.index("response.audio_transcript.delta")
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.audio_transcript.delta")
    assert transcript == "hi there"
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta")
    assert len(audio) == 2 * RATE // 2  # half a second at the session's 24 kHz, resampled from 16 kHz
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["input_tokens"] == 3
    assert done["usage"]["output_token_details"] == {"text_tokens": 4, "audio_tokens": 25}
    assert not s.responding


def test_text_only_modalities_and_a_speech_only_model() -> None:
    s = session()
    send(s, type="session.update", session={"modalities": ["text"], "output_sample_rate": 16000})
    start = ask(s)
    assert start.modalities == ("text",)
    s.on_event(start.response_id, TextDelta(0, "ok"))
    finish(s, start, "ok", None)
    assert "response.text.delta" in [e["type"] for e in drain(s)]

    speech = session(SessionModel("espeak", "text2speech", text=False, audio=True))
    send(speech, type="session.update", session={"modalities": ["text"]})
    assert drain(speech)[-1]["error"]["code"] == "no_text"
    start = ask(speech, "say this")
    s2 = speech
    s2.on_event(start.response_id, MediaDelta(0, (clip(0.1),)))
    events = drain(s2)
    assert [e["type"] for e in events][-2:] == ["response.audio_transcript.delta", "response.audio.delta"]
    assert events[-2]["delta"] == "say this"  # a pipeline without text: the prompt is the transcript


def test_cancel_ends_the_response_at_once_and_drops_what_follows() -> None:
    s = session()
    start = ask(s)
    s.on_event(start.response_id, TextDelta(0, "partial"))
    effects = send(s, type="response.cancel")
    assert effects == [AbortResponse(start.request_id, "client_cancel")]
    s.on_event(start.response_id, TextDelta(0, " late"))
    s.on_event(start.response_id, MediaDelta(1, (clip(0.1),)))
    finish(s, start, "partial late", clip(0.2))
    s.on_error(start.response_id, StageDeadError("gone"))
    events = drain(s)
    assert events[-1]["type"] == "response.done"
    assert events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancel"}
    send(s, type="response.cancel")
    assert drain(s)[-1]["error"]["code"] == "response_cancel_not_active"
    assert isinstance(ask(s), StartResponse)  # the session goes on


def test_one_response_at_a_time_and_an_engine_error_fails_it() -> None:
    s = session()
    start = ask(s)
    assert send(s, type="response.create") == []
    assert drain(s)[-1]["error"]["code"] == "conversation_already_has_active_response"
    s.on_error(start.response_id, StageDeadError("stage 1 died"))
    events = drain(s)
    assert [e["type"] for e in events] == ["error", "response.done"]
    assert events[0]["error"]["type"] == "service_unavailable" and events[0]["error"]["code"] == "stage_dead"
    assert events[1]["response"]["status"] == "failed"
    assert not s.responding


def test_vad_off_the_client_commits_and_audio_in_is_refused_clearly() -> None:
    s = session()
    send(s, type="input_audio_buffer.commit")
    assert drain(s)[-1]["error"]["code"] == "input_audio_buffer_commit_empty"
    send(s, type="input_audio_buffer.append", audio=pcm(200, 0.3))
    assert drain(s) == []  # no turn detection: no speech events
    send(s, type="input_audio_buffer.commit")
    assert drain(s)[-1]["type"] == "input_audio_buffer.committed"
    assert send(s, type="response.create") == []
    assert drain(s)[-1]["error"]["code"] == "no_audio_input"
    send(s, type="input_audio_buffer.append", audio=pcm(100, 0.3))
    send(s, type="input_audio_buffer.clear")
    assert drain(s)[-1]["type"] == "input_audio_buffer.cleared" and not s.buffer


def test_vad_on_detects_the_turn_and_new_speech_interrupts_the_response() -> None:
    s = session()
    send(s, type="session.update", session={"turn_detection": {"type": "server_vad", "threshold": 0.05,
         "silence_duration_ms": 200}})  # fmt: skip
    assert drain(s)[-1]["session"]["turn_detection"]["silence_duration_ms"] == 200
    start = ask(s)
    drain(s)
    effects = send(s, type="input_audio_buffer.append", audio=pcm(100, 0.0) + pcm(300, 0.3))
    effects += send(s, type="input_audio_buffer.append", audio=pcm(300, 0.0))
    types = [e["type"] for e in drain(s)]
    assert types[:2] == ["input_audio_buffer.speech_started", "response.done"]  # barge-in
    assert types[2:5] == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "error"]
    assert effects == [AbortResponse(start.request_id, "barge_in")]
    s.on_event(start.response_id, TextDelta(0, "late"))
    assert drain(s) == []


def test_the_buffer_limit_refuses_an_append_and_keeps_what_it_held() -> None:
    s = session(max_buffer_bytes=1000)
    send(s, type="input_audio_buffer.append", audio=base64.b64encode(bytes(800)).decode())
    send(s, type="input_audio_buffer.append", audio=base64.b64encode(bytes(400)).decode())
    assert drain(s)[-1]["error"]["code"] == "input_audio_buffer_full"
    assert len(s.buffer) == 800


def test_the_session_model_comes_from_the_capabilities() -> None:
    caps = ModelCapabilities(tasks=("chat",), kinds=("audio", "text"), stages={}, image_input=False)
    assert SessionModel.of("m", caps) == SessionModel("m", "chat", text=True, audio=True)
    speech = ModelCapabilities(tasks=("text2speech", "chat"), kinds=("audio",), stages={}, image_input=False)
    assert SessionModel.of("e", speech).task == "text2speech"
    image = ModelCapabilities(tasks=("text2image", "chat"), kinds=("image",), stages={}, image_input=False)
    with pytest.raises(ApiError) as refused:
        SessionModel.of("sd", image)
    assert refused.value.code == "no_speech" and refused.value.param == "model"
    hears = ModelCapabilities(
        tasks=("chat",), kinds=("audio", "text"), stages={}, image_input=False, audio_input_stage=0
    )
    assert SessionModel.of("v", hears).audio_input


# ---------------------------------------------------------------------- hostile messages

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_TYPES = st.sampled_from(
    ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "conversation.item.create",
     "response.create", "response.cancel", "response.cancel ", "nope", ""]
)  # fmt: skip
HOSTILE = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64),
    _JSON.map(json.dumps),
    st.builds(lambda t, body: json.dumps({"type": t, **body}), _TYPES, st.dictionaries(st.text(max_size=12), _JSON)),
    st.builds(lambda t: json.dumps({"type": "input_audio_buffer.append", "audio": t}), st.text(max_size=40)),
    st.builds(
        lambda s: json.dumps({"type": "session.update", "session": s}),
        st.fixed_dictionaries(
            {},
            optional={
                "voice": _JSON,
                "modalities": _JSON,
                "input_sample_rate": _JSON,
                "output_sample_rate": _JSON,
                "turn_detection": _JSON,
                "input_audio_transcription": _JSON,
                "tools": _JSON,
            },
        ),
    ),
    st.just("[" * 5000 + "]" * 5000),
    st.just(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 3_000_000})),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(HOSTILE, min_size=1, max_size=6))
def test_hostile_messages_get_an_error_each_and_the_session_goes_on(messages: list[str | bytes]) -> None:
    s = session(HEARING, max_buffer_bytes=4096)
    for message in messages:
        effects = s.receive(message)
        events = drain(s)
        assert all(isinstance(e, dict) and isinstance(e.get("type"), str) for e in events)
        json.dumps(events)  # every event can be sent
        for event in events:
            if event["type"] == "error":
                error = event["error"]
                assert error["code"] and error["message"] and error["type"] == "invalid_request_error"
        assert len(s.buffer) <= 4096
        assert all(isinstance(e, StartResponse | AbortResponse | Transcribe) for e in effects)
    # Whatever came before, a valid turn still works.
    if s.responding:
        s.cancel("client_cancel")
    assert isinstance(ask(s), StartResponse)


HEARS = SessionModel("tiny-omni-voice", "chat", text=True, audio=True, audio_input=True)
#: A model whose stage 0 hears up to 1 s of audio per request: the user's audio is heard as it comes.
HEARING = SessionModel(
    "tiny-omni-voice", "chat", text=True, audio=True, audio_input=True, audio_input_stage=0, audio_window_s=1.0
)


def test_a_committed_audio_turn_starts_a_response_with_its_samples_and_the_instructions() -> None:
    s = session(HEARS)  # the model's stage that hears is unknown: the turn goes whole
    send(s, type="session.update", session={"input_sample_rate": 16_000, "instructions": "Be brief."})
    first, second = pcm(200, 0.3, 16_000), pcm(100, 0.1, 16_000)
    send(s, type="input_audio_buffer.append", audio=first)
    send(s, type="input_audio_buffer.append", audio=second)
    send(s, type="input_audio_buffer.commit")
    drain(s)
    (start,) = send(s, type="response.create")
    assert isinstance(start, StartResponse)
    assert start.audio == base64.b64decode(first) + base64.b64decode(second) and start.sample_rate == 16_000
    assert start.prompt == "Be brief."  # the transcript follows it in the pipeline
    s.cancel("client_cancel")
    ask_text = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    send(s, type="conversation.item.create", item=ask_text)
    (start,) = send(s, type="response.create", response={"instructions": "Answer in French."})
    assert start.prompt == "Answer in French.\n\nhi" and start.audio is None and start.sample_rate is None
    assert start.heard  # text: nothing to recognise


def test_a_speech_only_model_speaks_the_text_alone_and_refuses_audio_turns() -> None:
    s = session(SessionModel("tiny-tts", "text2speech", text=False, audio=True))
    send(s, type="session.update", session={"instructions": "Be brief."})
    ask(s, "say this")  # the prompt is the text alone: instructions are not spoken
    s.cancel("client_cancel")
    send(s, type="input_audio_buffer.append", audio=pcm(100, 0.3))
    send(s, type="input_audio_buffer.commit")
    drain(s)
    assert send(s, type="response.create") == []
    assert drain(s)[-1]["error"]["code"] == "no_audio_input"


def test_a_session_keeps_the_latest_turns_audio_only_and_a_bounded_history() -> None:
    s = session(HEARS)
    for _ in range(3):
        send(s, type="input_audio_buffer.append", audio=pcm(20, 0.3))
        send(s, type="input_audio_buffer.commit")
    assert [item.audio is not None for item in s.items] == [False, False, True]
    for i in range(MAX_ITEMS + 5):
        send(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": str(i)}]})  # fmt: skip
    assert len(s.items) == MAX_ITEMS and s.items[-1].text == str(MAX_ITEMS + 4)


@given(instructions=st.text(st.characters(exclude_categories=()), max_size=40))
@example("\ud800 lone")
@example("  Be brief. ")
@settings(max_examples=40, deadline=None)
def test_any_instructions_reach_the_prompt_or_are_refused_with_an_error_event(instructions: str) -> None:
    s = session()
    # json.dumps writes a lone surrogate as its \ud800 escape, as a hostile client may.
    s.receive(json.dumps({"type": "session.update", "session": {"instructions": instructions}}))
    event = drain(s)[-1]
    if any(0xD800 <= ord(c) <= 0xDFFF for c in instructions):  # no message could carry it
        assert event["type"] == "error" and event["error"]["param"] == "session.instructions", event
        assert s.settings["instructions"] == ""
        return
    assert event["session"]["instructions"] == instructions
    send(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hello"}]})  # fmt: skip
    (start,) = send(s, type="response.create")
    assert start.prompt == "\n\n".join(p for p in (instructions.strip(), "hello") if p)


# ---------------------------------------------------------------------- hearing the audio as it comes


def then_pause(speech_ms: int, pause_ms: int, rate: int = RATE) -> str:
    """Base64 of ``speech_ms`` of tone, then ``pause_ms`` of silence."""
    return base64.b64encode(
        base64.b64decode(pcm(speech_ms, 0.3, rate)) + base64.b64decode(pcm(pause_ms, 0.0, rate))
    ).decode()


def heard(effects: list[Any]) -> list[Transcribe]:
    assert all(isinstance(e, Transcribe) for e in effects), effects
    return effects


def test_speech_is_heard_a_segment_at_a_time_and_the_answer_waits_for_the_whole_transcript() -> None:
    s = session(HEARING)
    send(s, type="session.update", session={"input_sample_rate": 16_000, "instructions": "Be brief."})
    assert s.settings["input_audio_transcription"] == {"model": None, "segment_silence_ms": 200}
    assert heard(send(s, type="input_audio_buffer.append", audio=pcm(300, 0.3, 16_000))) == []
    # A 200 ms pause after speech ends the first segment: heard now, while the turn goes on.
    (first,) = heard(send(s, type="input_audio_buffer.append", audio=pcm(300, 0.0, 16_000)))
    assert (first.index, first.stage, first.sample_rate) == (0, 0, 16_000)
    assert first.audio == base64.b64decode(pcm(300, 0.3, 16_000)) + base64.b64decode(pcm(300, 0.0, 16_000))
    assert heard(send(s, type="input_audio_buffer.append", audio=pcm(200, 0.3, 16_000))) == []
    drain(s)
    (tail,) = heard(send(s, type="input_audio_buffer.commit"))  # only what came after the cut
    assert tail.index == 1 and tail.item_id == first.item_id and len(tail.audio) == 2 * 3200
    assert [e["item_id"] for e in drain(s)] == [first.item_id]  # committed, under the id heard
    assert send(s, type="response.create") == []  # created, waiting for the transcript
    assert [e["type"] for e in drain(s)] == ["response.created"]
    # The segments come back out of order: the deltas go in order, then the whole, then the answer.
    assert s.on_transcript(tail.item_id, 1, " world ") == []
    assert drain(s) == []
    (start,) = s.on_transcript(first.item_id, 0, "hello")
    events = drain(s)
    assert [(e["type"].rsplit(".", 1)[1], e.get("delta", e.get("transcript"))) for e in events] == [
        ("delta", "hello"), ("delta", " world "), ("completed", "hello world")]  # fmt: skip
    assert {e["item_id"] for e in events} == {first.item_id}
    assert isinstance(start, StartResponse) and start.audio is None and start.heard
    assert start.prompt == "Be brief.\n\nhello world"
    finish(s, start, "hi", None)
    # The turn is answered again from its transcript: nothing is heard twice.
    (again,) = send(s, type="response.create")
    assert isinstance(again, StartResponse) and again.prompt == start.prompt


def test_a_turn_longer_than_the_models_window_is_heard_in_windows() -> None:
    s = session(HEARING)
    send(s, type="session.update", session={"input_sample_rate": 16_000})
    cuts = heard(send(s, type="input_audio_buffer.append", audio=pcm(2500, 0.3, 16_000)))
    assert [len(c.audio) for c in cuts] == [32_000, 32_000]  # 1 s each, the window
    (tail,) = heard(send(s, type="input_audio_buffer.commit"))
    assert len(tail.audio) == 16_000 and [c.index for c in [*cuts, tail]] == [0, 1, 2]


def test_pauses_cut_at_most_a_few_segments_at_once_and_the_rest_goes_with_the_next() -> None:
    s = session(HEARING)
    send(s, type="session.update", session={"input_sample_rate": 16_000, "input_audio_transcription": {
        "model": "whisper-1", "segment_silence_ms": 100}})  # fmt: skip
    cuts = []
    for _ in range(MAX_SEGMENTS_IN_FLIGHT + 2):
        cuts += heard(send(s, type="input_audio_buffer.append", audio=then_pause(100, 120, 16_000)))
    assert len(cuts) == MAX_SEGMENTS_IN_FLIGHT  # none heard back yet
    assert s.on_transcript(cuts[0].item_id, 0, "a") == []
    (more,) = heard(send(s, type="input_audio_buffer.append", audio=then_pause(100, 120, 16_000)))
    assert len(more.audio) == 3 * 2 * (1600 + 1920)  # the pauses it could not cut, with it


def test_clearing_the_buffer_aborts_the_segments_being_heard_and_drops_their_text() -> None:
    s = session(HEARING)
    send(s, type="session.update", session={"input_sample_rate": 16_000})
    (cut,) = heard(send(s, type="input_audio_buffer.append", audio=then_pause(100, 300, 16_000)))
    drain(s)
    (abort,) = send(s, type="input_audio_buffer.clear")
    assert isinstance(abort, AbortResponse) and abort.request_id == cut.request_id
    assert s.on_transcript(cut.item_id, 0, "late") == [] and [e["type"] for e in drain(s)] == [
        "input_audio_buffer.cleared"]  # fmt: skip
    # The next turn is a new item.
    (cut2,) = heard(send(s, type="input_audio_buffer.append", audio=then_pause(100, 300, 16_000)))
    assert cut2.item_id != cut.item_id and cut2.index == 0


def test_a_segment_that_cannot_be_heard_fails_the_item_and_its_response_and_the_session_goes_on() -> None:
    s = session(HEARING)
    send(s, type="session.update", session={"input_sample_rate": 16_000})
    (a,) = heard(send(s, type="input_audio_buffer.append", audio=then_pause(100, 300, 16_000)))
    send(s, type="input_audio_buffer.append", audio=pcm(100, 0.3, 16_000))
    (b,) = heard(send(s, type="input_audio_buffer.commit"))
    assert send(s, type="response.create") == []
    drain(s)
    (abort,) = s.on_transcript_error(a.item_id, 0, StageDeadError("stage 0 died", stage_id=0))
    assert isinstance(abort, AbortResponse) and abort.request_id == b.request_id
    types = [e["type"] for e in drain(s)]
    assert types == ["conversation.item.input_audio_transcription.failed", "error", "response.done"]
    assert not s.responding and s.on_transcript(b.item_id, 1, "late") == [] and drain(s) == []
    assert send(s, type="response.create") == []
    assert drain(s)[-1]["error"]["code"] == "input_audio_transcription_failed"
    assert isinstance(ask(s), StartResponse)


def test_a_cancel_while_the_transcript_is_heard_starts_nothing_after() -> None:
    s = session(HEARING)
    send(s, type="input_audio_buffer.append", audio=pcm(100, 0.3))
    (seg,) = heard(send(s, type="input_audio_buffer.commit"))
    assert send(s, type="response.create") == []
    (abort,) = send(s, type="response.cancel")
    assert isinstance(abort, AbortResponse)
    assert s.on_transcript(seg.item_id, 0, "hi") == []  # the transcript completes; no answer starts
    assert [e["type"] for e in drain(s)][-1] == "conversation.item.input_audio_transcription.completed"
    assert [e.request_id for e in s.close()] == []  # nothing left to abort


def test_vad_commits_a_turn_already_heard_and_its_answer_starts_at_once() -> None:
    s = session(HEARING)
    send(s, type="session.update", session={"input_sample_rate": 16_000, "turn_detection": {
        "type": "server_vad", "silence_duration_ms": 400}})  # fmt: skip
    send(s, type="input_audio_buffer.append", audio=pcm(300, 0.3, 16_000))
    (seg,) = heard(send(s, type="input_audio_buffer.append", audio=pcm(300, 0.0, 16_000)))  # cut at 200 ms
    assert s.on_transcript(seg.item_id, 0, "heard early") == []
    effects = send(s, type="input_audio_buffer.append", audio=pcm(200, 0.0, 16_000))  # the VAD commits
    (start,) = effects  # nothing more to hear: the answer starts with the commit
    assert isinstance(start, StartResponse) and start.prompt == "heard early" and start.heard
    types = [e["type"] for e in drain(s)]
    assert types.index("conversation.item.input_audio_transcription.completed") < types.index("response.created")


def test_closing_aborts_every_segment_being_heard() -> None:
    s = session(HEARING)
    send(s, type="input_audio_buffer.append", audio=pcm(100, 0.3))
    (committed,) = heard(send(s, type="input_audio_buffer.commit"))
    (open_turn,) = heard(send(s, type="input_audio_buffer.append", audio=then_pause(100, 300)))
    assert {e.request_id for e in s.close()} == {committed.request_id, open_turn.request_id}


def test_input_transcription_off_sends_the_turn_whole_and_a_deaf_model_refuses_it() -> None:
    s = session(HEARING)
    send(s, type="session.update", session={"input_audio_transcription": None})
    assert send(s, type="input_audio_buffer.append", audio=pcm(2500, 0.3)) == []  # no window cuts either
    send(s, type="input_audio_buffer.commit")
    (start,) = send(s, type="response.create")
    assert isinstance(start, StartResponse) and start.audio is not None and len(start.audio) == 2 * 60_000
    assert not start.heard  # the recognition stage hears it as part of the response
    deaf = session()
    send(deaf, type="session.update", session={"input_audio_transcription": {}})
    error = drain(deaf)[-1]["error"]
    assert error["code"] == "no_audio_input" and error["param"] == "session.input_audio_transcription"
    assert deaf.settings["input_audio_transcription"] is None


def test_at_most_a_few_segments_are_out_and_the_rest_wait_in_order_within_the_buffers_bound() -> None:
    s = session(HEARING, max_buffer_bytes=2 * 16_000 * 10)  # 10 s at 16 kHz
    send(s, type="session.update", session={"input_sample_rate": 16_000})
    out = heard(send(s, type="input_audio_buffer.append", audio=pcm(6500, 0.3, 16_000)))  # six windows, a tail
    assert [c.index for c in out] == list(range(MAX_SEGMENTS_IN_FLIGHT))
    (fifth,) = heard(s.on_transcript(out[0].item_id, 0, "a"))  # one heard: the next goes
    assert fifth.index == MAX_SEGMENTS_IN_FLIGHT
    assert heard(send(s, type="input_audio_buffer.commit")) == []  # the tail waits its turn
    # What waits to be heard counts against the buffer's bound: 1.5 s of it left 8.5 s of room.
    send(s, type="input_audio_buffer.append", audio=pcm(8600, 0.0, 16_000))
    assert drain(s)[-1]["error"]["code"] == "input_audio_buffer_full"
    assert heard(send(s, type="input_audio_buffer.append", audio=pcm(8400, 0.0, 16_000))) == []
    # Clearing the new turn frees nothing of the committed one; its segments come in order.
    send(s, type="input_audio_buffer.clear")
    released = []
    for segment in [*out[1:], fifth]:
        released += heard(s.on_transcript(segment.item_id, segment.index, "x"))
    assert [c.index for c in released] == [5, 6]
    for segment in released:
        assert heard(s.on_transcript(segment.item_id, segment.index, "y")) == []
    events = drain(s)
    assert [e["delta"] for e in events if e["type"].endswith("transcription.delta")][-2:] == ["y", "y"]
    assert events[-1]["type"] == "conversation.item.input_audio_transcription.completed"
    assert events[-1]["transcript"] == "a x x x x y y"


def test_changing_how_the_input_is_heard_mid_turn_hears_the_turn_again_under_the_new_settings() -> None:
    s = session(HEARING)
    send(s, type="session.update", session={"input_sample_rate": 16_000})
    (cut,) = heard(send(s, type="input_audio_buffer.append", audio=then_pause(100, 300, 16_000)))
    (abort,) = send(s, type="session.update", session={"input_audio_transcription": None})
    assert isinstance(abort, AbortResponse) and abort.request_id == cut.request_id
    assert s.on_transcript(cut.item_id, 0, "late") == []
    # Off: the turn goes whole, all of it.
    send(s, type="input_audio_buffer.append", audio=pcm(100, 0.3, 16_000))
    send(s, type="input_audio_buffer.commit")
    (start,) = send(s, type="response.create")
    assert isinstance(start, StartResponse) and len(start.audio or b"") == 2 * (1600 + 4800 + 1600)
    s.cancel("client_cancel")
    # On again mid-turn: what the buffer holds is heard from its start.
    send(s, type="input_audio_buffer.append", audio=pcm(100, 0.3, 16_000))
    assert send(s, type="session.update", session={"input_audio_transcription": {}}) == []
    (whole,) = heard(send(s, type="input_audio_buffer.commit"))
    assert whole.index == 0 and len(whole.audio) == 2 * 1600
