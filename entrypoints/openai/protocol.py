"""The HTTP schema: pydantic request and response models of the OpenAI-style server.

Request models forbid unknown fields, so a typo is a 400 naming the field instead of a silently
ignored option. The fields that the official ``openai`` client (or common OpenAI callers) send but
that this runtime has no use for are declared explicitly and ignored; fields that would change the
meaning of a request (``tools``, ``logprobs``, ``response_format`` on chat...) are not declared, so
they are rejected rather than half-honoured.

Bounds are checked here, so absurd input (a 100000x100000 size, n=1000, a megabyte prompt) is
refused before anything reaches the engine; a field that the engine's params also take gets its
bounds from the one table of :mod:`omni_runtime.bounds` (``Annotated[int, Field(**bounds("seed"))]``).

The error ladder lives here too, :func:`error_body`: the one place where every exception
(pydantic validation, the engine's typed errors, the server's own) becomes a status code and
the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException

from omni_runtime import encoders
from omni_runtime.acceleration import parse_cache
from omni_runtime.bounds import MAX_PROMPT_CHARS, MAX_SIDE, MAX_SPEECH_CHARS, MIN_SIDE
from omni_runtime.bounds import pydantic as bounds
from omni_runtime.exceptions import (
    EngineError,
    InvalidRequestError,
    OmniError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
    StageAsleepError,
    StageDeadError,
    UnavailableError,
)
from omni_runtime.media import KINDS, Modality
from omni_runtime.outputs import OmniRequestOutput
from omni_runtime.serialization import find_unencodable

logger = logging.getLogger(__name__)

#: Most images one images request may ask for (each is its own engine request).
MAX_IMAGES = 10
#: Most chat messages in one request: only the last user message is used.
MAX_MESSAGES = 1024

#: ``WxH`` in ASCII digits, exactly (no spaces, no other case, no other script's digits).
_SIZE_RE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})", re.ASCII)
#: Seconds of video: ASCII digits, optionally a decimal part (no sign, exponent or underscore).
_SECONDS_RE = re.compile(r"[0-9]{1,6}(?:\.[0-9]{1,6})?", re.ASCII)


def _not_bool(value: Any) -> Any:
    # Lax mode (a form's "9" is 9) would also take JSON's true for 1: a boolean is no number.
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


#: Refuses a boolean for a number field, in lax mode too.
NotBool = BeforeValidator(_not_bool)

Seed = Annotated[int, Field(**bounds("seed")), NotBool]
#: A per-request deadline in seconds (an extension: OpenAI has none in the body).
Timeout = Annotated[float, Field(**bounds("timeout")), NotBool]
#: Higher is served first (an extension); see docs/configuration.md, "Priority".
Priority = Annotated[int, Field(**bounds("priority")), NotBool]
#: A latency target (ms) at stages with ``batch_policy: learned`` (an extension).
SloMs = Annotated[float, Field(**bounds("slo_ms")), NotBool]


def _image_format(value: str) -> str:
    if value not in encoders.formats("image"):
        raise ValueError(f"Input should be one of {', '.join(map(repr, encoders.formats('image')))}")
    return value


def _image_formats_schema(schema: dict[str, Any]) -> None:
    schema["enum"] = list(encoders.formats("image"))


#: A file format for generated images: any the encoder registry has (omni_runtime/encoders.py);
#: the OpenAPI schema lists them as an enum, as of when the schema is first built.
ImageFormat = Annotated[str, AfterValidator(_image_format), Field(json_schema_extra=_image_formats_schema)]


def _job_format(value: str) -> str:
    known = (*encoders.formats("image"), *encoders.formats("audio"))
    if value not in known:
        raise ValueError(f"Input should be one of {', '.join(map(repr, known))}")
    return value


def _job_formats_schema(schema: dict[str, Any]) -> None:
    schema["enum"] = [*encoders.formats("image"), *encoders.formats("audio")]


#: A job's file format: an image format (image tasks) or an audio one (audio tasks); which kind
#: the task takes is checked with the task (entrypoints/openai/job_manager.py).
JobFormat = Annotated[str, AfterValidator(_job_format), Field(json_schema_extra=_job_formats_schema)]


def _form_json(value: Any) -> Any:
    """A multipart form carries an object as its JSON text (``cache={"type": ...}``)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError("not valid JSON") from None
    return value


