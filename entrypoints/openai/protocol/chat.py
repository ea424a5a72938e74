"""``POST /v1/chat/completions``: the request, the answer, its streamed chunks, and token usage."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omni_runtime.bounds import pydantic as bounds
from omni_runtime.media import KINDS, Modality
from omni_runtime.outputs import OmniRequestOutput

from .common import LoraSpec, Priority, Seed, Timeout, _Request
from .speech import SpeechVoice

#: Most chat messages in one request: only the last user message is used.
MAX_MESSAGES = 1024


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="allow")

    #: A ``data:image/...;base64,...`` URL; remote URLs are refused, never fetched.
    url: str
    detail: str | None = Field(None, max_length=16)


class ContentPart(BaseModel):
    """One part of a message's content. ``text`` parts feed the prompt and an ``image_url`` part
    of the last user message is the input image of an image model; other part types
    (``input_audio``...) are accepted and ignored, as their shapes vary."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(max_length=64)
    text: str | None = None
    image_url: ImageUrl | None = None


class ChatMessage(BaseModel):
    # Messages carry name / tool_calls / tool_call_id / refusal... depending on the role; none of
    # them matters here, and rejecting them would break replaying an OpenAI conversation.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if not self.content:
            return ""
        return "\n".join(p.text for p in self.content if p.type == "text" and p.text)


class StreamOptions(_Request):
    include_usage: bool = False


class ChatAudio(_Request):
    """``audio`` of a chat request: the voice and file format of the spoken answer."""

    #: A speaker of the model by name, or an OpenAI voice name (as on ``/v1/audio/speech``).
    voice: Annotated[str, Field(**bounds("voice"))] | SpeechVoice
    #: ``pcm16``: raw 16-bit little-endian samples (the one format OpenAI streams).
    format: Literal["wav", "mp3", "flac", "opus", "pcm16"] = "wav"

    def voice_name(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id

    def encoder_format(self) -> str:
        """The encoder registry's name of :attr:`format`."""
        return "pcm" if self.format == "pcm16" else self.format


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str | None = None
    #: Which outputs to return: ``["text"]``, ``["image"]`` or both (default: every final output).
    modalities: list[Modality] | None = Field(None, min_length=1, max_length=len(KINDS))
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(**bounds("max_tokens"))] | None = None
    max_completion_tokens: Annotated[int, Field(**bounds("max_tokens"))] | None = None
    temperature: Annotated[float, Field(**bounds("temperature"))] | None = None
    top_p: Annotated[float, Field(**bounds("top_p"))] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    #: Only one choice is produced per request.
    n: Literal[1] | None = None
    timeout: Timeout | None = None
    #: A registered LoRA adapter for the image stages, and its scale (an extension).
    lora: LoraSpec | None = None
    priority: Priority | None = None
    #: The spoken answer's voice and format (a model with a speech stage; default: wav).
    audio: ChatAudio | None = None
    # Sent by OpenAI callers; no meaning for this runtime.
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = Field(None, max_length=32)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    parallel_tool_calls: bool | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(len(s) > 256 for s in stops):
            raise ValueError("stop takes at most 4 sequences of at most 256 characters")
        return value

    def prompt(self) -> tuple[str, str]:
        """The last user message's text and its field path; ValueError if there is none."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "user":
                text = self.messages[i].text()
                if not text.strip():
                    raise ValueError(f"messages[{i}] (the last user message) has no text content")
                return text, f"messages[{i}].content"
        raise ValueError("messages contains no user message")

    def image_urls(self) -> list[tuple[str, str]]:
        """(url, field path) of each ``image_url`` part of the last user message."""
        for i in range(len(self.messages) - 1, -1, -1):
            message = self.messages[i]
            if message.role == "user":
                if not isinstance(message.content, list):
                    return []
                return [
                    (part.image_url.url, f"messages[{i}].content[{j}].image_url.url")
                    for j, part in enumerate(message.content)
                    if part.type == "image_url" and part.image_url is not None
                ]
        return []


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    #: The answer's text (None when it has none). Always a string, as OpenAI clients type it.
    content: str | None = None
    #: An extension: the answer's images, ``{"type": "image_url", "image_url": {"url": "data:..."}}``
    #: each (OpenAI clients keep unknown fields as they are).
    images: list[dict[str, Any]] | None = None
    #: The spoken answer, as OpenAI has it: ``{"id", "data" (base64), "transcript", "expires_at"}``.
    audio: dict[str, Any] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length"] | None = "stop"


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage = Field(default_factory=Usage)


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    #: An extension, as on ResponseMessage: images, once each is drawn.
    images: list[dict[str, Any]] | None = None
    #: A piece of the spoken answer: ``{"id", "data"}`` (base64), the first one with the
    #: ``transcript`` and ``expires_at``.
    audio: dict[str, Any] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


def usage_of(out: OmniRequestOutput, resolved: dict[int, dict[str, Any]]) -> tuple[Usage, Literal["stop", "length"]]:
    """Token usage from the text stages' output metrics, and ``length`` if one hit max_tokens."""
    prompt_tokens = completion_tokens = 0
    finish: Literal["stop", "length"] = "stop"
    for sid, result in out.outputs_by_stage.items():
        prompt_tokens += int(result.metrics.get("prompt_tokens", 0) or 0)
        done = int(result.metrics.get("completion_tokens", 0) or 0)
        completion_tokens += done
        limit = resolved.get(sid, {}).get("max_tokens")
        if limit and done >= limit:
            finish = "length"
    total = prompt_tokens + completion_tokens
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=total), finish
