"""The HTTP schema: pydantic request and response models of the OpenAI-style server, one module
per surface (``images``, ``generate`` for the jobs, ``speech``, ``videos``, ``chat``, ``realtime``
for the WebSocket's client events, ``models`` for ``/v1/models`` and the control call), what they
share (``common``) and the error ladder (``errors``). Every name is importable from here.

Request models forbid unknown fields, so a typo is a 400 naming the field instead of a silently
ignored option. The fields that the official ``openai`` client (or common OpenAI callers) send but
that this runtime has no use for are declared explicitly and ignored; fields that would change the
meaning of a request (``tools``, ``logprobs``, ``response_format`` on chat...) are not declared, so
they are rejected rather than half-honoured.

Bounds are checked here, so absurd input (a 100000x100000 size, n=1000, a megabyte prompt) is
refused before anything reaches the engine; a field that the engine's params also take gets its
bounds from the one table of :mod:`omni_runtime.bounds` (``Annotated[int, Field(**bounds("seed"))]``).

The error ladder, :func:`error_body` (``errors.py``), is the one place where every exception
(pydantic validation, the engine's typed errors, the server's own) becomes a status code and
the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from .chat import (
    MAX_MESSAGES,
    ChatAudio,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChunkChoice,
    ContentPart,
    DeltaMessage,
    ImageUrl,
    ResponseMessage,
    StreamOptions,
    Usage,
    usage_of,
)
from .common import (
    MAX_SECONDS,
    ImageFormat,
    JobFormat,
    LoraSpec,
    NotBool,
    Priority,
    Seed,
    SloMs,
    StepCacheField,
    Timeout,
    UnencodableValue,
    parse_size,
    seconds_of,
)
from .common import _not_bool as _not_bool
from .common import _Request as _Request
from .common import _SizedRequest as _SizedRequest
from .errors import (
    DISCONNECTED,
    ApiError,
    ClientDisconnected,
    ErrorDetail,
    ErrorResponse,
    classify_error,
    error_body,
)
from .generate import GenerateConfig, GenerateInputs, GenerateRequest
from .images import (
    MAX_IMAGES,
    VARIATION_STRENGTH,
    ImageData,
    ImageEditForm,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ImageVariationForm,
)
from .models import CollectiveRpcRequest, ModelCard, ModelList, ReplicaResult
from .realtime import (
    CLIENT_EVENT_TYPES,
    CLIENT_EVENTS,
    AudioAppend,
    AudioClear,
    AudioCommit,
    ClientEvent,
    ConversationItem,
    InputTranscription,
    ItemContent,
    ItemCreate,
    ResponseCancel,
    ResponseCreate,
    ResponseSettings,
    SessionSettings,
    SessionUpdate,
    TurnDetection,
)
from .speech import SpeechRequest, SpeechVoice
from .videos import VideoCreateRequest, VideoReference

__all__ = [
    "CLIENT_EVENTS",
    "CLIENT_EVENT_TYPES",
    "DISCONNECTED",
    "MAX_IMAGES",
    "MAX_MESSAGES",
    "MAX_SECONDS",
    "VARIATION_STRENGTH",
    "ApiError",
    "AudioAppend",
    "AudioClear",
    "AudioCommit",
    "ChatAudio",
    "ChatChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "ChunkChoice",
    "ClientDisconnected",
    "ClientEvent",
    "CollectiveRpcRequest",
    "ContentPart",
    "ConversationItem",
    "DeltaMessage",
    "ErrorDetail",
    "ErrorResponse",
    "GenerateConfig",
    "GenerateInputs",
    "GenerateRequest",
    "ImageData",
    "ImageEditForm",
    "ImageFormat",
    "ImageGenerationRequest",
    "ImageGenerationResponse",
    "ImageUrl",
    "ImageVariationForm",
    "InputTranscription",
    "ItemContent",
    "ItemCreate",
    "JobFormat",
    "LoraSpec",
    "ModelCard",
    "ModelList",
    "NotBool",
    "Priority",
    "ReplicaResult",
    "ResponseCancel",
    "ResponseCreate",
    "ResponseMessage",
    "ResponseSettings",
    "Seed",
    "SessionSettings",
    "SessionUpdate",
    "SloMs",
    "SpeechRequest",
    "SpeechVoice",
    "StepCacheField",
    "StreamOptions",
    "Timeout",
    "TurnDetection",
    "UnencodableValue",
    "Usage",
    "VideoCreateRequest",
    "VideoReference",
    "classify_error",
    "error_body",
    "parse_size",
    "seconds_of",
    "usage_of",
]