def _step_cache(value: Any) -> dict[str, Any] | Literal["off"]:
    """The ``cache`` extension: checked as the Python param is (types, fields and bounds of
    omni_runtime/acceleration.py), passed on as plain data."""
    if value == "off":
        return "off"
    if not isinstance(value, dict):
        raise ValueError('expected "off" or an object with `type` (first_block, taylorseer, mag, pab)')
    try:
        parsed = parse_cache(value)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"invalid step cache: {e}") from None
    builtins: dict[str, Any] = msgspec.to_builtins(parsed)
    return builtins


#: Step caching for the request (an extension): ``{"type": "first_block", "threshold": 0.1}``, the
#: fields of ``engine_args.cache``, or ``"off"``; unset: the stage's own.
StepCacheField = Annotated[Any, BeforeValidator(_form_json), AfterValidator(_step_cache)]


class UnencodableValue(ValueError):
    """A request value no engine message can carry (a lone surrogate, an integer past 64 bits)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"`{path}`: {why}" if path else why)
        self.path = path or None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        # Before any field is read: whatever the field (prompt, messages, model, user...), a value
        # that no message can carry is this request's 400, not an error deep in the engine.
        found = find_unencodable(data)
        if found is not None:
            raise UnencodableValue(*found)
        return data


def parse_size(value: str) -> tuple[int, int]:
    """``"WxH"`` (ASCII digits, exactly) -> (width, height), each within [MIN_SIDE, MAX_SIDE];
    ValueError otherwise."""
    m = _SIZE_RE.fullmatch(value)
    if not m:
        raise ValueError(f"size must look like '512x512' (WIDTHxHEIGHT), got {value[:40]!r}")
    width, height = int(m.group(1)), int(m.group(2))
    for side in (width, height):
        if not MIN_SIDE <= side <= MAX_SIDE:
            raise ValueError(f"each side of size must be between {MIN_SIDE} and {MAX_SIDE} pixels, got {value!r}")
    return width, height


class LoraSpec(_Request):
    """The ``lora`` extension field: an adapter the operator registered, by name, and its scale.

    Paths are refused: a client must not choose files on the server. The operator offers adapters
    with ``engine_args.loras`` or ``collective_rpc("add_lora")``; the Python API may pass paths.
    """

    # Python's regex engine: the name pattern is shared with msgspec and ends in ``\Z``.
    model_config = ConfigDict(extra="forbid", regex_engine="python-re")

    name: Annotated[str, Field(**bounds("lora.name"))]
    scale: Annotated[float, Field(**bounds("lora.scale"), allow_inf_nan=False)] = 1.0
    #: Declared only to be refused with the reason.
    path: Any = None

    @field_validator("path")
    @classmethod
    def _no_paths(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "adapter paths are not accepted over HTTP; name an adapter the server offers "
                "(engine_args.loras, or collective_rpc add_lora)"
            )
        return value

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "scale": self.scale}


# --------------------------------------------------------------------------- images


class _SizedRequest(_Request):
    """A request with an optional ``size`` (``WxH``; ``auto`` or unset: the default)."""

    size: str | None = None

    @field_validator("size")
    @classmethod
    def _check_size(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return None
        parse_size(value)
        return value

    def dimensions(self) -> tuple[int, int] | None:
        return None if self.size is None else parse_size(self.size)


class _ImagesRequest(_SizedRequest):
    """What every images route takes: how many, what size, how returned, and the image params."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: ImageFormat = "png"
    #: JPEG / WebP quality (0-100).
    output_compression: int | None = Field(None, ge=0, le=100)
    # Extensions (``extra_body`` of the openai client) beyond here.
    negative_prompt: Annotated[str, Field(**bounds("negative_prompt"))] | None = None
    num_inference_steps: Annotated[int, Field(**bounds("num_inference_steps"))] | None = None
    guidance_scale: Annotated[float, Field(**bounds("guidance_scale"))] | None = None
    #: Seed of the first image; image i gets ``seed + i``.
    seed: Seed | None = None
    timeout: Timeout | None = None
    slo_ms: SloMs | None = None
    cache: StepCacheField | None = None


