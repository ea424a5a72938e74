"""``POST /v1/chat/completions``: the last user message (and an input image) to the pipeline, the
answer as one message or as Server-Sent Events (text deltas, image parts, audio chunks, progress
comments). A pipeline with a speech stage answers with audio as OpenAI does: ``message.audio``
(``id``, base64 ``data``, ``transcript``, ``expires_at``), or ``delta.audio`` pieces once the clip
is made (``pcm16`` in chunks of :data:`~.speech.PCM_CHUNK_SAMPLES`, another format whole)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omni_runtime import encoders
from omni_runtime.exceptions import InvalidRequestError, OmniError
from omni_runtime.media import ALIASES, AudioItem, MediaItem, items_of
from omni_runtime.outputs import OmniRequestOutput, RequestProgress
from omni_runtime.params import MAX_PROMPT_CHARS

from ..async_omni import ValidRequest
from . import protocol as proto
from .body import BodyRoute
from .dependencies import AUTH, JSON_BODY, ChatModel, State
from .fields import FieldMap
from .images import chat_image
from .protocol import DISCONNECTED, error_body
from .responses import json_with_id
from .speech import PCM_CHUNK_SAMPLES
from .state import ModelHandle, ServerState

router = APIRouter(prefix="/v1", dependencies=[AUTH], route_class=BodyRoute)

#: Request field -> engine param (shared by every stage that takes it), and back in errors.
CHAT_FIELDS = FieldMap(
    {
        "max_tokens": "max_tokens",
        "temperature": "temperature",
        "top_p": "top_p",
        "stop": "stop",
        "seed": "seed",
        "timeout": "timeout",
        "lora": "lora",
        "priority": "priority",
        "audio.voice": "voice",
    },
    read={
        "audio.voice": lambda body: body.audio.voice_name() if body.audio else None,
        "max_tokens": lambda body: body.max_completion_tokens or body.max_tokens,
        "stop": lambda body: [body.stop] if isinstance(body.stop, str) else body.stop,
        "lora": lambda body: body.lora.params() if body.lora else None,
    },
)


@router.post("/chat/completions", dependencies=[JSON_BODY])
async def chat(body: proto.ChatCompletionRequest, request: Request, state: State, model: ChatModel) -> Response:
    answer = await chat_completion(state, model, body, request)
    return answer if isinstance(answer, Response) else json_with_id(answer)


async def chat_completion(
    state: ServerState, model: ModelHandle, body: proto.ChatCompletionRequest, request: Request
) -> StreamingResponse | tuple[dict[str, Any], str]:
    """The streamed answer on ``model``, or the whole one with its request id."""
    omni = model.engine
    try:
        prompt, where = body.prompt()
    except ValueError as e:
        raise InvalidRequestError(str(e), param="messages") from None
    if len(prompt) > MAX_PROMPT_CHARS:
        too_long = f"the prompt is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}"
        raise InvalidRequestError(too_long, param=where)
    shared = CHAT_FIELDS.params(body)
    modalities = list(body.modalities) if body.modalities else None
    # Audio asked for without text: a text stage still delivers its answer (the audio's
    # transcript), which the message then leaves out.
    kinds = {ALIASES.get(m, m) for m in modalities or ()}
    hide_text = "audio" in kinds and "text" not in kinds and "text" in model.capabilities.kinds
    if hide_text and modalities is not None:
        modalities.append("text")
    image = await chat_image(model, body)
    try:
        valid = omni.validate(prompt, omni.sampling_params(image=image, shared=shared), modalities=modalities)
    except InvalidRequestError as e:
        if image is not None and e.param == "image":  # where in the messages the image was
            e.param = body.image_urls()[0][1]
        else:
            CHAT_FIELDS.rename(e)
        raise
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    spoken = Spoken(body.audio.encoder_format() if body.audio else DEFAULT_AUDIO_FORMAT, hide_text, prompt)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream_chat(state, model, request, rid, valid, include_usage, spoken)
    out = await state.until_disconnect(request, [rid], state.collect(model, valid, rid))
    texts = [r.text for _, r in sorted(out.outputs_by_stage.items()) if r.text is not None]
    clips = [c for c in items_of(list(out.media), "audio") if isinstance(c, AudioItem)]
    audio = None
    if clips:
        data = (await encoders.encode_all(clips[:1], spoken.format))[0]
        audio = _audio_piece(data, spoken.transcript(out))
    message = proto.ResponseMessage(
        content="\n".join(texts) if texts and not hide_text else None,
        images=await _image_parts(out.media) or None,
        audio=audio,
    )
    usage, finish = proto.usage_of(out, valid.params)
    choice = proto.ChatChoice(message=message, finish_reason=finish)
    resp = proto.ChatCompletionResponse(id=rid, model=model.name, choices=[choice], usage=usage)
    return resp.model_dump(exclude_none=True), rid


#: The spoken answer's format when the request gives no ``audio``.
DEFAULT_AUDIO_FORMAT = "wav"
#: When an answer's audio ``expires_at`` (seconds after it was made): nothing is stored, so a
#: later turn cannot refer to it by id; the field is there for OpenAI clients, which read it.
AUDIO_EXPIRES_S = 3600


@dataclass(frozen=True)
class Spoken:
    """How a chat answer's audio is delivered."""

    #: The encoder registry's format (``pcm`` for ``pcm16``).
    format: str
    #: Audio was asked for without text: the text stages' answer is the transcript only.
    hide_text: bool
    #: The caller's prompt: what a pipeline without a text stage speaks, so its transcript.
    prompt: str

    def transcript(self, out: OmniRequestOutput) -> str:
        texts = [r.text for _, r in sorted(out.outputs_by_stage.items()) if r.text is not None]
        return "\n".join(texts) if texts else self.prompt


