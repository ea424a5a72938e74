"""Realtime sessions (``WS /v1/realtime``) on a real ``omni-runtime serve`` of tiny-omni-voice (a tiny
Whisper, the tiny LM, then a tiny VITS speech stage) with an API key and at most 20 sessions: a
text turn gets its transcript, then its audio (pcm16 at the session's rate), then
``response.done``; so does a spoken turn, committed by the client or by the server's VAD, and the
session's instructions reach the LM's prompt; a cancel mid-answer, or speech that the server's VAD
detects, ends the response (nothing of it after its ``response.done``) and the session goes on;
a client that vanishes has its request aborted; 20 sessions at once each get their answer, and a
21st is refused until one closes; audio longer than the model's window, bad instructions and a
wrong rate are error events and the session goes on; refusals (no key, an unknown model) are an
error event and a close code, and so is an idle session; a message too large is an error and the
session goes on."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import time
from typing import Any

import httpx
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from .server_process import start_server, stop_server, wait_for

pytestmark = pytest.mark.e2e

KEY = "realtime-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: The server's idle timeout (``--realtime-idle-timeout``).
IDLE_S = 2
#: The most sessions it holds at once (``--realtime-sessions``).
SESSIONS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("realtime")
    # A body deadline shorter than the idle timeout: a session outlives it (the HTTP read deadlines
    # end at the upgrade), which the idle test checks.
    args = (
        "tiny-omni-voice", "--api-key", KEY, "--realtime-sessions", str(SESSIONS),
        "--realtime-idle-timeout", str(IDLE_S), "--body-timeout", "1",
    )  # fmt: skip
    srv = start_server(*args, log=tmp / "server.log")
    yield srv
    stop_server(srv)


def url(server, query: str = "") -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime" + query


def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=30))


def until(ws: ClientConnection, kind: str) -> list[dict[str, Any]]:
    events = [recv(ws)]
    while events[-1]["type"] != kind:
        events.append(recv(ws))
    return events


def open_session(server, **settings: Any) -> ClientConnection:
    """A session (waiting, while the server holds its most, for those of the tests before to be
    seen closed), with ``settings`` applied."""
    deadline = time.monotonic() + 10
    while True:
        ws = connect(url(server), additional_headers=AUTH, open_timeout=10)
        first = recv(ws)
        if first["type"] == "session.created":
            break
        ws.close()
        assert first["error"]["code"] == "too_many_sessions" and time.monotonic() < deadline, first
        time.sleep(0.05)
    if settings:
        ws.send(json.dumps({"type": "session.update", "session": settings}))
        assert recv(ws)["type"] == "session.updated"
    return ws


def opens(server) -> bool:
    """Whether a session opens now (it is closed again at once)."""
    with connect(url(server), additional_headers=AUTH, open_timeout=10) as ws:
        return recv(ws)["type"] == "session.created"


def say(ws: ClientConnection, text: str, **response: Any) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    ws.send(json.dumps({"type": "response.create", **({"response": response} if response else {})}))


def aborted(http: httpx.Client, reason: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("omni_requests_aborted_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as c:
        yield c


def test_a_text_turn_gets_its_transcript_then_its_audio_then_done(server):
    with open_session(server, output_sample_rate=16000) as ws:
        say(ws, "tell me about the sea")
        events = until(ws, "response.done")
    types = [e["type"] for e in events]
    assert types[:2] == ["conversation.item.created", "response.created"]
    response_id = events[1]["response"]["id"]
    transcript = [i for i, t in enumerate(types) if t == "response.audio_transcript.delta"]
    audio = [i for i, t in enumerate(types) if t == "response.audio.delta"]
    # The answer is spoken chunk by chunk as it streams: its first words come before any audio.
    assert transcript and audio and min(transcript) < min(audio), types
    assert all(e.get("response_id") == response_id for e in events[2:-1])
    pcm = b"".join(base64.b64decode(events[i]["delta"]) for i in audio)
    assert len(pcm) % 2 == 0 and len(pcm) > 2 * 1600  # more than 0.1 s at 16 kHz
    done = events[-1]["response"]
    assert done["id"] == response_id and done["status"] == "completed"
    assert done["usage"]["output_token_details"]["audio_tokens"] == pytest.approx(len(pcm) / 2 / 16000 * 50, abs=1)
    assert done["usage"]["input_tokens"] > 0


def test_a_cancel_mid_answer_ends_it_and_the_session_goes_on(server, http):
    before = aborted(http, "client_cancel")
    with open_session(server, max_response_output_tokens=200) as ws:
        say(ws, "tell me a long story about the sea and the sky")
        first = until(ws, "response.audio_transcript.delta")
        cancelled_id = first[-1]["response_id"]
        ws.send(json.dumps({"type": "response.cancel"}))
        events = until(ws, "response.done")
        assert events[-1]["response"]["id"] == cancelled_id
        assert events[-1]["response"]["status"] == "cancelled"
        say(ws, "and now?", max_response_output_tokens=4)
        after = until(ws, "response.done")
    assert all(e.get("response_id") != cancelled_id for e in after)
    assert not any(e["type"] == "response.done" and e["response"]["id"] == cancelled_id for e in after)
    assert after[-1]["response"]["status"] == "completed"
    assert aborted(http, "client_cancel") == before + 1


def tone(ms: int, amplitude: float, rate: int = 16_000) -> str:
    """Base64 pcm16 of a 300 Hz tone (silence at amplitude 0)."""
    n = rate * ms // 1000
    wave = amplitude * np.sin(2 * np.pi * 300 * np.arange(n) / rate)
    return base64.b64encode(np.round(wave * 32767).astype("<i2").tobytes()).decode()


def test_speech_detected_mid_answer_interrupts_it_and_ends_the_turn(server, http):
    before = aborted(http, "barge_in")
    vad = {"type": "server_vad", "threshold": 0.05, "silence_duration_ms": 200, "create_response": False}
    with open_session(server, input_sample_rate=16000, turn_detection=vad, max_response_output_tokens=200) as ws:
        say(ws, "tell me a long story about the sea and the sky")
        first = until(ws, "response.audio_transcript.delta")
        interrupted = first[-1]["response_id"]
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(100, 0.0)}))
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(300, 0.3)}))
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(300, 0.0)}))
        events = until(ws, "input_audio_buffer.committed")
    types = [e["type"] for e in events]
    started = types.index("input_audio_buffer.speech_started")
    assert events[started]["audio_start_ms"] == 100
    done = types.index("response.done")
    assert started < done < types.index("input_audio_buffer.speech_stopped")
    assert events[done]["response"]["id"] == interrupted
    assert events[done]["response"]["status_details"]["reason"] == "barge_in"
    assert all(e.get("response_id") != interrupted for e in events[done:])
    assert aborted(http, "barge_in") == before + 1


def test_a_client_that_vanishes_has_its_request_aborted(server, http):
    before = aborted(http, "client_disconnect")
    ws = open_session(server, max_response_output_tokens=200)
    say(ws, "keep talking")
    until(ws, "response.audio_transcript.delta")
    ws.close()
    assert wait_for(lambda: aborted(http, "client_disconnect") == before + 1, timeout=10)


def test_a_stage_that_dies_mid_answer_fails_the_response_and_the_session_goes_on(server, http):
    """The LM's process is killed while it answers: the response ends with an ``error`` event
    (``stage_dead``) and ``response.done`` failed; once the stage is back, the same session is
    answered."""
    body = {"method": "ping", "stage_ids": [1]}
    [replica] = http.post("/v1/omni/collective_rpc", json=body).json()
    with open_session(server, max_response_output_tokens=200) as ws:
        say(ws, "tell me a long story about the sea and the sky")
        until(ws, "response.audio_transcript.delta")
        os.kill(replica["result"]["pid"], signal.SIGKILL)
        events = until(ws, "response.done")
        error = next(e for e in events if e["type"] == "error")["error"]
        assert error["code"] == "stage_dead" and error["type"] == "service_unavailable", error
        assert events[-1]["response"]["status"] == "failed"
        deadline = time.monotonic() + 60
        while True:  # refused (stage_dead) until the restarted replica is ready
            say(ws, "are you back?", max_response_output_tokens=2)
            done = until(ws, "response.done")[-1]["response"]
            if done["status"] == "completed" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert done["status"] == "completed", done


def test_refusals_are_an_error_event_and_a_close_code(server):
    wrong_key = ["realtime", "openai-insecure-api-key.wrong"]
    for headers, subprotocols, query, code, close in (
        ({}, None, "", "invalid_api_key", 4401),
        ({"Authorization": "Bearer wrong"}, None, "", "invalid_api_key", 4401),
        ({}, wrong_key, "", "invalid_api_key", 4401),
        (AUTH, None, "?model=nope", "model_not_found", 4404),
    ):
        with connect(url(server, query), additional_headers=headers, subprotocols=subprotocols, open_timeout=10) as ws:
            assert recv(ws)["error"]["code"] == code
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
            assert ws.close_code == close


def test_a_browser_sends_the_key_as_a_subprotocol(server):
    """A browser cannot set a WebSocket's headers: the key comes as a subprotocol beside
    ``realtime``, which the session is accepted with."""
    offered = ["realtime", f"openai-insecure-api-key.{KEY}"]
    with connect(url(server), subprotocols=offered, open_timeout=10) as ws:
        assert recv(ws)["type"] == "session.created" and ws.subprotocol == "realtime"


def test_twenty_sessions_at_once_each_get_their_answer_and_one_more_is_refused(server):
    sessions = [open_session(server, output_sample_rate=16000) for _ in range(SESSIONS)]
    try:
        for i, ws in enumerate(sessions):  # every turn is asked before any answer is read
            say(ws, f"question {i}", max_response_output_tokens=4)
        with connect(url(server), additional_headers=AUTH, open_timeout=10) as extra:
            error = recv(extra)
            assert error["type"] == "error" and error["error"]["code"] == "too_many_sessions"
            with pytest.raises(ConnectionClosed):
                extra.recv(timeout=10)
            assert extra.close_code == 4503
        answers = [until(ws, "response.done") for ws in sessions]
    finally:
        for ws in sessions:
            ws.close()
    for events in answers:
        response_id = events[1]["response"]["id"]
        assert events[-1]["response"]["id"] == response_id and events[-1]["response"]["status"] == "completed"
        assert all(e.get("response_id") in (None, response_id) for e in events)
        assert any(e["type"] == "response.audio.delta" for e in events)
    assert len({events[1]["response"]["id"] for events in answers}) == SESSIONS
    # The server sees the closes a moment later; then it serves a new session.
    assert wait_for(lambda: opens(server), timeout=10, interval=0.1)
    with open_session(server) as ws:
        say(ws, "still there?", max_response_output_tokens=2)
        assert until(ws, "response.done")[-1]["response"]["status"] == "completed"


def spoken_turn(events: list[dict[str, Any]], *, heard: bool = True) -> None:
    """A spoken turn's answer: committed, then (``heard``) the user's transcript complete, then the
    answer's first words, then audio, then done (completed)."""
    types = [e["type"] for e in events]
    committed, created = types.index("input_audio_buffer.committed"), types.index("response.created")
    transcript = [i for i, t in enumerate(types) if t == "response.audio_transcript.delta"]
    audio = [i for i, t in enumerate(types) if t == "response.audio.delta"]
    assert transcript and audio and committed < created < min(transcript) < min(audio), types
    user = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    if heard:
        assert len(user) == 1 and user[0]["item_id"] == events[committed]["item_id"], types
        assert types.index(user[0]["type"]) < min(transcript)
        assert isinstance(user[0]["transcript"], str)
    else:
        assert user == []
    assert events[-1]["response"]["status"] == "completed", events[-1]
    assert events[-1]["response"]["usage"]["input_tokens"] > 0