class ImageGenerationRequest(_ImagesRequest):
    """``POST /v1/images/generations``."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    #: ``WxH``; ``auto`` or unset uses the stage's default size.
    size: str | None = None
    #: A registered LoRA adapter and its scale (an extension).
    lora: LoraSpec | None = None
    priority: Priority | None = None
    # Sent by OpenAI callers; no meaning for this runtime.
    user: str | None = Field(None, max_length=256)
    quality: str | None = Field(None, max_length=32)
    style: str | None = Field(None, max_length=32)
    background: str | None = Field(None, max_length=32)
    moderation: str | None = Field(None, max_length=32)
    #: Image streaming is not offered: only ``false`` is accepted.
    stream: Literal[False] | None = None


class _ImageInputForm(_ImagesRequest):
    """Fields shared by the multipart image-input routes (edits, variations), parsed from form
    values (strings, converted as pydantic's lax mode does). The files (``image``, ``mask``) are
    read separately."""

    #: ``WxH``: the input is resized to it; ``auto`` or unset keeps the input's size.
    size: str | None = None
    #: How far the input is noised (0 < strength <= 1); unset: the pipeline's default for edits,
    #: :data:`VARIATION_STRENGTH` for variations.
    strength: Annotated[float, Field(**bounds("strength"))] | None = None
    # Sent by OpenAI callers; no meaning for this runtime.
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)


class ImageEditForm(_ImageInputForm):
    """``POST /v1/images/edits`` (multipart/form-data, as ``client.images.edit`` sends it)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    # Sent by OpenAI callers; no meaning for this runtime.
    background: str | None = Field(None, max_length=32)
    input_fidelity: str | None = Field(None, max_length=32)
    quality: str | None = Field(None, max_length=32)
    partial_images: int | None = Field(None, ge=0, le=3)
    #: Image streaming is not offered: only ``false`` is accepted.
    stream: Literal[False] | None = None


class ImageVariationForm(_ImageInputForm):
    """``POST /v1/images/variations`` (multipart/form-data, as ``client.images.create_variation``
    sends it): no prompt; the input is redrawn with :data:`VARIATION_STRENGTH` unless ``strength``
    is given."""


#: How far a variation departs from its input unless the request says (img2img ``strength``).
VARIATION_STRENGTH = 0.75


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None
    seed: int | None = None


class ImageGenerationResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageData]
    output_format: str | None = None
    size: str | None = None


# --------------------------------------------------------------------------- jobs