def _audio_piece(data: bytes, transcript: str | None, audio_id: str | None = None) -> dict[str, Any]:
    """``message.audio`` (or the first ``delta.audio``): the bytes as base64, with the transcript."""
    piece: dict[str, Any] = {"id": audio_id or f"audio_{uuid.uuid4().hex}", "data": base64.b64encode(data).decode()}
    if transcript is not None:
        piece |= {"transcript": transcript, "expires_at": int(time.time()) + AUDIO_EXPIRES_S}
    return piece


async def _audio_deltas(out: OmniRequestOutput, spoken: Spoken, audio_id: str) -> list[proto.DeltaMessage]:
    """The audio of a finished speech stage as ``delta.audio`` pieces: ``pcm`` in chunks of
    PCM_CHUNK_SAMPLES samples, another format as one whole file; the first carries the transcript
    (the text stages' answer)."""
    result = out.outputs_by_stage.get(out.stage_id)
    clips = [c for c in items_of(result.media, "audio") if isinstance(c, AudioItem)] if result else []
    return await _clip_deltas(clips[:1], spoken, spoken.transcript(out), audio_id)


async def _clip_deltas(
    clips: list[AudioItem], spoken: Spoken, transcript: str | None, audio_id: str
) -> list[proto.DeltaMessage]:
    """``clips`` as ``delta.audio`` pieces (``pcm`` cut in PCM_CHUNK_SAMPLES, another format a
    whole file per clip); the first carries ``transcript`` when it is given."""
    parts = []
    for clip in clips:
        if spoken.format == "pcm":
            parts += [
                AudioItem(data=clip.samples[:, start : start + PCM_CHUNK_SAMPLES], sample_rate=clip.sample_rate)
                for start in range(0, clip.num_samples, PCM_CHUNK_SAMPLES)
            ]
        else:
            parts.append(clip)
    blobs = await encoders.encode_all(parts, spoken.format)
    return [
        proto.DeltaMessage(audio=_audio_piece(blob, transcript if i == 0 else None, audio_id))
        for i, blob in enumerate(blobs)
    ]


async def _image_parts(media: Sequence[MediaItem]) -> list[dict[str, Any]]:
    """The images among ``media`` as ``image_url`` content parts (PNG data URLs)."""
    images = items_of(list(media), "image")
    url = "data:" + encoders.media_type("image", "png") + ";base64,"
    blobs = await encoders.encode_all(images, "png")
    return [{"type": "image_url", "image_url": {"url": url + base64.b64encode(b).decode()}} for b in blobs]


