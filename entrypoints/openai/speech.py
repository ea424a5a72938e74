"""The speech route (``POST /v1/audio/speech``): text in, audio bytes out, as OpenAI's API has it.

Runs on the server's event loop. A VITS speech stage makes a whole clip in one forward, so every
form of the answer starts once the clip exists: ``stream_format: audio`` with ``pcm`` sends the
samples in chunks as each is encoded, with ``wav`` the encoded file in chunks (its header carries
the clip's true length, which is known by then); other formats are encoded whole, then sent.
``stream_format: sse`` sends the file's bytes as base64 ``speech.audio.delta`` events, then one
``speech.audio.done`` event with the usage. Encoding runs off the event loop (``encode_all``).

When the speech stage is chunked (``input_chunking``: it speaks its upstream's answer sentence by
sentence), ``stream_format: sse`` and ``stream_format: audio`` with ``pcm`` send each chunk's audio
as soon as that chunk is spoken, before the rest exists: ``pcm`` as the samples, another format
(sse) as one whole file per chunk.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omni_runtime.events import Final, MediaDelta
from omni_runtime.exceptions import InvalidRequestError, OmniError
from omni_runtime.media import AudioItem

from ..async_omni import ValidRequest
from ..tasks import AUDIO, TASKS
from ..tasks.render import b64
from . import protocol as proto
from .body import BodyRoute
from .dependencies import AUTH, JSON_BODY, SpeechModel, State
from .protocol import error_body
from .state import ModelHandle, ServerState

SPEECH = TASKS["text2speech"]
#: Request field -> speech param (and back, in errors); the text is the engine's prompt.
SPEECH_FIELDS = SPEECH.fields["speech"]
#: Bytes per streamed chunk of an encoded file (and per SSE delta, before base64).
FILE_CHUNK_BYTES = 8192


def _validate(model: ModelHandle, body: proto.SpeechRequest) -> tuple[ValidRequest, int]:
    """The request checked on ``model`` (its speech stage's fields), and that stage's id."""
    stage_id = model.capabilities.stage(SPEECH.name)
    assert stage_id is not None  # the SpeechModel dependency refuses a model without one
    omni = model.engine
    try:
        valid = omni.validate(body.input, SPEECH.sampling_params(omni, SPEECH_FIELDS.params(body)))
    except InvalidRequestError as e:
        raise SPEECH_FIELDS.rename(e) from None
    return valid, stage_id


def _streams_chunks(model: ModelHandle, body: proto.SpeechRequest) -> bool:
    """Whether this answer goes out chunk by chunk: a chunked speech stage, and a stream that can
    carry pieces (SSE, or raw PCM)."""
    chunked = model.capabilities.chunked_speech
    return chunked and (body.stream_format == "sse" or body.response_format == "pcm")


async def synthesise(
    state: ServerState, model: ModelHandle, request: Request, body: proto.SpeechRequest
) -> tuple[AudioItem, int, str]:
    """Run the request on ``model``: the clip, its input token count and the request id."""
    valid, stage_id = _validate(model, body)
    rid = f"speech-{uuid.uuid4().hex}"
    try:
        out = await state.until_disconnect(request, [rid], state.collect(model, valid, rid))
    except InvalidRequestError as e:  # the stage's own checks (no speakable character)
        raise SPEECH_FIELDS.rename(e) from None
    result = out.outputs_by_stage[stage_id]
    clip = result.audios[0]
    return clip, int(result.metrics.get("input_tokens") or 0), rid


def _chunks(clip: AudioItem, fmt: str) -> AsyncIterator[bytes]:
    """The clip as ``fmt`` bytes, in the pieces they are sent in (raw PCM by samples, a file
    in :data:`FILE_CHUNK_BYTES`)."""
    return AUDIO.pieces(clip, fmt, FILE_CHUNK_BYTES)


def _sse(event: dict[str, object]) -> str:
    return f"data: {json.dumps(event)}\n\n"


router = APIRouter(prefix="/v1/audio", dependencies=[AUTH], route_class=BodyRoute)


def _usage(clip: AudioItem, input_tokens: int) -> dict[str, int]:
    """Usage in OpenAI's shape; audio is counted in 20 ms frames."""
    output_tokens = math.ceil(clip.duration_s * 50)
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}


async def _stream_chunked(
    state: ServerState, model: ModelHandle, request: Request, body: proto.SpeechRequest, headers: dict[str, str]
) -> Response:
    """Each chunk's audio as the speech stage makes it (see the module's docstring)."""
    valid, stage_id = _validate(model, body)
    omni = model.engine
    rid = headers["X-Request-Id"] = f"speech-{uuid.uuid4().hex}"
    fmt, sse = body.response_format, body.stream_format == "sse"
    stream = omni.events(valid, request_id=rid)
    state.inflight[rid] = model.name
    try:
        # The first event before the headers: admission errors keep their status code.
        first = await state.until_disconnect(request, [rid], stream.__anext__())
    except InvalidRequestError as e:
        state.inflight.pop(rid, None)
        await stream.aclose()
        raise SPEECH_FIELDS.rename(e) from None
    except BaseException:
        state.inflight.pop(rid, None)
        await stream.aclose()
        raise

    async def pieces() -> AsyncIterator[str | bytes]:
        finished = False
        try:
            event = first
            while not isinstance(event, Final):
                match event:
                    case MediaDelta(stage=sid, items=items) if sid == stage_id:
                        for clip in AUDIO.items(items):
                            async for blob in _chunks(clip, fmt):
                                yield _sse({"type": "speech.audio.delta", "audio": b64(blob)}) if sse else blob
                event = await stream.__anext__()
            finished = True
            out = event.output
            state.metrics.observe_output(out, model.name)
            result = out.outputs_by_stage[stage_id]
            if sse:
                usage = _usage(result.audios[0], int(result.metrics.get("input_tokens") or 0))
                yield _sse({"type": "speech.audio.done", "usage": usage})
        except OmniError as e:
            finished = True
            if not sse:
                raise  # a raw stream can only be cut short
            yield _sse({"type": "error", **error_body(e)[1]})
        finally:
            state.inflight.pop(rid, None)
            if not finished:
                omni.abort(rid)
            await stream.aclose()

    media_type = "text/event-stream" if sse else AUDIO.media_type(fmt)
    return StreamingResponse(pieces(), media_type=media_type, headers=headers)


@router.post("/speech", dependencies=[JSON_BODY], response_model=None)
async def create_speech(body: proto.SpeechRequest, request: Request, state: State, model: SpeechModel) -> Response:
    if _streams_chunks(model, body):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return await _stream_chunked(state, model, request, body, headers)
    clip, input_tokens, rid = await synthesise(state, model, request, body)
    fmt = body.response_format
    headers = {"X-Request-Id": rid, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if body.stream_format == "sse":
        usage = _usage(clip, input_tokens)

        async def events() -> AsyncIterator[str]:
            async for chunk in _chunks(clip, fmt):
                yield _sse({"type": "speech.audio.delta", "audio": b64(chunk)})
            yield _sse({"type": "speech.audio.done", "usage": usage})

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
    media_type = AUDIO.media_type(fmt)
    if fmt in ("pcm", "wav"):
        return StreamingResponse(_chunks(clip, fmt), media_type=media_type, headers=headers)
    blob = (await AUDIO.encode([clip], fmt))[0]
    return Response(blob, media_type=media_type, headers=headers)
