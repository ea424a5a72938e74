"""Debian's espeak-ng as a speech model (``omni-runtime serve espeak``: a ``subprocess`` stage), on
a real server with the openai client, and through ``omni-runtime generate``.

The model card lists text2speech; ``/v1/audio/speech`` returns espeak-ng's own speech (the samples
equal to what espeak-ng writes when run by hand with the same voice and rate); voice and speed
change it; an unknown voice, a speed outside espeak-ng's range and a text whose clip could pass
``max_speech_seconds`` are 400s naming the field, before anything runs; the CLI writes the WAV;
and a chat answer of the tiny LM comes back spoken by espeak-ng (``message.audio``).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import psutil
import pytest
import soundfile
import yaml

from .server_process import CLI, REPO, start_server, stop_server, write_config

pytestmark = pytest.mark.e2e

TEXT = "The quick brown fox jumps over the lazy dog."
RATE = 22_050


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server("espeak", log=tmp_path_factory.mktemp("espeak") / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def espeak_by_hand(tmp_path: Path, text: str, voice: str, wpm: int) -> np.ndarray:
    out = tmp_path / "by_hand.wav"
    subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(out), "--stdin"], input=text.encode(), check=True
    )
    data, rate = soundfile.read(out, dtype="int16")
    assert rate == RATE
    return data


def speak(client: openai.OpenAI, text: str = TEXT, **fields: Any) -> np.ndarray:
    data = client.audio.speech.create(model="espeak", input=text, response_format="wav", **fields).content
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE and samples.ndim == 1
    return samples


def test_the_model_card_says_it_speaks(http: httpx.Client) -> None:
    (card,) = http.get("/v1/models").json()["data"]
    assert card["id"] == "espeak"
    assert card["kinds"] == ["audio"] and card["tasks"] == ["text2speech"]


def test_the_speech_is_espeak_ngs_own(client: openai.OpenAI, tmp_path: Path) -> None:
    samples = speak(client, voice="alloy")
    assert 1.5 < len(samples) / RATE < 5  # a sentence
    assert np.sqrt(np.mean(samples.astype(np.float64) ** 2)) > 500  # speech, not silence
    assert np.array_equal(samples, espeak_by_hand(tmp_path, TEXT, "en-us", 175))


def test_voice_and_speed_change_the_audio(client: openai.OpenAI, tmp_path: Path) -> None:
    usual = speak(client, voice="alloy")
    faster = speak(client, voice="alloy", speed=2.0)
    assert len(faster) < 0.7 * len(usual)
    assert np.array_equal(faster, espeak_by_hand(tmp_path, TEXT, "en-us", 350))
    british = speak(client, voice="fable")
    assert not np.array_equal(british[: len(usual)], usual[: len(british)])
    assert np.array_equal(speak(client, voice="de", text="Guten Tag"), espeak_by_hand(tmp_path, "Guten Tag", "de", 175))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"voice": "klingon"}, "voice"),
        ({"voice": "en-us; rm -rf /"}, "voice"),
        ({"speed": 3.0}, "speed"),
        ({"speed": 0.3}, "speed"),
        # 600 s at 0.75 s a character: 800 characters at speed 1, fewer slower.
        ({"input": "7" * 801}, "input"),
        ({"input": "7" * 500, "speed": 0.5}, "speed"),  # fits at speed 1: slower is what passes
    ],
)
def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    body = {"model": "espeak", "voice": "alloy", "input": TEXT, **fields}
    resp = http.post("/v1/audio/speech", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_it_serves_after_the_refusals(client: openai.OpenAI) -> None:
    assert len(speak(client, voice="nova", text="still here")) > RATE // 4


#: Text a speech program may choke on: NUL and escape sequences, bidi overrides, zero-width and
#: combining marks, emoji, scripts without a voice, a byte order mark.
HOSTILE_TEXTS = [
    "a\x00b", "\x1b[31mred\x1b[0m", "\u202eevil.exe", "a\u0301" * 50, "\U0001f600" * 40, "\u200d" * 30,
    "\ufeffhello", "\u6f22\u5b57\u304b\u306a", "\u0627\u0644\u0633\u0644\u0627\u0645", "-v de --stdin", "%s%n{0}",
]  # fmt: skip


def test_many_concurrent_hostile_and_abandoned_requests_leave_no_program_behind(server, http: httpx.Client) -> None:
    """Forty requests from eight threads at once, with hostile text, every voice and the edge
    speeds; every fourth client gives up mid-request (its program is stopped). Each request that
    is waited for is a WAV of some length or a 400; none is a 500; no espeak-ng is left running;
    and the server speaks afterwards."""
    voices = ["alloy", "fable", "de", "cmn", "ja", "en-us"]

    def one(i: int) -> int | None:
        body = {"model": "espeak", "input": HOSTILE_TEXTS[i % len(HOSTILE_TEXTS)], "voice": voices[i % len(voices)],
                "speed": [0.46, 1.0, 2.57][i % 3], "response_format": "wav"}  # fmt: skip
        abandon = i % 4 == 3
        try:
            with httpx.Client(base_url=server.url, timeout=0.02 if abandon else 60) as c:
                resp = c.post("/v1/audio/speech", json=body)
        except httpx.TimeoutException:
            assert abandon
            return None
        if resp.status_code == 200:
            samples, rate = soundfile.read(io.BytesIO(resp.content), dtype="int16")
            assert rate == RATE and len(samples) > 0
        return resp.status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(40)))
    assert all(code in (None, 200, 400) for code in codes), codes
    assert codes.count(200) >= 20, codes

    def programs() -> list[int]:
        found = []
        for p in server.children():
            with contextlib.suppress(psutil.Error):
                if p.name() == "espeak-ng" and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p.pid)
        return found

    deadline = time.monotonic() + 10
    while programs():
        assert time.monotonic() < deadline, programs()
        time.sleep(0.05)
    assert http.post("/v1/audio/speech", json={"model": "espeak", "input": TEXT, "voice": "alloy"}).status_code == 200


def test_the_cli_speaks_a_wav_file(tmp_path: Path) -> None:
    out = subprocess.run(
        [*CLI, "generate", "--model", "espeak", TEXT, "--voice", "alloy",
         "--speed", "1.5", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    (result,) = report["results"]
    assert report["audios"] == 1 and result["params"]["voice"] == "alloy"
    samples, rate = soundfile.read(result["files"][0], dtype="int16")
    assert rate == RATE
    assert np.array_equal(samples, espeak_by_hand(tmp_path, TEXT, "en-us", 262))


def test_a_chat_answer_is_spoken_by_espeak(tmp_path: Path) -> None:
    # The tiny LM answers; the espeak stage speaks its answer (as tiny-omni-speech's VITS does).
    lm = yaml.safe_load((REPO / "stage_configs" / "tiny-omni-speech.yaml").read_text())["stage_args"][0]
    speech = yaml.safe_load((REPO / "stage_configs" / "espeak.yaml").read_text())["stage_args"][0]
    speech |= {
        "stage_id": 1,
        "engine_input_source": [0],
        "custom_process_input_func": "omni_runtime.input_funcs:speak_text",
    }
    config = write_config(tmp_path / "lm-espeak.yaml", {"model": "lm-espeak", "stage_args": [lm, speech]})
    srv = start_server(str(config), log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        resp = client.chat.completions.create(
            model="lm-espeak",
            messages=[{"role": "user", "content": "say something"}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},  # type: ignore[typeddict-item]
            seed=3,
        )
        message = resp.choices[0].message
        assert message.audio is not None
        samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="int16")
        assert rate == RATE
        # speak_text speaks the answer's words (or the prompt where the answer has none).
        words = " ".join((message.content or "").split())
        spoken = words if any(c.isalnum() for c in words) else "say something"
        assert np.array_equal(samples, espeak_by_hand(tmp_path, spoken, "en-us", 175))
    finally:
        stop_server(srv)
