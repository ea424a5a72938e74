"""``POST /v1/audio/speech``, and a voice given as an object (which chat's ``audio`` takes too)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from omni_runtime.bounds import MAX_SPEECH_CHARS
from omni_runtime.bounds import pydantic as bounds

from .common import Seed, _Request


class SpeechVoice(_Request):
    """A voice given as an object, as the openai client sends a custom voice: ``{"id": name}``."""

    id: str = Field(**bounds("voice"))


class SpeechRequest(_Request):
    """``POST /v1/audio/speech``: speak ``input`` with ``voice``."""

    model: str | None = None
    input: str = Field(max_length=MAX_SPEECH_CHARS)
    #: A speaker of the model by name, or an OpenAI voice name (mapped onto the model's speakers).
    voice: Annotated[str, Field(**bounds("voice"))] | SpeechVoice
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float | None = Field(None, **bounds("speed"))
    stream_format: Literal["audio", "sse"] = "audio"
    #: Accepted for the openai client's sake; a VITS model cannot follow instructions, and ignores them.
    instructions: str | None = Field(None, max_length=MAX_SPEECH_CHARS)
    #: Seed of the speech's noise (an extension); the same seed gives the same audio.
    seed: Seed | None = None

    def voice_name(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id
