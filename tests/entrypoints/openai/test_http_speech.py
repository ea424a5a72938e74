"""``POST /v1/audio/speech`` on a real ``omni-runtime serve`` of tiny-tts, with the openai client.

Every ``response_format`` decoded back (rate, channels, length); ``with_streaming_response`` with
pcm arrives in several chunks (the first before the last: ordering, not timing); ``stream_format:
sse`` sends deltas, then one done event, whose audio is the same bytes; bad voice, speed, format,
model and hostile input (hypothesis) are 400s naming the field, and the server serves after.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_runtime.models.tiny_tts import SAMPLE_RATE

from .server_process import one_thread_config, start_server, stop_server

pytestmark = pytest.mark.e2e

TEXT = "hello there, general speech"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("speech")
    srv = start_server(one_thread_config(tmp / "tiny-tts.yaml", "tiny-tts"), log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def pcm(client: openai.OpenAI) -> np.ndarray:
    data = client.audio.speech.create(
        model="tiny-tts", voice="alloy", input=TEXT, response_format="pcm", extra_body={"seed": 5}
    ).content
    return np.frombuffer(data, dtype="<i2")


def decode(data: bytes, fmt: str) -> tuple[int, int, int]:
    """(sample rate, channels, samples per channel) of an encoded clip."""
    if fmt in ("wav", "flac", "opus"):
        info = soundfile.info(io.BytesIO(data))
        return info.samplerate, info.channels, info.frames
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = sum(f.samples for f in container.decode(stream))
        return stream.rate, stream.channels, frames


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav"])
def test_every_format_decodes_to_the_clip(client: openai.OpenAI, pcm: np.ndarray, fmt: str) -> None:
    resp = client.audio.speech.with_raw_response.create(
        model="tiny-tts", voice="alloy", input=TEXT, response_format=fmt, extra_body={"seed": 5}
    )
    assert resp.headers["content-type"].startswith("audio/")
    rate, channels, n = decode(resp.content, fmt)
    assert channels == 1
    assert rate == SAMPLE_RATE  # 16 kHz is one of Opus's own rates
    # Lossy codecs pad a frame or two at the ends.
    assert abs(n - len(pcm)) <= (0 if fmt in ("wav", "flac") else 3000), (n, len(pcm))


def test_the_wav_is_the_pcm(client: openai.OpenAI, pcm: np.ndarray) -> None:
    data = client.audio.speech.create(
        model="tiny-tts", voice="alloy", input=TEXT, response_format="wav", extra_body={"seed": 5}
    ).content
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == SAMPLE_RATE
    # soundfile scales by 32768, the pcm encoder by 32767: a unit or two apart.
    np.testing.assert_allclose(samples.astype(np.int32), pcm.astype(np.int32), atol=2)


def test_streamed_pcm_arrives_in_chunks(client: openai.OpenAI, pcm: np.ndarray) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="tiny-tts", voice="alloy", input=TEXT, response_format="pcm", extra_body={"seed": 5}
    ) as resp:
        assert resp.headers["content-type"] == "audio/pcm"
        chunks = [c for c in resp.iter_bytes() if c]
    assert len(chunks) > 1  # the first bytes came before the last were sent
    assert np.array_equal(np.frombuffer(b"".join(chunks), dtype="<i2"), pcm)


def test_sse_sends_deltas_then_done(http: httpx.Client, pcm: np.ndarray) -> None:
    body = {
        "model": "tiny-tts",
        "voice": "alloy",
        "input": TEXT,
        "response_format": "pcm",
        "stream_format": "sse",
        "seed": 5,
    }
    events = []
    with http.stream("POST", "/v1/audio/speech", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    types = [e["type"] for e in events]
    assert types[-1] == "speech.audio.done" and set(types[:-1]) == {"speech.audio.delta"} and len(types) > 2
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert np.array_equal(np.frombuffer(audio, dtype="<i2"), pcm)
    usage = events[-1]["usage"]
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_voice_and_speed_change_the_audio(client: openai.OpenAI, pcm: np.ndarray) -> None:
    def make(**kw: Any) -> np.ndarray:
        data = client.audio.speech.create(model="tiny-tts", input=TEXT, response_format="pcm", **kw).content
        return np.frombuffer(data, dtype="<i2")

    other = make(voice="ash", extra_body={"seed": 5})
    n = min(len(other), len(pcm))
    assert not np.array_equal(other[:n], pcm[:n])
    assert len(make(voice="alloy", speed=2.0, extra_body={"seed": 5})) < len(pcm) * 0.7


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"voice": "nobody"}, "voice"),
        ({"voice": {"id": "nobody"}}, "voice"),
        ({"speed": 4.5}, "speed"),
        ({"speed": 0.1}, "speed"),
        ({"response_format": "ogg"}, "response_format"),
        ({"stream_format": "chunks"}, "stream_format"),
        ({"input": "日本語"}, "input"),
        ({"input": "x" * 5000}, "input"),
        # Allowed lengths whose clip could pass engine_args.max_speech_seconds (60 s).
        ({"input": "ab " * 1365, "speed": 0.25}, "input"),
        ({"input": "ab " * 30, "speed": 0.25}, "speed"),
        ({"model": "tiny-sd"}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    resp = http.post("/v1/audio/speech", json={"model": "tiny-tts", "voice": "alloy", "input": TEXT, **fields})
    allowed = (400, 404) if param == "model" else (400,)
    assert resp.status_code in allowed, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


@pytest.mark.parametrize(("inputs", "param"), [({"speed": 0.25}, "inputs.prompt"), ({"speed": 1.0}, "inputs.prompt")])
def test_a_text2speech_job_whose_clip_could_pass_the_limit_is_a_400(
    http: httpx.Client, inputs: dict[str, Any], param: str
) -> None:
    body = {"task": "text2speech", "inputs": {"prompt": "ab " * 1365, **inputs}}
    resp = http.post("/v1/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and "max_speech_seconds" in resp.text, resp.text


FIELDS = ["input", "voice", "speed", "response_format", "stream_format", "instructions", "seed", "model"]
#: Lone surrogates (no message can carry them), huge strings, wrong types, numbers out of range.
VALUES = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.text(max_size=20),
    st.just("a" * 200_000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.sampled_from(["id", "x"]), st.text(max_size=3), max_size=2),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=VALUES)
def test_any_value_is_a_200_or_a_400(http: httpx.Client, field: str, value: object) -> None:
    body = {"model": "tiny-tts", "voice": "alloy", "input": "hi", "response_format": "pcm", field: value}
    # Surrogates are sent as JSON escapes (the body itself must be UTF-8).
    resp = http.post("/v1/audio/speech", content=json.dumps(body), headers={"Content-Type": "application/json"})
    if resp.status_code == 200:
        return
    assert resp.status_code in ((400, 404) if field == "model" else (400,)), resp.text
    error = resp.json()["error"]
    assert error["message"] and (error["param"] or "").split(".")[0] == field, resp.text


def test_the_server_serves_after_the_hostile_values(client: openai.OpenAI, pcm: np.ndarray) -> None:
    data = client.audio.speech.create(
        model="tiny-tts", voice="alloy", input=TEXT, response_format="pcm", extra_body={"seed": 5}
    ).content
    assert np.array_equal(np.frombuffer(data, dtype="<i2"), pcm)


def test_the_model_card_says_it_speaks(http: httpx.Client) -> None:
    # The playground picks its fields and its /v1/generate task from these.
    (card,) = http.get("/v1/models").json()["data"]
    assert card["kinds"] == ["audio"] and card["tasks"] == ["text2speech"]