async def _stream_chat(
    state: ServerState,
    model: ModelHandle,
    request: Request,
    rid: str,
    valid: ValidRequest,
    include_usage: bool,
    spoken: Spoken,
) -> StreamingResponse:
    omni = model.engine
    agen = omni.generate(valid, request_id=rid)
    state.inflight.add(rid)
    try:
        # Wait for the first output before sending headers, so that admission errors (429, 400,
        # 503) keep their status code instead of arriving inside a 200 stream.
        first = await state.until_disconnect(request, [rid], agen.__anext__())
    except BaseException:
        state.inflight.discard(rid)
        await agen.aclose()
        raise
    created = int(time.time())

    def chunk(delta: proto.DeltaMessage | None, finish: str | None = None, usage: proto.Usage | None = None) -> str:
        choices = [] if delta is None else [proto.ChunkChoice(delta=delta, finish_reason=finish)]
        c = proto.ChatCompletionChunk(id=rid, created=created, model=model.name, choices=choices, usage=usage)
        return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

    async def events() -> AsyncIterator[str]:
        sent: dict[int, int] = {}  # characters of each stage's text already streamed
        imaged: set[int] = set()
        voiced: set[int] = set()  # stages whose audio was sent
        streamed: set[int] = set()  # stages whose audio came chunk by chunk
        audio_id = f"audio_{uuid.uuid4().hex}"
        finished = False
        try:
            yield chunk(proto.DeltaMessage(role="assistant", content=""))
            out = first
            while True:
                if out.progress is not None:
                    # An SSE comment: clients (the openai one included) skip it, but it shows that
                    # the image is being drawn and keeps proxies from timing the stream out.
                    yield _progress_comment(out.progress)
                for delta in await _deltas(out, sent, imaged):
                    if not (spoken.hide_text and delta.images is None):
                        yield chunk(delta)
                if out.media_delta:
                    # One chunk of a chunked speech stage: its audio now, in chunk order.
                    clips = [c for c in items_of(out.media_delta, "audio") if isinstance(c, AudioItem)]
                    streamed.add(out.stage_id)
                    for delta in await _clip_deltas(clips, spoken, None, audio_id):
                        yield chunk(delta)
                elif out.progress is None and out.text_delta is None and out.stage_id not in voiced:
                    voiced.add(out.stage_id)
                    if out.stage_id in streamed:  # its audio went chunk by chunk: the transcript now
                        yield chunk(proto.DeltaMessage(audio=_audio_piece(b"", spoken.transcript(out), audio_id)))
                    else:
                        for delta in await _audio_deltas(out, spoken, audio_id):
                            yield chunk(delta)
                if out.finished:
                    break
                out = await agen.__anext__()
            finished = True
            state.metrics.observe_output(out, model.name)
            usage, finish = proto.usage_of(out, valid.params)
            yield chunk(proto.DeltaMessage(), finish)
            if include_usage:
                yield chunk(None, usage=usage)
        except OmniError as e:
            finished = True
            yield f"data: {json.dumps(error_body(e)[1])}\n\n"
        except asyncio.CancelledError:
            # Starlette cancels the stream when the client disconnects.
            request.scope[DISCONNECTED] = True
            state.metrics.aborted.labels("client_disconnect").inc()
            raise
        finally:
            state.inflight.discard(rid)
            if not finished:
                omni.abort(rid)
            await agen.aclose()
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": rid}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _progress_comment(progress: RequestProgress) -> str:
    if not progress.stage_done:
        return f": progress stage={progress.stage_id} step={progress.step}/{progress.steps}\n\n"
    return f": progress stage={progress.stage_id} done\n\n"


async def _deltas(out: OmniRequestOutput, sent: dict[int, int], imaged: set[int]) -> list[proto.DeltaMessage]:
    """What ``out`` adds to the stream: a streamed text piece, or the rest of a finished stage's
    text (a stage that does not stream), then its images as content parts."""
    sid = out.stage_id
    if out.text_delta is not None:
        sent[sid] = sent.get(sid, 0) + len(out.text_delta)
        return [proto.DeltaMessage(content=out.text_delta)] if out.text_delta else []
    result = out.outputs_by_stage.get(sid)
    if result is None:
        return []
    deltas = []
    if result.text and len(result.text) > sent.get(sid, 0):
        deltas.append(proto.DeltaMessage(content=result.text[sent.get(sid, 0) :]))
        sent[sid] = len(result.text)
    if items_of(result.media, "image") and sid not in imaged:
        imaged.add(sid)
        deltas.append(proto.DeltaMessage(images=await _image_parts(result.media)))
    return deltas
