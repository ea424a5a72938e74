"""``WS /v1/realtime``: the client events of a realtime session, with OpenAI Realtime's names.

Each event is a strict model (unknown fields refused, as every request body here): a mistake is an
``error`` event naming the field, and the session goes on. Fields OpenAI's API has that would
change the answer and that this runtime cannot honour (``tools``, ``temperature``, the input
transcription's ``language`` and ``prompt``) are not declared, so they are refused rather than
ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from omni_runtime.bounds import pydantic as bounds
from omni_runtime.params import MAX_PROMPT_CHARS

from .common import _Request

#: What a session's answers may hold.
Modality = Literal["text", "audio"]
#: The sample rates a session's audio may have (pcm16, mono).
SampleRate = Annotated[int, Field(ge=8000, le=48000)]
#: The most tokens of text a response makes (the text stage's ``max_tokens``); ``inf``: the model's
#: default.
MaxOutputTokens = Annotated[int, Field(**bounds("max_tokens"))] | Literal["inf"]
#: The longest ``input_audio_buffer.append`` payload, in base64 characters (about 1.5 MB of audio;
#: the adapter's message-size limit usually refuses less).
MAX_AUDIO_B64 = 2 * 1024 * 1024


class TurnDetection(_Request):
    """``session.turn_detection``: the server finds the turns (energy VAD); ``null`` turns it off
    and the client commits each turn itself."""

    type: Literal["server_vad"] = "server_vad"
    #: RMS level of a 20 ms frame, relative to full scale, from which it counts as speech.
    threshold: float = Field(0.02, gt=0.0, le=1.0)
    #: How long a silence ends a turn.
    silence_duration_ms: int = Field(500, ge=20, le=10_000)
    #: Audio kept before the speech began (OpenAI's field; the buffer keeps all of it anyway).
    prefix_padding_ms: int = Field(300, ge=0, le=10_000)
    #: Whether a turn that VAD commits starts a response.
    create_response: bool = True
    #: Whether speech that starts while a response runs cancels it (barge-in).
    interrupt_response: bool = True


class InputTranscription(_Request):
    """``session.input_audio_transcription``: the user's audio is transcribed as it arrives, a
    segment at a time, by the model's own speech-recognition stage (its transcript events are
    sent); ``null`` transcribes a turn whole once it is committed, as part of the response."""

    #: OpenAI's recogniser name: taken for compatibility, not used (the pipeline's first stage
    #: hears the audio).
    model: str | None = Field(None, max_length=128)
    #: A pause of this long after speech ends a segment, which is transcribed at once, while the
    #: user may still be talking (an extension). A segment also ends at the model's window.
    segment_silence_ms: int = Field(200, ge=20, le=10_000)


class SessionSettings(_Request):
    """``session`` of ``session.update``: only the fields given change."""

    modalities: list[Modality] | None = Field(None, min_length=1, max_length=2)
    #: The system message: a chat model's prompt is these, a blank line, then the latest user
    #: turn (a speech-only model speaks the turn alone).
    instructions: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    voice: str | None = Field(None, **bounds("voice"))
    max_response_output_tokens: MaxOutputTokens | None = None
    input_audio_format: Literal["pcm16"] | None = None
    output_audio_format: Literal["pcm16"] | None = None
    #: The rate of the audio the client appends (an extension; OpenAI's pcm16 is 24 kHz).
    input_sample_rate: SampleRate | None = None
    #: The rate of the audio deltas (an extension; the model's audio is resampled to it).
    output_sample_rate: SampleRate | None = None
    turn_detection: TurnDetection | None = None
    input_audio_transcription: InputTranscription | None = None


class _Event(_Request):
    #: The client's id for the event, echoed in an ``error`` it causes.
    event_id: str | None = Field(None, max_length=128)


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionSettings


class AudioAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    #: Base64 of little-endian 16-bit mono samples at the session's input rate.
    audio: str = Field(max_length=MAX_AUDIO_B64)


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemContent(_Request):
    type: Literal["input_text", "text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ConversationItem(_Request):
    """A user message of text (audio items come from committed audio)."""

    id: str | None = Field(None, max_length=64)
    type: Literal["message"] = "message"
    role: Literal["user"]
    content: list[ItemContent] = Field(min_length=1, max_length=16)


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    item: ConversationItem
    previous_item_id: str | None = Field(None, max_length=64)


class ResponseSettings(_Request):
    """``response`` of ``response.create``: this response's own settings over the session's."""

    modalities: list[Modality] | None = Field(None, min_length=1, max_length=2)
    #: This response's system message, in place of the session's.
    instructions: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    voice: str | None = Field(None, **bounds("voice"))
    max_response_output_tokens: MaxOutputTokens | None = None


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseSettings | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = Field(None, max_length=64)


ClientEvent = Annotated[
    SessionUpdate | AudioAppend | AudioCommit | AudioClear | ItemCreate | ResponseCreate | ResponseCancel,
    Field(discriminator="type"),
]
#: Parses one client event (``validate_python`` of its decoded JSON).
CLIENT_EVENTS: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
#: Every client event type taken.
CLIENT_EVENT_TYPES = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "response.create",
    "response.cancel",
)
