"""The energy VAD (entrypoints/openai/vad.py): speech starts at the first loud frame and stops after
``silence_duration_ms`` of quiet, whatever the sizes of the pieces the audio comes in."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_runtime.entrypoints.openai.vad import FRAME_MS, EnergyVad, SpeechStarted, SpeechStopped, frame_level

pytestmark = pytest.mark.unit

RATE = 16_000


def tone(ms: int, amplitude: float = 0.3) -> bytes:
    n = RATE * ms // 1000
    wave = amplitude * np.sin(2 * np.pi * 440 * np.arange(n) / RATE)
    return np.round(wave * 32767).astype("<i2").tobytes()


def silence(ms: int) -> bytes:
    return bytes(2 * (RATE * ms // 1000))


def test_frame_level_is_rms_relative_to_full_scale() -> None:
    assert frame_level(np.zeros(320, dtype=np.int16)) == 0.0
    assert frame_level(np.array([], dtype=np.int16)) == 0.0
    assert frame_level(np.full(320, -32768, dtype=np.int16)) == pytest.approx(1.0)
    sine = np.frombuffer(tone(20, 0.5), dtype="<i2")
    assert frame_level(sine) == pytest.approx(0.5 / np.sqrt(2), rel=5e-3)  # 8.8 cycles: not exact


def test_speech_starts_and_stops_after_the_silence() -> None:
    vad = EnergyVad(RATE, threshold=0.05, silence_duration_ms=200)
    assert vad.feed(silence(100)) == []
    assert vad.feed(tone(300)) == [SpeechStarted(100)]
    assert vad.feed(silence(180)) == []  # not yet the silence
    assert vad.feed(silence(20)) == [SpeechStopped(400)]
    assert not vad.speaking and vad.audio_ms == 600
    assert vad.feed(silence(1000)) == []


def test_a_short_pause_does_not_end_the_turn_and_quiet_audio_is_no_speech() -> None:
    vad = EnergyVad(RATE, threshold=0.05, silence_duration_ms=200)
    events = vad.feed(tone(100) + silence(100) + tone(100) + silence(200))
    assert events == [SpeechStarted(0), SpeechStopped(300)]
    assert EnergyVad(RATE, threshold=0.05, silence_duration_ms=200).feed(tone(500, amplitude=0.01)) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=40))
def test_the_decisions_do_not_depend_on_how_the_audio_is_cut(cuts: list[int]) -> None:
    audio = silence(60) + tone(200) + silence(300) + tone(100) + silence(260)
    whole = EnergyVad(RATE, 0.05, 240).feed(audio)
    vad, pieces, at = EnergyVad(RATE, 0.05, 240), [], 0
    for cut in cuts:
        pieces += vad.feed(audio[at : at + cut])
        at += cut
    pieces += vad.feed(audio[at:])
    assert pieces == whole == [SpeechStarted(60), SpeechStopped(260), SpeechStarted(560), SpeechStopped(660)]


def test_bad_settings_are_refused() -> None:
    for rate, threshold, silence_ms in ((0, 0.1, 200), (RATE, 0.0, 200), (RATE, 1.5, 200), (RATE, 0.1, FRAME_MS - 1)):
        with pytest.raises(ValueError):
            EnergyVad(rate, threshold, silence_ms)