class GenerateInputs(_SizedRequest):
    """What to generate: ``inputs`` of ``POST /v1/generate`` (task ``text2image``)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    negative_prompt: Annotated[str, Field(**bounds("negative_prompt"))] | None = None
    #: ``WxH``; or ``width`` and ``height``; unset: the stage's default size.
    size: str | None = None
    width: Annotated[int, Field(**bounds("width"))] | None = None
    height: Annotated[int, Field(**bounds("height"))] | None = None
    num_inference_steps: Annotated[int, Field(**bounds("num_inference_steps"))] | None = None
    guidance_scale: Annotated[float, Field(**bounds("guidance_scale"))] | None = None
    seed: Seed | None = None
    #: Frames and playback rate of a video (task ``text2video``); an image model refuses them.
    num_frames: Annotated[int, Field(**bounds("num_frames"))] | None = None
    fps: Annotated[int, Field(**bounds("fps"))] | None = None
    #: The first frame of task ``image2video``: a ``data:image/...;base64,`` URL (remote URLs are
    #: refused, never fetched), decoded and bounded as the images routes' uploads are.
    image: str | None = None
    #: Length of each clip, seconds (task ``text2audio``: the model's ``audio_end_in_s``).
    seconds: Annotated[float, Field(**bounds("audio_end_in_s"))] | None = None
    #: Where each clip starts, seconds (task ``text2audio``).
    audio_start_in_s: Annotated[float, Field(**bounds("audio_start_in_s"))] | None = None
    #: Clips to make (task ``text2audio``).
    num_waveforms_per_prompt: Annotated[int, Field(**bounds("num_waveforms_per_prompt"))] | None = None
    #: The speaker (task ``text2speech``): the model's own name or an OpenAI voice name.
    voice: Annotated[str, Field(**bounds("voice"))] | None = None
    #: How fast to speak (task ``text2speech``).
    speed: Annotated[float, Field(**bounds("speed"))] | None = None
    #: Step caching of a diffusion task (as ``cache`` on the images routes).
    cache: StepCacheField | None = None

    @model_validator(mode="after")
    def _one_size(self) -> GenerateInputs:
        if self.size is not None and (self.width is not None or self.height is not None):
            raise ValueError("give either size or width and height, not both")
        if (self.width is None) != (self.height is None):
            raise ValueError("width and height go together")
        return self

    def dimensions(self) -> tuple[int, int] | None:
        if self.size is not None:
            return parse_size(self.size)
        return None if self.width is None or self.height is None else (self.width, self.height)


class GenerateConfig(_Request):
    """How to run and deliver it: ``config`` of ``POST /v1/generate``."""

    #: Unset: ``png`` for an image task, ``wav`` for an audio task (a video is always MP4).
    output_format: JobFormat | None = None
    output_compression: int | None = Field(None, ge=0, le=100)
    #: The engine's deadline for the generation (seconds), as ``timeout`` on the other routes.
    timeout: Timeout | None = None
    slo_ms: SloMs | None = None


class GenerateRequest(_Request):
    """``POST /v1/generate``: a job. ``async_run`` (the default) answers at once with the queued job;
    ``async_run: false`` waits for the job to end and answers with the same shape."""

    task: Literal["text2image", "text2video", "image2video", "text2audio", "text2speech"]
    model: str | None = None
    inputs: GenerateInputs
    config: GenerateConfig = Field(default_factory=GenerateConfig)
    async_run: bool = True
    #: Higher is served first (docs/configuration.md, "Priority"); default 0.
    priority: Priority = 0
    response_format: Literal["url", "b64_json"] = "url"


# --------------------------------------------------------------------------- speech


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


# --------------------------------------------------------------------------- videos


class VideoReference(_Request):
    """OpenAI's JSON ``input_reference`` object: ``image_url`` as a data URL. A ``file_id`` is
    refused (this server keeps no uploaded files to refer to)."""

    image_url: str | None = None
    file_id: str | None = Field(None, max_length=256)


class VideoCreateRequest(_SizedRequest):
    """``POST /v1/videos`` (JSON or a form; text to video, or image to video with
    ``input_reference``): OpenAI's fields and the extensions
    (``extra_body`` of the openai client). ``seconds`` becomes a frame count (docs/http_api.md,
    "Videos"): with ``num_frames`` too, both must name the same count."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None
    #: Seconds of video, as a string (``"4"``); OpenAI's field.
    seconds: str | None = Field(None, max_length=16)
    #: ``WxH``; unset: the stage's default size.
    size: str | None = None
    num_frames: Annotated[int, Field(**bounds("num_frames")), NotBool] | None = None
    fps: Annotated[int, Field(**bounds("fps")), NotBool] | None = None
    negative_prompt: Annotated[str, Field(**bounds("negative_prompt"))] | None = None
    num_inference_steps: Annotated[int, Field(**bounds("num_inference_steps")), NotBool] | None = None
    guidance_scale: Annotated[float, Field(**bounds("guidance_scale")), NotBool] | None = None
    seed: Seed | None = None
    timeout: Timeout | None = None
    slo_ms: SloMs | None = None
    priority: Priority = 0
    #: The first frame (image to video): OpenAI's reference object in JSON; a multipart upload
    #: (the openai client's file) is read by the route and never reaches this model.
    input_reference: VideoReference | None = None

    @field_validator("seconds")
    @classmethod
    def _check_seconds(cls, value: str | None) -> str | None:
        if value is not None:
            seconds_of(value)
        return value


#: Longest video ``seconds`` may ask for (the frame bound applies on top).
MAX_SECONDS = 600.0


def seconds_of(value: str) -> float:
    """``"4"`` / ``"2.5"`` (ASCII digits, exactly) -> seconds, positive and at most MAX_SECONDS;
    ValueError otherwise."""
    if not _SECONDS_RE.fullmatch(value):
        raise ValueError(f"seconds must be a number of seconds such as '4' or '2.5', got {value[:16]!r}")
    seconds = float(value)
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds must be more than 0 and at most {MAX_SECONDS:g}, got {value[:16]!r}")
    return seconds


# --------------------------------------------------------------------------- chat


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


