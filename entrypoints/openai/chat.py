"""``POST /v1/chat/completions``: the last user message (and an input image) to the pipeline, the
answer as one message or as Server-Sent Events (text deltas, image parts, audio chunks, progress
comments). A pipeline with a speech stage answers with audio as OpenAI does: ``message.audio``
(``id``, base64 ``data``, ``transcript``, ``expires_at``), or ``delta.audio`` pieces once the clip
is made (``pcm16`` in chunks of :data:`~..tasks.render.PCM_CHUNK_SAMPLES`, another format whole);
its media are rendered by the chat task's renderer (tasks/render.py: ``MESSAGE``)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omni_runtime.events import Final, MediaDelta, Progress, StageDone, TextDelta
from omni_runtime.exceptions import InvalidRequestError, OmniError
from omni_runtime.media import ALIASES, AudioItem
from omni_runtime.outputs import OmniRequestOutput, StageResult
from omni_runtime.params import MAX_PROMPT_CHARS

from ..async_omni import ValidRequest
from ..tasks import MESSAGE, TASKS
from . import protocol as proto
from .body import BodyRoute
from .dependencies import AUTH, JSON_BODY, ChatModel, State
from .images import chat_image
from .protocol import DISCONNECTED, error_body
from .responses import json_with_id
from .state import ModelHandle, ServerState

router = APIRouter(prefix="/v1", dependencies=[AUTH], route_class=BodyRoute)

CHAT = TASKS["chat"]
#: Request field -> engine param (shared by every stage that takes it), and back in errors: the
#: chat task's table (entrypoints/tasks/fields.py).
CHAT_FIELDS = CHAT.fields["chat"]


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
        valid = omni.validate(prompt, CHAT.sampling_params(omni, shared, image=image), modalities=modalities)
    except InvalidRequestError as e:
        if image is not None and e.param == "image":  # where in the messages the image was
            e.param = body.image_urls()[0][1]
        elif e.param == "prompt":  # where in the messages the prompt was
            e.param = where
        else:
            CHAT_FIELDS.rename(e)
            if e.param == "max_tokens" and body.max_completion_tokens is not None:
                e.param = "max_completion_tokens"  # the field the request set (it wins over max_tokens)
        raise
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    spoken = Spoken(body.audio.encoder_format() if body.audio else DEFAULT_AUDIO_FORMAT, hide_text, prompt)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream_chat(state, model, request, rid, valid, include_usage, spoken)
    out = await state.until_disconnect(request, [rid], state.collect(model, valid, rid))
    texts = [r.text for _, r in sorted(out.outputs_by_stage.items()) if r.text is not None]
    clips = MESSAGE.audio.items(out.media)
    audio = _audio_piece(await MESSAGE.audio_file(clips[0], spoken.format), spoken.transcript(out)) if clips else None
    message = proto.ResponseMessage(
        content="\n".join(texts) if texts and not hide_text else None,
        images=await MESSAGE.image_parts(out.media) or None,
        audio=audio,
    )
    usage, finish = proto.usage_of(out, valid.params)
    choice = proto.ChatChoice(message=message, finish_reason=finish)
    resp = proto.ChatCompletionResponse(id=rid, model=model.name, choices=[choice], usage=usage)
    return resp.model_dump(exclude_none=True), rid


#: The spoken answer's format when the request gives no ``audio``.
DEFAULT_AUDIO_FORMAT = CHAT.format
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
        return self.transcript_of({sid: r.text for sid, r in out.outputs_by_stage.items() if r.text is not None})

    def transcript_of(self, texts: dict[int, str]) -> str:
        """The stages' texts (by stage id) in stage order, or the prompt when there are none."""
        return "\n".join(texts[sid] for sid in sorted(texts)) if texts else self.prompt


def _audio_piece(data: str, transcript: str | None, audio_id: str | None = None) -> dict[str, Any]:
    """``message.audio`` (or the first ``delta.audio``): the bytes as base64, with the transcript."""
    piece: dict[str, Any] = {"id": audio_id or f"audio_{uuid.uuid4().hex}", "data": data}
    if transcript is not None:
        piece |= {"transcript": transcript, "expires_at": int(time.time()) + AUDIO_EXPIRES_S}
    return piece


