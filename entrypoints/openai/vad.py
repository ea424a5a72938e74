"""Energy-based voice activity detection for realtime sessions: pure (no I/O, no clock), over the
16-bit PCM a client appends, so its decisions depend on the audio only and are tested in
milliseconds.

The audio is cut into frames of :data:`FRAME_MS`; a frame is speech when its RMS level, relative to
full scale, is at least ``threshold``. Speech starts at the first speech frame and stops once
``silence_duration_ms`` of frames in a row are not speech. Positions are milliseconds of audio
since the session's buffer began, as OpenAI's ``audio_start_ms`` / ``audio_end_ms`` are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The length of one decision, in milliseconds of audio.
FRAME_MS = 20


def frame_level(frame: np.ndarray) -> float:
    """The RMS level of int16 samples relative to full scale (0 for silence or no samples, 1 for
    a full-scale square wave)."""
    if frame.size == 0:
        return 0.0
    values = frame.astype(np.float64) / 32768.0
    return float(np.sqrt(np.mean(values * values)))


@dataclass(frozen=True)
class SpeechStarted:
    """Speech began ``audio_ms`` into the audio."""

    audio_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    """Speech ended ``audio_ms`` into the audio (where its trailing silence began)."""

    audio_ms: int


VadEvent = SpeechStarted | SpeechStopped


class EnergyVad:
    """One session's detector: :meth:`feed` takes the next bytes of mono pcm16 at
    ``sample_rate`` (any length: a partial frame or odd byte waits for the next call) and returns
    what happened in the frames it completed."""

    def __init__(self, sample_rate: int, threshold: float, silence_duration_ms: int) -> None:
        if sample_rate <= 0 or not 0.0 < threshold <= 1.0 or silence_duration_ms < FRAME_MS:
            raise ValueError(f"bad VAD settings: {sample_rate} Hz, threshold {threshold}, {silence_duration_ms} ms")
        self.threshold = threshold
        self.silence_duration_ms = silence_duration_ms
        self.frame_bytes = 2 * max(1, sample_rate * FRAME_MS // 1000)
        self.speaking = False
        self._carry = b""
        self._frames = 0  # frames decided so far
        self._quiet = 0  # frames since the last speech frame, while speaking
        self._last_speech_end = 0

    @property
    def audio_ms(self) -> int:
        """Milliseconds of audio decided so far."""
        return self._frames * FRAME_MS

    def feed(self, pcm: bytes) -> list[VadEvent]:
        data = self._carry + pcm
        whole = len(data) - len(data) % self.frame_bytes
        self._carry = data[whole:]
        events: list[VadEvent] = []
        samples = np.frombuffer(data[:whole], dtype="<i2")
        per_frame = self.frame_bytes // 2
        for start in range(0, samples.size, per_frame):
            loud = frame_level(samples[start : start + per_frame]) >= self.threshold
            self._frames += 1
            if loud:
                if not self.speaking:
                    self.speaking = True
                    events.append(SpeechStarted(self.audio_ms - FRAME_MS))
                self._quiet = 0
                self._last_speech_end = self.audio_ms
            elif self.speaking:
                self._quiet += 1
                if self._quiet * FRAME_MS >= self.silence_duration_ms:
                    self.speaking = False
                    self._quiet = 0
                    events.append(SpeechStopped(self._last_speech_end))
        return events

    def reset(self) -> None:
        """Forget the current utterance (the buffer was cleared or committed); positions go on."""
        self.speaking = False
        self._quiet = 0
        self._carry = b""