# --------------------------------------------------------------------------- models, control, errors


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omni_runtime"
    #: What the model makes (its final stages' output types: image, video, audio, text), so that a
    #: client (the playground) offers the right parameters.
    kinds: list[str] = []
    #: The ``/v1/generate`` tasks it serves (``text2image``, ``text2video``, ``image2video``,
    #: ``text2audio``, ``text2speech``).
    tasks: list[str] = []
    #: Every task it serves, routes included (``image_edit``, ``image_variation``, ``chat``...):
    #: a route for another task answers 400 naming ``model``.
    serves: list[str] = []
    #: The voices its speech stage takes, once loaded (empty: any, or no speech).
    voices: list[str] = []
    #: Where the model is: loading, loaded, failed (its requests fail with a 503 naming it), dead.
    state: str = "loaded"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CollectiveRpcRequest(_Request):
    """``POST /v1/omni/collective_rpc``: a control call on every replica of the chosen stages."""

    method: str = Field(min_length=1, max_length=128)
    args: list[Any] = Field(default_factory=list, max_length=64)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    stage_ids: list[int] | None = Field(None, max_length=256)
    timeout: Timeout | None = None
    #: The model to call (an unloaded or asleep one is brought back first); None: every loaded
    #: model when several are served (the results then say whose), else the only one.
    model: str | None = Field(None, max_length=256)


class ReplicaResult(BaseModel):
    #: Whose replica, when several models are served.
    model: str | None = None
    stage_id: int
    replica_id: int
    ok: bool
    result: Any = None
    error: str | None = None


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


# --------------------------------------------------------------------------- errors


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    """An error the HTTP layer itself raises (auth, unknown model, shutting down...)."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code


class ClientDisconnected(Exception):
    """The client closed the connection; its engine requests were aborted."""


#: Set in a request's ASGI scope once its client is known to be gone (the access log says so).
DISCONNECTED = "omni.client_disconnected"


def _validation_param(loc: Sequence[Any]) -> str | None:
    parts = [p for p in loc if p != "body"]
    if not parts or not isinstance(parts[0], str):
        return None  # the body as a whole (missing, or not JSON)
    text = parts[0]
    for p in parts[1:]:
        text += f"[{p}]" if isinstance(p, int) else f".{p}"
    return text


def classify_error(exc: BaseException) -> tuple[int, str, str | None, str | None, str]:
    """(status, type, param, code, message) for any exception: the one place errors are mapped."""
    if isinstance(exc, ApiError):
        return exc.status, exc.type, exc.param, exc.code, str(exc)
    if isinstance(exc, RequestValidationError):
        errors = list(exc.errors())
        first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        param = _validation_param(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return 400, "invalid_request_error", None, "invalid_json", f"malformed JSON body: {first.get('msg')}"
        if param is None and first.get("type") == "missing":
            return 400, "invalid_request_error", None, "invalid_request", "a JSON request body is required"
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, UnencodableValue):
            return 400, "invalid_request_error", cause.path, "invalid_value", f"invalid value: {cause}"
        if first.get("type") == "extra_forbidden":
            message = f"unknown field `{param}`"
        else:
            message = f"invalid value for `{param}`: {first.get('msg')}" if param else str(first.get("msg"))
        return 400, "invalid_request_error", param, "invalid_value", message
    if isinstance(exc, HTTPException):
        code = "not_found" if exc.status_code == 404 else "http_error"
        return exc.status_code, "invalid_request_error", None, code, str(exc.detail)
    if isinstance(exc, ClientDisconnected):
        return 499, "client_disconnected", None, "client_disconnected", "the client closed the connection"
    if isinstance(exc, QueueFullError):
        return 429, "rate_limit_error", None, "queue_full", str(exc)
    if isinstance(exc, InvalidRequestError):
        return 400, "invalid_request_error", exc.param, "invalid_value", str(exc)
    if isinstance(exc, RequestTimeoutError):
        return 504, "timeout_error", None, "request_timeout", str(exc)
    if isinstance(exc, UnavailableError):
        return 503, "service_unavailable", None, _snake(type(exc).__name__), str(exc)
    if isinstance(exc, StageDeadError | StageAsleepError | RequestAbortedError | EngineError):
        return 503, "service_unavailable", None, _snake(type(exc).__name__), str(exc)
    if isinstance(exc, OmniError):
        return 500, "server_error", None, _snake(type(exc).__name__), str(exc)
    logger.error("unexpected error", exc_info=exc)
    return 500, "server_error", None, "internal_error", f"internal error: {type(exc).__name__}: {exc}"


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_").removesuffix("_error")


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, type_, param, code, message = classify_error(exc)
    detail = ErrorDetail(message=message, type=type_, param=param, code=code)
    return status, ErrorResponse(error=detail).model_dump()
