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

import base64
import json
import math
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omni_runtime import encoders
from omni_runtime.exceptions import InvalidRequestError, OmniError
from omni_runtime.media import AudioItem, items_of

from ..async_omni import ValidRequest
from . import protocol as proto
from .body import BodyRoute
from .dependencies import AUTH, JSON_BODY, SpeechModel, State
from .fields import FieldMap
from .protocol import error_body
from .state import ModelHandle, ServerState

#: Request field -> speech param (and back, in errors); the text is the engine's prompt.
SPEECH_FIELDS = FieldMap(
    {"voice": "voice", "speed": "speed", "seed": "seed"},
    read={"voice": lambda body: body.voice_name()},
    computed={"input": "prompt"},
)
#: Samples per streamed chunk of raw PCM (a quarter second at 16 kHz).
PCM_CHUNK_SAMPLES = 4096
#: Bytes per streamed chunk of an encoded file (and per SSE delta, before base64).
FILE_CHUNK_BYTES = 8192


def _validate(model: ModelHandle, body: proto.SpeechRequest) -> tuple[ValidRequest, int]:
    """The request checked on ``model`` (its speech stage's fields), and that stage's id."""
    stage_id = model.capabilities.stage("text2speech")
    assert stage_id is not None  # the SpeechModel dependency refuses a model without one
    omni = model.engine
    try:
        valid = omni.validate(body.input, omni.sampling_params(shared=SPEECH_FIELDS.params(body)))
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


async def _pcm_chunks(clip: AudioItem) -> AsyncIterator[bytes]:
    for start in range(0, max(clip.num_samples, 1), PCM_CHUNK_SAMPLES):
        part = AudioItem(data=clip.samples[:, start : start + PCM_CHUNK_SAMPLES], sample_rate=clip.sample_rate)
        yield (await encoders.encode_all([part], "pcm"))[0]


async def _file_chunks(clip: AudioItem, fmt: str) -> AsyncIterator[bytes]:
    blob = (await encoders.encode_all([clip], fmt))[0]
    for start in range(0, len(blob), FILE_CHUNK_BYTES):
        yield blob[start : start + FILE_CHUNK_BYTES]


def _chunks(clip: AudioItem, fmt: str) -> AsyncIterator[bytes]:
    """The clip as ``fmt`` bytes, in the pieces they are sent in."""
    return _pcm_chunks(clip) if fmt == "pcm" else _file_chunks(clip, fmt)


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
    agen = omni.generate(valid, request_id=rid)
    state.inflight.add(rid)
    try:
        # The first output before the headers: admission errors keep their status code.
        first = await state.until_disconnect(request, [rid], agen.__anext__())
    except InvalidRequestError as e:
        state.inflight.discard(rid)
        await agen.aclose()
        raise SPEECH_FIELDS.rename(e) from None
    except BaseException:
        state.inflight.discard(rid)
        await agen.aclose()
        raise

    async def pieces() -> AsyncIterator[str | bytes]:
        finished = False
        try:
            out = first
            while True:
                clips = [c for c in items_of(out.media_delta, "audio") if isinstance(c, AudioItem)]
                for clip in clips if out.stage_id == stage_id else []:
                    async for blob in _chunks(clip, fmt):
                        audio = base64.b64encode(blob).decode()
                        yield _sse({"type": "speech.audio.delta", "audio": audio}) if sse else blob
                if out.finished:
                    break
                out = await agen.__anext__()
            finished = True
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
            state.inflight.discard(rid)
            if not finished:
                omni.abort(rid)
            await agen.aclose()

    media_type = "text/event-stream" if sse else encoders.media_type("audio", fmt)
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
                yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
            yield _sse({"type": "speech.audio.done", "usage": usage})

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
    media_type = encoders.media_type("audio", fmt)
    if fmt in ("pcm", "wav"):
        return StreamingResponse(_chunks(clip, fmt), media_type=media_type, headers=headers)
    blob = (await encoders.encode_all([clip], fmt))[0]
    return Response(blob, media_type=media_type, headers=headers)
