"""Audio jobs on a real ``omni-runtime serve`` of tiny-stable-audio (stereo 16 kHz, a few steps):
``/v1/generate`` with ``text2audio`` -> poll -> the clip from ``/v1/jobs/{id}/content`` and from
its file URL, with the encoder's Content-Type, decoded back with soundfile (rate, channels,
length); inline ``b64_json`` clips; step events of a long job, then its cancel; bad values as 400s
naming the field (hostile ones through hypothesis), and the engine still serves afterwards."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import EDGE_INTS, JSON_VALUES

from .jobs_client import first_step, submit, wait_status
from .server_process import one_thread_config, start_server, stop_server

pytestmark = pytest.mark.e2e

#: tiny-stable-audio's clips: stereo at 16 kHz, at most 2.048 s.
RATE, CHANNELS = 16_000, 2
#: A job that denoises for a long while unless cancelled.
LONG_STEPS = 400

FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audio-jobs")
    audio = one_thread_config(tmp / "tiny-stable-audio.yaml", "tiny-stable-audio")
    srv = start_server(audio, "--job-ttl", "600", log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def stage_pid(server) -> int:
    (stage,) = server.stage_processes()
    return stage.pid


def audio_body(prompt: str = "rain on a tin roof", **inputs: Any) -> dict[str, Any]:
    config = inputs.pop("config", {})
    top = {k: inputs.pop(k) for k in ("response_format", "async_run") if k in inputs}
    return {
        "task": "text2audio",
        "inputs": {"prompt": prompt, "num_inference_steps": 2, "seed": 3} | inputs,
        "config": config,
        **top,
    }


def finished(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    job = wait_status(http, submit(http, body)["job_id"], {"completed", "failed", "cancelled"})
    assert job["status"] == "completed", job
    return job


def decode(data: bytes) -> tuple[np.ndarray, int]:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples, rate


def test_text2audio_job_serves_its_clip_as_wav_decoded_back(http, stage_pid):
    job = finished(http, audio_body(seconds=1.0))
    assert job["task"] == "text2audio"
    result = job["result"]
    assert result["output_format"] == "wav" and result["media_type"] == "audio/wav"
    (clip,) = result["audios"]
    assert clip["seed"] == 3 and clip["sample_rate"] == RATE and clip["channels"] == CHANNELS
    assert clip["duration_s"] == pytest.approx(1.0)
    content = http.get(f"/v1/jobs/{job['job_id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "audio/wav"
    samples, rate = decode(content.content)
    assert rate == RATE and samples.shape == (RATE, CHANNELS)
    assert np.abs(samples).max() > 0  # a real clip, not silence
    # The same bytes at the file URL, with the same media type.
    by_url = http.get(clip["url"])
    assert by_url.status_code == 200 and by_url.headers["content-type"] == "audio/wav"
    assert by_url.content == content.content and clip["url"].endswith(clip["file_id"])


@pytest.mark.parametrize(("fmt", "media_type"), [("flac", "audio/flac"), ("mp3", "audio/mpeg")])
def test_output_format_sets_the_file_and_its_content_type(http, fmt, media_type):
    job = finished(http, audio_body(seconds=0.5, config={"output_format": fmt}))
    assert job["result"]["output_format"] == fmt
    content = http.get(f"/v1/jobs/{job['job_id']}/content")
    assert content.headers["content-type"] == media_type
    samples, rate = decode(content.content)
    assert rate == RATE and samples.shape[1] == CHANNELS
    if fmt == "flac":  # lossless: exactly the clip's length
        assert samples.shape[0] == RATE // 2
    else:  # MP3 pads its frames (encoder delay)
        assert RATE // 2 <= samples.shape[0] <= RATE // 2 + 2 * 1152


def test_b64_json_clips_of_one_prompt_are_inline_and_served_as_content(http):
    body = audio_body(
        seconds=0.25, audio_start_in_s=0.125, num_waveforms_per_prompt=2, response_format="b64_json", async_run=False
    )
    r = http.post("/v1/generate", json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    clips = job["result"]["audios"]
    assert len(clips) == 2 and [c["seed"] for c in clips] == [3, 4]
    decoded = [decode(base64.b64decode(c["b64_json"])) for c in clips]
    for samples, rate in decoded:
        # From 0.125 s to 0.25 s: 2,000 samples.
        assert rate == RATE and samples.shape == (RATE // 8, CHANNELS)
    assert not np.array_equal(decoded[0][0], decoded[1][0])  # two draws, two clips
    second = http.get(f"/v1/jobs/{job['job_id']}/content", params={"index": 1})
    assert second.headers["content-type"] == "audio/wav"
    assert np.array_equal(decode(second.content)[0], decoded[1][0])
    past = http.get(f"/v1/jobs/{job['job_id']}/content", params={"index": 2})
    assert past.status_code == 404 and past.json()["error"]["param"] == "index"


def test_a_long_job_reports_steps_has_no_content_until_done_and_cancels(http):
    job = submit(http, audio_body("a long drone", num_inference_steps=LONG_STEPS))
    events = first_step(http, job["job_id"])
    step = next(e["data"] for e in events if e["type"] == "step")
    assert step["stage_id"] == 0 and 1 <= step["step"] <= step["steps"] == LONG_STEPS
    early = http.get(f"/v1/jobs/{job['job_id']}/content")
    assert early.status_code == 409 and early.json()["error"]["code"] == "job_not_completed"
    assert http.delete(f"/v1/jobs/{job['job_id']}").json()["status"] == "cancelled"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (audio_body(seconds=5.0), "inputs.seconds"),  # past the model's 2.048 s window
        (audio_body(seconds=0), "inputs.seconds"),
        (audio_body(seconds=0.5, audio_start_in_s=1.0), "inputs.audio_start_in_s"),
        (audio_body(num_waveforms_per_prompt=0), "inputs.num_waveforms_per_prompt"),
        (audio_body(config={"output_format": "png"}), "config.output_format"),
        (audio_body(config={"output_format": "gif"}), "config.output_format"),
        ({"task": "text2image", "inputs": {"prompt": "x"}}, "model"),
        ({"task": "text2audio", "inputs": {"prompt": ""}}, "inputs.prompt"),
    ],
)
def test_bad_audio_jobs_are_400s_naming_the_field(http, body, param):
    r = http.post("/v1/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


hostile_inputs = st.fixed_dictionaries(
    {"prompt": st.text(max_size=8)},
    optional={
        "seconds": st.one_of(st.floats(), EDGE_INTS, JSON_VALUES),
        "audio_start_in_s": st.one_of(st.floats(-10, 10), EDGE_INTS, JSON_VALUES),
        "num_waveforms_per_prompt": st.one_of(EDGE_INTS, st.integers(-2, 40), JSON_VALUES),
        "num_inference_steps": st.one_of(EDGE_INTS, JSON_VALUES),
        "size": JSON_VALUES,
    },
)
hostile_config = st.fixed_dictionaries(
    {}, optional={"output_format": st.one_of(st.sampled_from(["wav", "opus", "pcm", "jpeg", "mp4"]), JSON_VALUES)}
)


@FUZZ
@given(inputs=hostile_inputs, config=hostile_config)
def test_hostile_audio_jobs_are_answered_never_5xx(http, inputs, config):
    # Unless every value is valid the answer is a 400 naming a field; valid ones are cheap jobs.
    body = {"task": "text2audio", "inputs": {"num_inference_steps": 1} | inputs}
    content = json.dumps(body | {"config": config}, allow_nan=True).encode()
    r = http.post("/v1/generate", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code in (202, 400), r.text
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["param"] and error["message"]
    else:
        http.delete(f"/v1/jobs/{r.json()['job_id']}")


def test_the_engine_still_serves_after_the_hostile_input(http, server, stage_pid):
    job = finished(http, audio_body(seconds=0.25, config={"output_format": "opus"}))
    content = http.get(f"/v1/jobs/{job['job_id']}/content")
    assert content.headers["content-type"] == "audio/ogg"
    samples, rate = decode(content.content)
    assert rate == RATE and samples.shape[1] == CHANNELS
    assert [p.pid for p in server.stage_processes()] == [stage_pid]


def test_the_model_card_names_its_task(http: httpx.Client) -> None:
    (card,) = http.get("/v1/models").json()["data"]
    assert card["kinds"] == ["audio"] and card["tasks"] == ["text2audio"]