def test_a_spoken_turn_committed_by_the_client_gets_text_then_audio(server):
    with open_session(server, input_sample_rate=16000, output_sample_rate=16000) as ws:
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(400, 0.3)}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        ws.send(json.dumps({"type": "response.create", "response": {"max_response_output_tokens": 4}}))
        spoken_turn(until(ws, "response.done"))


def recognised(http: httpx.Client) -> int:
    """Requests the recognition stage (stage 0) has served."""
    body = {"method": "get_stats", "stage_ids": [0]}
    [replica] = http.post("/v1/omni/collective_rpc", json=body).json()
    return int(replica["result"]["requests_served"])


def test_the_users_speech_is_heard_before_the_turn_ends(server, http):
    """A pause mid-turn ends a segment, transcribed at once: its delta comes while the turn is
    still open; the commit sends only the rest, and the transcript is the two joined. The answer
    enters the pipeline after the recognition stage, which serves the two segments only."""
    before = recognised(http)
    with open_session(server, input_sample_rate=16000, output_sample_rate=16000) as ws:
        for ms, amplitude in ((400, 0.3), (300, 0.0)):
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(ms, amplitude)}))
        first = until(ws, "conversation.item.input_audio_transcription.delta")[-1]
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(300, 0.3)}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        ws.send(json.dumps({"type": "response.create", "response": {"max_response_output_tokens": 4}}))
        events = until(ws, "response.done")
    spoken_turn(events)
    second = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    (whole,) = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert len(second) == 1 and whole["item_id"] == first["item_id"] == second[0]["item_id"]
    assert whole["transcript"] == " ".join(t for t in (first["delta"].strip(), second[0]["delta"].strip()) if t)
    assert recognised(http) == before + 2
    # A text turn has nothing to recognise either.
    with open_session(server) as ws:
        say(ws, "hello", max_response_output_tokens=2)
        assert until(ws, "response.done")[-1]["response"]["status"] == "completed"
    assert recognised(http) == before + 2


