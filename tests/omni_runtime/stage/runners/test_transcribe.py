"""The ``transcribe`` stage with the builtin tiny-whisper (a tiny random-weight Whisper), and a request's
input audio through the Python API.

The params' checks take hostile audio without an engine: anything but mono int16 or float samples
in [-1, 1] at 8 to 48 kHz, or longer than a request may carry, is an InvalidRequestError naming
the field. One in-process engine (one stage) then: clips at different rates in one wave run as
one forward and each gets a transcript within its token limit (random weights: gibberish, so
structure not wording); a request without audio hears nothing; audio longer than the model's
window is refused before it is queued, and the engine serves afterwards. The three-stage pipeline
(tiny-omni-voice) sends a request's audio to its first stage and says it takes audio; it runs
end to end in tests/entrypoints/openai/test_http_realtime.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_runtime.entrypoints.async_omni import load_resolved
from omni_runtime.entrypoints.capabilities import ModelCapabilities

from omni_runtime import Omni
from omni_runtime.audio_input import MAX_INPUT_AUDIO_S
from omni_runtime.config import parse_config
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints
from omni_runtime.models.tiny_whisper import WINDOW_S
from omni_runtime.params import TranscriptionSamplingParams, check_constraints, resolve_params


def tone(seconds: float, rate: int = 16_000, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * 300 * t)).astype(np.float32)


_SAMPLES = st.one_of(
    st.none(),
    st.binary(max_size=16),
    st.text(max_size=4),
    st.lists(st.floats(-1, 1), max_size=4),
    st.sampled_from([np.zeros(0, np.float32), np.zeros((2, 8), np.float32), np.full(4, np.nan, np.float32),
                     np.full(4, 2.0, np.float32), np.zeros(4, np.int32), np.zeros(4, np.int16),
                     np.zeros((1, 4), np.float64), np.zeros(4, np.complex64)]),
)  # fmt: skip


@pytest.mark.unit
@given(audio=_SAMPLES, rate=st.one_of(st.none(), st.integers(-10, 100_000), st.booleans(), st.floats(), st.text()))
@settings(max_examples=150, deadline=None)
def test_hostile_audio_params_are_invalid_request_errors_naming_the_field(audio: Any, rate: Any) -> None:
    given_params = {"audio": audio, "sample_rate": rate}
    try:
        params = resolve_params(TranscriptionSamplingParams, {}, given_params)
        check_constraints(params, StageConstraints(max_input_audio_s=WINDOW_S))
    except InvalidRequestError as e:
        assert e.param in ("audio", "sample_rate"), e
        return
    if params.audio is not None:
        assert params.audio.dtype == np.float32 and params.audio.ndim == 1 and np.abs(params.audio).max() <= 1
        assert 8_000 <= params.sample_rate <= 48_000


@pytest.mark.unit
def test_audio_is_bounded_by_the_request_limit_and_the_models_window() -> None:
    with pytest.raises(InvalidRequestError, match=f"more than the {MAX_INPUT_AUDIO_S:g} s") as refused:
        resolve_params(TranscriptionSamplingParams, {}, {"audio": np.zeros(int(MAX_INPUT_AUDIO_S * 8000) + 1, "<i2"),
                                                          "sample_rate": 8000})  # fmt: skip
    assert refused.value.param == "audio"
    params = resolve_params(TranscriptionSamplingParams, {}, {"audio": tone(WINDOW_S + 0.5, 8000), "sample_rate": 8000})
    with pytest.raises(InvalidRequestError, match="window") as refused:
        check_constraints(params, StageConstraints(max_input_audio_s=WINDOW_S))
    with pytest.raises(InvalidRequestError, match="takes no audio"):
        check_constraints(params, StageConstraints())
    pcm = (tone(0.5) * 32767).astype("<i2")
    params = resolve_params(TranscriptionSamplingParams, {}, {"audio": pcm})
    assert params.sample_rate == 16_000 and np.allclose(params.audio, pcm / 32768.0)


ONE_STAGE = {
    "model": "tiny-whisper",
    "stage_args": [
        {
            "stage_id": 0,
            "stage_type": "transcribe",
            "model": "builtin:tiny-whisper",
            "runtime": {"backend": "inproc", "devices": "cpu"},
            "engine_args": {"max_num_seqs": 4, "request_batch_max_wait_ms": 50},
            "final_output": True,
            "final_output_type": "text",
        }
    ],
}


@pytest.mark.integration
def test_clips_at_any_rate_are_transcribed_in_one_wave_and_the_window_is_enforced_before_queueing() -> None:
    with Omni(parse_config(ONE_STAGE)) as omni:
        params = [
            {"audio": tone(1.0, 16_000), "sample_rate": 16_000, "max_transcript_tokens": 3},
            {"audio": (tone(0.4, 24_000) * 32767).astype("<i2"), "sample_rate": 24_000, "max_transcript_tokens": 6},
            {"audio": tone(2.0, 8_000), "sample_rate": 8_000},
            {},
        ]
        outs = omni.generate(["", "", "", "no audio"], params)
        assert [o.error for o in outs] == [None] * 4
        metrics = [o.metrics for o in outs]
        assert [m["batch_size"] for m in metrics[:3]] == [4, 4, 4]  # one wave
        assert [m["audio_seconds"] for m in metrics[:3]] == pytest.approx([1.0, 0.4, 2.0], abs=1e-3)
        assert [m["transcript_tokens"] for m in metrics] == [3, 6, 32, 0]  # the limits (none ends early)
        assert all(o.text and o.text.isprintable() for o in outs[:3]) and outs[3].text == ""
        with pytest.raises(InvalidRequestError, match="window") as refused:
            omni.generate("", {"audio": tone(WINDOW_S + 1)})
        assert refused.value.param == "audio"
        again = omni.generate("", {"audio": tone(0.2), "max_transcript_tokens": 2})[0]
        assert again.error is None and again.metrics["transcript_tokens"] == 2


@pytest.mark.unit
def test_the_voice_pipeline_routes_audio_to_its_first_stage_and_says_it_takes_audio() -> None:
    resolved = load_resolved("tiny-omni-voice", {})
    params = resolved.sampling_params(shared={"audio": tone(0.5, 24_000), "sample_rate": 24_000, "max_tokens": 3})
    assert [sorted(p or {}) for p in params] == [["audio", "sample_rate"], ["max_tokens"], []]
    caps = ModelCapabilities.of(resolved)
    assert caps.audio_input and caps.serves("chat")
    assert not ModelCapabilities.of(load_resolved("tiny-omni-speech", {})).audio_input