async def _clip_deltas(
    clips: list[AudioItem], spoken: Spoken, transcript: str | None, audio_id: str
) -> list[proto.DeltaMessage]:
    """``clips`` as ``delta.audio`` pieces (tasks.render: ``pcm`` cut in PCM_CHUNK_SAMPLES,
    another format a whole file per clip); the first carries ``transcript`` when it is given."""
    pieces = await MESSAGE.audio_pieces(clips, spoken.format)
    return [
        proto.DeltaMessage(audio=_audio_piece(piece, transcript if i == 0 else None, audio_id))
        for i, piece in enumerate(pieces)
    ]


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
    stream = omni.events(valid, request_id=rid)
    state.inflight[rid] = model.name
    try:
        # Wait for the first event before sending headers, so that admission errors (429, 400,
        # 503) keep their status code instead of arriving inside a 200 stream.
        first = await state.until_disconnect(request, [rid], stream.__anext__())
    except BaseException:
        state.inflight.pop(rid, None)
        await stream.aclose()
        raise
    created = int(time.time())

    def chunk(delta: proto.DeltaMessage | None, finish: str | None = None, usage: proto.Usage | None = None) -> str:
        choices = [] if delta is None else [proto.ChunkChoice(delta=delta, finish_reason=finish)]
        c = proto.ChatCompletionChunk(id=rid, created=created, model=model.name, choices=choices, usage=usage)
        return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

    async def events() -> AsyncIterator[str]:
        texts: dict[int, str] = {}  # each stage's text so far (streamed, or its whole result)
        streamed: set[int] = set()  # stages whose audio came chunk by chunk
        audio_id = f"audio_{uuid.uuid4().hex}"
        finished = False
        try:
            yield chunk(proto.DeltaMessage(role="assistant", content=""))
            event = first
            while not isinstance(event, Final):
                match event:
                    case Progress() | StageDone(result=None):
                        # An SSE comment: clients (the openai one included) skip it, but it shows
                        # that the image is being drawn and keeps proxies from timing the stream out.
                        yield _progress_comment(event)
                    case TextDelta(stage=sid, text=text):
                        texts[sid] = texts.get(sid, "") + text
                        if text and not spoken.hide_text:
                            yield chunk(proto.DeltaMessage(content=text))
                    case MediaDelta(stage=sid, items=items):
                        # One chunk of a chunked speech stage: its audio now, in chunk order.
                        streamed.add(sid)
                        for delta in await _clip_deltas(MESSAGE.audio.items(items), spoken, None, audio_id):
                            yield chunk(delta)
                    case StageDone(result=StageResult() as result):
                        for delta in await _stage_deltas(result, texts, streamed, spoken, audio_id):
                            yield chunk(delta)
                event = await stream.__anext__()
            finished = True
            out = event.output
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
            state.count_aborted("client_disconnect", [rid])
            raise
        finally:
            state.inflight.pop(rid, None)
            if not finished:
                omni.abort(rid)
            await stream.aclose()
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": rid}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _progress_comment(event: Progress | StageDone) -> str:
    match event:
        case Progress(stage=sid, step=step, steps=steps):
            return f": progress stage={sid} step={step}/{steps}\n\n"
        case StageDone(stage=sid):
            return f": progress stage={sid} done\n\n"


async def _stage_deltas(
    result: StageResult, texts: dict[int, str], streamed: set[int], spoken: Spoken, audio_id: str
) -> list[proto.DeltaMessage]:
    """What a final stage's whole output adds to the stream: the rest of its text (all of it for
    a stage that does not stream; none when the answer is audio only), its images as content
    parts, then its audio: the first clip as ``delta.audio`` pieces (the first carrying the
    transcript, the text stages' answer), or, when its audio came chunk by chunk, the transcript."""
    sid = result.stage_id
    deltas = []
    shown = len(texts.get(sid, ""))
    if result.text is not None:
        texts[sid] = result.text
    if result.text and len(result.text) > shown and not spoken.hide_text:
        deltas.append(proto.DeltaMessage(content=result.text[shown:]))
    if MESSAGE.images.items(result.media):
        deltas.append(proto.DeltaMessage(images=await MESSAGE.image_parts(result.media)))
    transcript = spoken.transcript_of(texts)
    if sid in streamed:
        deltas.append(proto.DeltaMessage(audio=_audio_piece("", transcript, audio_id)))
    else:
        deltas += await _clip_deltas(MESSAGE.audio.items(result.media)[:1], spoken, transcript, audio_id)
    return deltas