def test_a_spoken_turn_that_the_vad_ends_gets_text_then_audio(server):
    vad = {"type": "server_vad", "threshold": 0.05, "silence_duration_ms": 200}
    with open_session(server, input_sample_rate=24000, turn_detection=vad, max_response_output_tokens=4) as ws:
        for ms, amplitude in ((100, 0.0), (400, 0.3), (300, 0.0)):
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(ms, amplitude, 24000)}))
        events = until(ws, "response.done")
    types = [e["type"] for e in events]
    assert types.index("input_audio_buffer.speech_started") < types.index("input_audio_buffer.speech_stopped")
    assert types.index("input_audio_buffer.speech_stopped") < types.index("input_audio_buffer.committed")
    spoken_turn(events)


def test_the_sessions_instructions_reach_the_models_prompt(server):
    from tokenizers import Tokenizer

    from omni_runtime.models.builtin import ensure_builtin

    lm = Tokenizer.from_file(str(ensure_builtin("tiny-lm") / "tokenizer.json"))
    instructions = "You are a terse assistant."
    with open_session(server, max_response_output_tokens=2) as ws:
        say(ws, "hello there")
        plain = until(ws, "response.done")[-1]["response"]["usage"]["input_tokens"]
        ws.send(json.dumps({"type": "session.update", "session": {"instructions": instructions}}))
        assert recv(ws)["session"]["instructions"] == instructions
        say(ws, "hello there")
        told = until(ws, "response.done")[-1]["response"]["usage"]["input_tokens"]
    assert plain == len(lm.encode("hello there").ids)
    assert told == len(lm.encode(f"{instructions}\n\nhello there").ids) > plain


