"""Chat that answers with audio, on a real ``omni-runtime serve`` of tiny-omni-speech (the tiny LM,
then a tiny VITS speech stage speaking its answer), through the real ``openai`` client:
``message.audio`` in every format decoded back, ``pcm16`` streamed as ``delta.audio`` chunks after
the text and equal to the whole answer's audio, text-only requests, ``/v1/generate`` with
``text2speech`` (voice, speed), bad and hostile values as 400s naming the field, and the server
still serving with the same stage processes afterwards."""

from __future__ import annotations

import base64
import io
import json
import time
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import ANY_TEXT, JSON_VALUES

from .jobs_client import submit, wait_status
from .server_process import start_server, stop_server

pytestmark = pytest.mark.e2e

#: tiny-tts speaks mono at 16 kHz.
RATE = 16_000
MESSAGES = [{"role": "user", "content": "say something about the sea"}]

FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat-audio")
    srv = start_server("tiny-omni-speech", log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def stage_pids(server) -> list[int]:
    return [p.pid for p in server.stage_processes()]


def decode(data: bytes) -> tuple[np.ndarray, int]:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples, rate


def spoken(client: openai.OpenAI, fmt: str, voice: str = "alloy", seed: int = 5) -> Any:
    return client.chat.completions.create(
        model="tiny-omni-speech",
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": voice, "format": fmt},  # type: ignore[typeddict-item]
        seed=seed,
    )


def test_chat_answers_with_wav_audio_and_its_transcript(client, stage_pids):
    resp = spoken(client, "wav")
    message = resp.choices[0].message
    audio = message.audio
    assert audio is not None and audio.id.startswith("audio_")
    assert audio.transcript == message.content and message.content
    assert audio.expires_at > time.time()
    samples, rate = decode(base64.b64decode(audio.data))
    assert rate == RATE and samples.shape[1] == 1 and samples.shape[0] > 0


def test_every_format_decodes_to_the_same_clip(client):
    wav, _ = decode(base64.b64decode(spoken(client, "wav").choices[0].message.audio.data))
    n = wav.shape[0]
    pcm = np.frombuffer(base64.b64decode(spoken(client, "pcm16").choices[0].message.audio.data), dtype="<i2")
    assert pcm.shape == (n,)  # raw 16-bit mono: the clip's samples, no header
    assert np.allclose(pcm / 32767.0, wav[:, 0], atol=2e-4)
    flac, rate = decode(base64.b64decode(spoken(client, "flac").choices[0].message.audio.data))
    assert rate == RATE and flac.shape == wav.shape  # both lossless 16-bit, up to their rounding
    assert np.allclose(flac, wav, atol=2 / 32768)
    mp3, rate = decode(base64.b64decode(spoken(client, "mp3").choices[0].message.audio.data))
    assert rate == RATE and mp3.shape[1] == 1 and n <= mp3.shape[0] <= n + 2 * 1152
    opus, rate = decode(base64.b64decode(spoken(client, "opus").choices[0].message.audio.data))
    assert rate == RATE and opus.shape[1] == 1 and opus.shape[0] > 0


def test_pcm16_streams_audio_chunks_after_the_text_equal_to_the_whole_answer(client):
    whole = spoken(client, "pcm16").choices[0].message
    stream = client.chat.completions.create(
        model="tiny-omni-speech",
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        seed=5,
        stream=True,
    )
    order: list[str] = []
    text, pieces = "", []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            text += delta.content
            order.append("text")
        audio = getattr(delta, "audio", None)
        if audio:
            pieces.append(audio if isinstance(audio, dict) else audio.model_dump(exclude_unset=True))
            order.append("audio")
    assert text == whole.content
    assert order.index("audio") > max(i for i, kind in enumerate(order) if kind == "text")
    assert pieces[0]["transcript"] == whole.content and pieces[0]["expires_at"] > time.time()
    assert len({p["id"] for p in pieces}) == 1 and all("transcript" not in p for p in pieces[1:])
    data = b"".join(base64.b64decode(p["data"]) for p in pieces)
    assert data == base64.b64decode(whole.audio.data)
    if len(data) // 2 > 4096:  # a clip longer than one chunk comes in several
        assert len(pieces) > 1


def test_audio_without_text_keeps_the_transcript_and_leaves_the_text_out(client, http):
    both = spoken(client, "wav").choices[0].message
    body = {"messages": MESSAGES, "modalities": ["audio"], "audio": {"voice": "alloy", "format": "wav"}, "seed": 5}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message.get("content") is None
    assert message["audio"]["transcript"] == both.content and message["audio"]["data"] == both.audio.data
    events = http.post("/v1/chat/completions", json=body | {"stream": True}).text.splitlines()
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events if e.startswith("data: {")]
    assert not any(d.get("content") for d in deltas)
    assert [d["audio"]["transcript"] for d in deltas if "audio" in d] == [both.content]


