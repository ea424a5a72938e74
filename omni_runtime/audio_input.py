"""A request's input audio (the ``transcribe`` stage's ``audio`` param): normalised and bounded in
the caller's thread, before anything is queued.

A request carries its samples as a numpy array in the params of the stage that takes them (as a
diffusion request carries its input image): mono, float in [-1, 1] or 16-bit integers, at
``sample_rate`` Hz. :func:`check_audio_input` makes them one contiguous float32 row (what travels
to the stage as a raw buffer) and refuses what no model could take: another shape or type,
non-finite samples, a rate outside 8 to 48 kHz, more than :data:`MAX_INPUT_AUDIO_S` seconds.
:func:`check_input_audio_length` then bounds them by the loaded model's window, as the stage
reported it in READY (``StageConstraints.max_input_audio_s``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints

#: The longest input any request may carry, whatever the model (a model's own window is
#: usually shorter: Whisper's is 30 s).
MAX_INPUT_AUDIO_S = 120.0
#: The rate of input samples when the request names none (what speech-recognition models take).
DEFAULT_INPUT_RATE = 16_000
#: The rates a request's samples may have (``sample_rate``; the bounds table's too).
MIN_INPUT_RATE, MAX_INPUT_RATE = 8_000, 48_000


def check_audio_input(merged: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """Validate and normalise a request's ``audio`` and ``sample_rate`` (``merged``: the
    request's params over the stage's defaults; ``given``: the request's own). Returns what
    replaces them in ``merged``: ``audio`` as contiguous float32 ``(n,)``. InvalidRequestError
    naming the field."""
    audio = merged.get("audio")
    if audio is None:
        return {}
    rate = merged.get("sample_rate", DEFAULT_INPUT_RATE)
    if isinstance(rate, bool) or not isinstance(rate, int | np.integer) or not MIN_INPUT_RATE <= rate <= MAX_INPUT_RATE:
        shown = repr(rate)[:40]
        raise InvalidRequestError(
            f"invalid sampling param `sample_rate`: expected an integer from {MIN_INPUT_RATE} to {MAX_INPUT_RATE} Hz, "
            f"got {shown}",
            param="sample_rate",
        )
    if isinstance(audio, bytes | bytearray | memoryview):
        raise InvalidRequestError(
            "invalid sampling param `audio`: give the samples as a numpy array (np.frombuffer(pcm, '<i2') for "
            "16-bit PCM bytes)",
            param="audio",
        )
    if not isinstance(audio, np.ndarray):
        raise InvalidRequestError(
            f"invalid sampling param `audio`: expected a numpy array of samples, got {type(audio).__name__}",
            param="audio",
        )
    samples = audio.reshape(-1) if audio.ndim == 2 and 1 in audio.shape else audio
    if samples.ndim != 1 or samples.size == 0:
        raise InvalidRequestError(
            f"invalid sampling param `audio`: expected mono samples (n,) or (1, n), got shape {audio.shape}",
            param="audio",
        )
    longest = int(MAX_INPUT_AUDIO_S * rate)
    if samples.size > longest:
        raise InvalidRequestError(
            f"invalid sampling param `audio`: {samples.size / rate:.1f} s of audio, more than the "
            f"{MAX_INPUT_AUDIO_S:g} s one request may carry",
            param="audio",
        )
    if samples.dtype == np.int16:
        out = samples.astype(np.float32) / 32768.0
    elif samples.dtype.kind == "f":
        out = samples.astype(np.float32)
        if not np.isfinite(out).all() or np.abs(out).max() > 1.0:
            raise InvalidRequestError(
                "invalid sampling param `audio`: float samples must be finite and within [-1, 1]", param="audio"
            )
    else:
        raise InvalidRequestError(
            f"invalid sampling param `audio`: samples must be int16 or float, got {samples.dtype}", param="audio"
        )
    return {"audio": np.ascontiguousarray(out), "sample_rate": int(rate)}


def check_input_audio_length(params: Mapping[str, Any], constraints: StageConstraints) -> None:
    """Refuse input audio on a stage that takes none, and audio longer than its model's window."""
    audio = params.get("audio")
    if audio is None:
        return
    most = constraints.max_input_audio_s
    if most is None:
        raise InvalidRequestError("invalid sampling param `audio`: this stage's model takes no audio", param="audio")
    rate = int(params.get("sample_rate") or DEFAULT_INPUT_RATE)
    seconds = len(audio) / rate
    if seconds > most:
        why = constraints.input_audio_reason or "the model's window"
        raise InvalidRequestError(
            f"invalid sampling param `audio`: {seconds:.2f} s of audio, more than the {most:g} s this stage's model "
            f"takes in one request ({why}); split it into turns",
            param="audio",
        )