def test_hostile_audio_and_instructions_are_error_events_and_the_session_goes_on(server):
    off = {"input_sample_rate": 16000, "max_response_output_tokens": 2, "input_audio_transcription": None}
    with open_session(server, **off) as ws:
        # 1) longer than the model's window (10 s), sent whole with its response (the input is not
        # heard as it comes): refused before it is queued, the response fails
        for _ in range(3):
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(3700, 0.2)}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        ws.send(json.dumps({"type": "response.create"}))
        events = until(ws, "response.done")
        error = next(e for e in events if e["type"] == "error")["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "audio", error
        assert "10 s" in error["message"] and events[-1]["response"]["status"] == "failed"
        # heard as it comes, the same audio is cut at the window and answered
        ws.send(json.dumps({"type": "session.update", "session": {"input_audio_transcription": {}}}))
        assert recv(ws)["session"]["input_audio_transcription"]["segment_silence_ms"] == 200
        for _ in range(3):
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(3700, 0.2)}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        ws.send(json.dumps({"type": "response.create"}))
        events = until(ws, "response.done")
        spoken_turn(events)
        assert len([e for e in events if e["type"].endswith("input_audio_transcription.delta")]) == 2
        # 2) a rate outside 8 to 48 kHz, bad base64, a lone surrogate in the instructions
        for event, param in (
            ({"type": "session.update", "session": {"input_sample_rate": 96000}}, "session.input_sample_rate"),
            ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "audio"),
            ({"type": "session.update", "session": {"instructions": "\ud800"}}, "session.instructions"),
        ):
            ws.send(json.dumps(event))
            error = recv(ws)
            assert error["type"] == "error" and error["error"]["param"] == param, error
        # 3) the session still answers a spoken turn
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": tone(200, 0.3)}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        ws.send(json.dumps({"type": "response.create"}))
        spoken_turn(until(ws, "response.done"))


def test_a_message_too_large_is_refused_and_an_idle_session_is_closed(server):
    """Closed by its own idle timeout, not by the server's HTTP body deadline (1 s, shorter)."""
    with open_session(server) as ws:
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (1024 * 1024 + 8)}))
        assert recv(ws)["error"]["code"] == "message_too_large"
        ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        assert recv(ws)["type"] == "input_audio_buffer.cleared"
        started = time.monotonic()
        error = recv(ws)
        assert error["error"]["code"] == "idle_timeout" and time.monotonic() - started >= IDLE_S - 0.5
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 4408


def test_the_realtime_benchmark_times_first_audio_at_one_and_several_sessions(server):
    """benchmarks/realtime.py's measurement, small, on this server (its own starts one)."""
    from benchmarks.realtime import measure

    figures = asyncio.run(measure(url(server), AUTH, turns=2, concurrency=2, rounds=1, seconds=0.3, max_tokens=2))
    assert [(row["sessions"], row["turns"]) for row in figures["rows"]] == [(1, 2), (2, 2)]
    assert all(0 < row["first_audio_p50_ms"] < 30_000 for row in figures["rows"])
    assert figures["ratios"]["first_audio_p50_ratio"] > 0