def test_text_only_requests_still_work(client):
    resp = client.chat.completions.create(model="tiny-omni-speech", messages=MESSAGES, modalities=["text"])
    message = resp.choices[0].message
    assert message.content is not None and message.audio is None


def test_text2speech_job_with_voice_and_speed(http):
    def clip(speed: float) -> tuple[dict[str, Any], np.ndarray]:
        inputs = {"prompt": "hello there", "voice": "echo", "speed": speed, "seed": 9}
        job = submit(http, {"task": "text2speech", "inputs": inputs, "config": {"output_format": "flac"}})
        job = wait_status(http, job["job_id"], {"completed", "failed"})
        assert job["status"] == "completed", job
        content = http.get(f"/v1/jobs/{job['job_id']}/content")
        assert content.headers["content-type"] == "audio/flac"
        samples, rate = decode(content.content)
        assert rate == RATE and samples.shape[1] == 1
        return job["result"]["audios"][0], samples

    meta, normal = clip(1.0)
    assert meta["sample_rate"] == RATE and meta["channels"] == 1 and meta["seed"] == 9
    assert meta["duration_s"] == pytest.approx(normal.shape[0] / RATE, abs=1e-4)
    _, fast = clip(2.0)
    assert fast.shape[0] < normal.shape[0]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"task": "text2speech", "inputs": {"prompt": "hi", "voice": "nobody"}}, "inputs.voice"),
        ({"task": "text2speech", "inputs": {"prompt": "hi", "speed": 9}}, "inputs.speed"),
        ({"task": "text2speech", "inputs": {"prompt": "hi", "num_inference_steps": 2}}, "inputs.num_inference_steps"),
        (
            {"task": "text2speech", "inputs": {"prompt": "hi"}, "config": {"output_format": "png"}},
            "config.output_format",
        ),
        ({"task": "text2audio", "inputs": {"prompt": "hi"}}, "model"),  # "...it serves `text2speech`..."
        ({"task": "text2image", "inputs": {"prompt": "hi"}}, "model"),
    ],
)
def test_bad_speech_jobs_are_400s_naming_the_field(http, body, param):
    r = http.post("/v1/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("audio", "param"),
    [({"voice": "nobody"}, "audio.voice"), ({"voice": "alloy", "format": "aiff"}, "audio.format"), ({}, "audio.voice")],
)
def test_bad_chat_audio_is_a_400_naming_the_field(http, audio, param):
    body = {"messages": MESSAGES, "modalities": ["text", "audio"], "audio": audio}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


hostile_audio = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries(
        {},
        optional={
            "voice": st.one_of(ANY_TEXT, st.sampled_from(["alloy", "nova"]), JSON_VALUES),
            "format": st.one_of(st.sampled_from(["wav", "pcm16"]), JSON_VALUES),
        },
    ),
)


@FUZZ
@given(audio=hostile_audio, stream=st.booleans())
def test_hostile_chat_audio_is_answered_never_5xx(http, audio, stream):
    body = {"messages": MESSAGES, "modalities": ["text", "audio"], "audio": audio, "stream": stream, "max_tokens": 2}
    r = http.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"]


def test_the_server_still_serves_with_the_same_stages(client, server, stage_pids):
    resp = spoken(client, "wav", voice="nova")
    samples, rate = decode(base64.b64decode(resp.choices[0].message.audio.data))
    assert rate == RATE and samples.shape[0] > 0
    assert [p.pid for p in server.stage_processes()] == stage_pids
