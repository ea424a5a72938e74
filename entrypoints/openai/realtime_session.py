"""One realtime session's state machine (``WS /v1/realtime``): pure, no I/O and no clock, so every
event order is tested in milliseconds; the WebSocket adapter (``realtime.py``) only moves bytes.

Runs on the server's event loop. The adapter calls it with what happens and carries out what it
asks:

- :meth:`RealtimeSession.receive` takes one client message (JSON text) and returns the effects to
  carry out (:class:`StartResponse`: run a request on the engine; :class:`AbortResponse`: abort
  one at once);
- :meth:`~RealtimeSession.on_event` takes each engine event of a running response
  (``omni_runtime.events``), :meth:`~RealtimeSession.on_error` the error that ended one;
- every server event goes to :attr:`~RealtimeSession.outbox`, in the order it is sent.

A response that ends (done, cancelled by ``response.cancel`` or by new speech, failed) is over for
good the moment its ``response.done`` is queued: anything its request still delivers is dropped
here, so nothing of it follows its ``response.done``.

Errors use the HTTP error ladder (``error_body``): the same ``type`` / ``code`` / ``param`` as
the HTTP routes, with the client's ``event_id`` when the event had one.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from omni_runtime.events import Event, Final, MediaDelta, StageDone, TextDelta
from omni_runtime.exceptions import InvalidRequestError

from ..capabilities import ModelCapabilities
from ..tasks.render import AUDIO, b64
from . import protocol as proto
from .protocol import ApiError, error_body
from .vad import EnergyVad, SpeechStarted, SpeechStopped

#: A session's audio, both ways, when the client sets no rate (OpenAI's pcm16 rate).
DEFAULT_SAMPLE_RATE = 24_000
#: User items a session keeps (only the latest is answered; the others are ids).
MAX_ITEMS = 64


@dataclass(frozen=True)
class RealtimeLimits:
    """A server's bounds on realtime sessions (``--realtime-*``)."""

    #: Sessions open at once; one more is refused (503 ``too_many_sessions``, close code 4503).
    max_sessions: int = 16
    #: Audio a session's input buffer holds before ``input_audio_buffer.append`` is refused
    #: (8 MiB: about three minutes at 24 kHz).
    max_buffer_bytes: int = 8 * 1024 * 1024
    #: The largest client message; a larger one is an ``error`` event and is dropped.
    max_message_bytes: int = 1024 * 1024
    #: Seconds without a client message, while no response runs, after which the session closes
    #: (an ``error`` event ``idle_timeout``, close code 4408).
    idle_timeout_s: float = 300.0


@dataclass(frozen=True)
class SessionModel:
    """What a session's model can do, from its capabilities: the task its responses run as
    (``chat``, or ``text2speech`` for a speech-only pipeline, whose transcript is the prompt), and
    whether it answers with text, with audio, and takes audio in."""

    name: str
    task: str
    text: bool
    audio: bool
    audio_input: bool = False

    @property
    def modalities(self) -> list[str]:
        return [m for m, has in (("text", self.text), ("audio", self.audio)) if has]

    @classmethod
    def of(cls, name: str, capabilities: ModelCapabilities) -> SessionModel:
        """A model with a text final stage runs its responses as chat (with the audio of a speech
        stage after it, if any; audio turns when its first stage recognises speech); one that only
        speaks, as text2speech; any other is a 400 ``no_speech`` naming ``model``."""
        audio = "audio" in capabilities.kinds
        if "text" in capabilities.kinds and capabilities.serves("chat"):
            return cls(name, "chat", text=True, audio=audio, audio_input=capabilities.audio_input)
        if capabilities.serves("text2speech"):
            return cls(name, "text2speech", text=False, audio=True)
        raise ApiError(
            400, f"the model `{name}` answers with neither text nor speech; a realtime session needs one",
            param="model", code="no_speech",
        )  # fmt: skip


@dataclass(frozen=True)
class StartResponse:
    """Run ``prompt`` (and ``audio``, for an audio turn) as request ``request_id`` for response
    ``response_id``."""

    response_id: str
    request_id: str
    #: The session's instructions, then the user's text (of an audio turn: the instructions alone;
    #: the speech-recognition stage puts the transcript after them).
    prompt: str
    voice: str | None
    modalities: tuple[str, ...]
    #: The text stage's ``max_tokens`` (None: the model's default).
    max_tokens: int | None = None
    #: An audio turn's samples: 16-bit little-endian mono PCM at ``sample_rate``.
    audio: bytes | None = None
    sample_rate: int | None = None


@dataclass(frozen=True)
class _Item:
    """A user item of the conversation: text, or committed audio (pcm16 at ``sample_rate``)."""

    id: str
    text: str | None = None
    audio: bytes | None = None
    sample_rate: int = DEFAULT_SAMPLE_RATE


@dataclass(frozen=True)
class AbortResponse:
    """Abort request ``request_id`` (its response is over); ``reason`` for the metrics."""

    request_id: str
    reason: str


Effect = StartResponse | AbortResponse


def _event_id() -> str:
    return f"event_{uuid.uuid4().hex[:20]}"


@dataclass
class _Response:
    """A running response: what it sent so far."""

    id: str
    request_id: str
    item_id: str
    modalities: tuple[str, ...]
    #: The prompt: the transcript of a pipeline that speaks without a text stage.
    prompt: str
    texts: dict[int, str] = field(default_factory=dict)
    streamed_audio: set[int] = field(default_factory=set)
    audio_bytes: int = 0
    transcript_sent: bool = False

    @property
    def spoken(self) -> bool:
        return "audio" in self.modalities


class RealtimeSession:
    """One session's state (see the module docstring). ``model`` says what answers; ``limits``
    bound its buffer."""

    def __init__(self, model: SessionModel, limits: RealtimeLimits, session_id: str | None = None) -> None:
        self.model = model
        self.limits = limits
        self.id = session_id or f"sess_{uuid.uuid4().hex[:20]}"
        self.settings: dict[str, Any] = {
            "modalities": model.modalities,
            "instructions": "",
            "voice": None,
            "max_response_output_tokens": "inf",
            "input_audio_format": "pcm16",
            "output_audio_format": "pcm16",
            "input_sample_rate": DEFAULT_SAMPLE_RATE,
            "output_sample_rate": DEFAULT_SAMPLE_RATE,
            "turn_detection": None,
        }
        #: Server events waiting to be sent, oldest first.
        self.outbox: deque[dict[str, Any]] = deque()
        self.buffer = bytearray()
        self.vad: EnergyVad | None = None
        #: The conversation's user items, oldest first.
        self.items: list[_Item] = []
        self.response: _Response | None = None
        self.open()

    # ------------------------------------------------------------------ output

    def _emit(self, type_: str, **fields: Any) -> None:
        self.outbox.append({"type": type_, "event_id": _event_id(), **fields})

    def error(self, exc: BaseException, event_id: str | None = None) -> None:
        """An ``error`` event for ``exc`` (the HTTP ladder's shape and codes)."""
        _, body = error_body(exc)
        error = body["error"] | ({"event_id": event_id} if event_id else {})
        self._emit("error", error=error)

    def _session(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.session", "model": self.model.name, **self.settings}

    def open(self) -> None:
        self._emit("session.created", session=self._session())

    # ------------------------------------------------------------------ client events

    def receive(self, message: str | bytes) -> list[Effect]:
        """One client message; an invalid one is an ``error`` event (the session goes on)."""
        event_id = None
        try:
            data = json.loads(message)
            if isinstance(data, dict) and isinstance(data.get("event_id"), str):
                event_id = data["event_id"][:128]
            if not isinstance(data, dict) or data.get("type") not in proto.CLIENT_EVENT_TYPES:
                kind = data.get("type") if isinstance(data, dict) else None
                shown = repr(kind)[:80] if kind is not None else "none"
                raise ApiError(
                    400, f"unknown event type {shown}; the types taken are {', '.join(proto.CLIENT_EVENT_TYPES)}",
                    param="type", code="unknown_event",
                )  # fmt: skip
            try:
                event = proto.CLIENT_EVENTS.validate_python(data)
            except ValidationError as e:
                # Drop the union's tag from each location: a field is named as in the event.
                errors = [{**err, "loc": ("body", *err["loc"][1:])} for err in e.errors()]
                raise RequestValidationError(errors) from None
            return self._dispatch(event)
        except (ApiError, RequestValidationError, InvalidRequestError) as e:
            self.error(e, event_id)
        except (ValueError, RecursionError) as e:  # not JSON (or not UTF-8, or nested too deep)
            self.error(ApiError(400, f"the message is not JSON: {str(e)[:200]}", code="invalid_json"), event_id)
        return []

    def _dispatch(self, event: proto.ClientEvent) -> list[Effect]:
        match event:
            case proto.SessionUpdate(session=settings):
                self._update(settings)
            case proto.AudioAppend(audio=audio):
                return self._append(audio)
            case proto.AudioCommit():
                return self._commit(event.event_id, by_vad=False)
            case proto.AudioClear():
                self.buffer.clear()
                if self.vad is not None:
                    self.vad.reset()
                self._emit("input_audio_buffer.cleared")
            case proto.ItemCreate(item=item):
                text = "\n".join(part.text for part in item.content)
                item_id = item.id or f"item_{uuid.uuid4().hex[:20]}"
                self._add_item(_Item(item_id, text=text))
                created = {"id": item_id, "type": "message", "role": "user", "content": item.model_dump()["content"]}
                self._emit("conversation.item.created", previous_item_id=event.previous_item_id, item=created)
            case proto.ResponseCreate(response=settings):
                return self._create(settings, event.event_id)
            case proto.ResponseCancel(response_id=wanted):
                running = self.response
                if running is None or (wanted is not None and wanted != running.id):
                    raise ApiError(
                        400, "no response is running" if running is None else f"response `{wanted}` is not running",
                        param="response_id", code="response_cancel_not_active",
                    )  # fmt: skip
                return self.cancel("client_cancel")
        return []

    def _update(self, settings: proto.SessionSettings) -> None:
        given = settings.model_fields_set
        if "modalities" in given and settings.modalities is not None:
            self._check_modalities(settings.modalities, "session.modalities")
        for name in given:
            value = getattr(settings, name)
            if name == "turn_detection":
                value = value.model_dump() if value is not None else None
            elif value is None:
                continue
            self.settings[name] = value
        detection = self.settings["turn_detection"]
        if "turn_detection" in given or ("input_sample_rate" in given and detection is not None):
            self.vad = None
            if detection is not None:
                rate = self.settings["input_sample_rate"]
                self.vad = EnergyVad(rate, detection["threshold"], detection["silence_duration_ms"])
        self._emit("session.updated", session=self._session())

    def _check_modalities(self, modalities: Sequence[str], param: str) -> None:
        missing = sorted(set(modalities) - set(self.model.modalities))
        if missing:
            raise ApiError(
                400, f"{self.model.name} cannot answer with {', '.join(missing)}; it answers with "
                f"{', '.join(self.model.modalities)}", param=param, code=f"no_{missing[0]}",
            )  # fmt: skip

    def _append(self, audio: str) -> list[Effect]:
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "`audio` is not base64", param="audio", code="invalid_value") from None
        if len(pcm) % 2:
            raise ApiError(400, "`audio` must be whole 16-bit samples (an even byte count)", param="audio",
                           code="invalid_value")  # fmt: skip
        if len(self.buffer) + len(pcm) > self.limits.max_buffer_bytes:
            raise ApiError(
                400, f"the input audio buffer holds at most {self.limits.max_buffer_bytes} bytes; "
                "commit or clear it", param="audio", code="input_audio_buffer_full",
            )  # fmt: skip
        self.buffer += pcm
        if self.vad is None:
            return []
        effects: list[Effect] = []
        detection = self.settings["turn_detection"]
        for change in self.vad.feed(pcm):
            match change:
                case SpeechStarted(audio_ms=at):
                    self._emit("input_audio_buffer.speech_started", audio_start_ms=at, item_id=None)
                    if detection["interrupt_response"] and self.response is not None:
                        effects += self.cancel("barge_in")
                case SpeechStopped(audio_ms=at):
                    self._emit("input_audio_buffer.speech_stopped", audio_end_ms=at, item_id=None)
                    effects += self._commit(None, by_vad=True)
        return effects

    def _commit(self, event_id: str | None, *, by_vad: bool) -> list[Effect]:
        if not self.buffer:
            raise ApiError(400, "the input audio buffer is empty", code="input_audio_buffer_commit_empty")
        item_id = f"item_{uuid.uuid4().hex[:20]}"
        previous = self.items[-1].id if self.items else None
        self._add_item(_Item(item_id, audio=bytes(self.buffer), sample_rate=self.settings["input_sample_rate"]))
        self.buffer.clear()
        if self.vad is not None:
            self.vad.reset()
        self._emit("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        detection = self.settings["turn_detection"]
        if by_vad and detection is not None and detection["create_response"]:
            try:
                return self._create(None, event_id)
            except ApiError as e:
                self.error(e, event_id)
        return []

    def _add_item(self, item: _Item) -> None:
        """Append a user item. A response answers the latest only, so the older ones keep their ids
        (a committed item's ``previous_item_id``) but not their audio, and at most
        :data:`MAX_ITEMS` are kept: a long session holds one turn's audio, not all of it."""
        kept = [replace(old, audio=None) if old.audio is not None else old for old in self.items[-(MAX_ITEMS - 1) :]]
        self.items = [*kept, item]

    def _create(self, settings: proto.ResponseSettings | None, event_id: str | None) -> list[Effect]:
        if self.response is not None:
            raise ApiError(
                400, f"response `{self.response.id}` is running; cancel it first",
                code="conversation_already_has_active_response",
            )  # fmt: skip
        if not self.items:
            raise ApiError(400, "the conversation has no user item to answer", code="no_input")
        item = self.items[-1]
        if item.audio is not None and not self.model.audio_input:
            raise ApiError(
                400, f"{self.model.name} takes no audio input: its first stage reads text only; "
                "send the turn as a conversation.item.create of text, or use a model whose first stage "
                "recognises speech (tiny-omni-voice)", code="no_audio_input",
            )  # fmt: skip
        instructions = self.settings["instructions"]
        if settings is not None and settings.instructions is not None:
            instructions = settings.instructions
        prompt = self._prompt(instructions, item.text or "")
        modalities = list(settings.modalities) if settings and settings.modalities else self.settings["modalities"]
        self._check_modalities(modalities, "response.modalities")
        voice = settings.voice if settings and settings.voice else self.settings["voice"]
        limit = self.settings["max_response_output_tokens"]
        if settings is not None and settings.max_response_output_tokens is not None:
            limit = settings.max_response_output_tokens
        max_tokens = limit if isinstance(limit, int) else None
        response = _Response(
            id=f"resp_{uuid.uuid4().hex[:20]}",
            request_id=f"realtime-{uuid.uuid4().hex}",
            item_id=f"item_{uuid.uuid4().hex[:20]}",
            modalities=tuple(modalities),
            prompt=prompt,
        )
        self.response = response
        self._emit("response.created", response=self._response_body(response, "in_progress"))
        rate = item.sample_rate if item.audio is not None else None
        return [
            StartResponse(
                response.id, response.request_id, prompt, voice, response.modalities, max_tokens, item.audio, rate
            )
        ]

    def _prompt(self, instructions: str, text: str) -> str:
        """The request's prompt: a chat model reads the instructions first (as a system message,
        on lines of their own before the user's turn); a speech-only model speaks the text, so it
        gets the text alone."""
        if self.model.task != "chat":
            return text
        return "\n\n".join(part for part in (instructions.strip(), text) if part)

    def cancel(self, reason: str) -> list[Effect]:
        """End the running response now (``response.done``, cancelled): a client's
        ``response.cancel``, new speech, or the client gone (``client_disconnect``)."""
        running = self.response
        if running is None:
            return []
        self._done(running, "cancelled", reason=reason)
        return [AbortResponse(running.request_id, reason)]

    def close(self) -> list[Effect]:
        """The client went away: abort what runs (nothing more is sent)."""
        effects = self.cancel("client_disconnect")
        self.outbox.clear()
        return effects

    # ------------------------------------------------------------------ engine events

    def running(self, response_id: str) -> bool:
        """Whether response ``response_id`` is the one running (not yet done)."""
        return self._current(response_id) is not None

    def _current(self, response_id: str) -> _Response | None:
        running = self.response
        return running if running is not None and running.id == response_id else None

    def on_event(self, response_id: str, event: Event) -> None:
        """One engine event of response ``response_id``; dropped once that response is over."""
        running = self._current(response_id)
        if running is None:
            return
        match event:
            case TextDelta(stage=sid, text=text):
                running.texts[sid] = running.texts.get(sid, "") + text
                if text:
                    self._text(running, text)
            case MediaDelta(stage=sid, items=items):
                running.streamed_audio.add(sid)
                for clip in AUDIO.items(items):
                    self._audio(running, clip)
            case StageDone(stage=sid, result=result) if result is not None:
                shown = len(running.texts.get(sid, ""))
                if result.text is not None:
                    running.texts[sid] = result.text
                    if len(result.text) > shown:
                        self._text(running, result.text[shown:])
                if sid not in running.streamed_audio and running.spoken:
                    for clip in AUDIO.items(result.media)[:1]:
                        self._audio(running, clip)
            case Final(output=out):
                self._done(running, "completed", usage=self._usage(running, out.outputs_by_stage))

    def on_error(self, response_id: str, exc: BaseException) -> None:
        """The error that ended response ``response_id``'s request (an engine error, a refusal at
        admission): an ``error`` event, then ``response.done`` failed; the session goes on."""
        running = self._current(response_id)
        if running is None:
            return
        self.error(exc)
        self._done(running, "failed", error=error_body(exc)[1]["error"])

    def _delta_ids(self, running: _Response) -> dict[str, Any]:
        return {"response_id": running.id, "item_id": running.item_id, "output_index": 0, "content_index": 0}

    def _text(self, running: _Response, text: str) -> None:
        kind = "response.audio_transcript.delta" if running.spoken else "response.text.delta"
        running.transcript_sent = True
        self._emit(kind, delta=text, **self._delta_ids(running))

    def _audio(self, running: _Response, clip: Any) -> None:
        if not running.transcript_sent and not self.model.text:
            # A pipeline without a text stage speaks the prompt: that is its transcript.
            self._text(running, running.prompt)
        for piece in AUDIO.pcm16_pieces(clip, self.settings["output_sample_rate"]):
            running.audio_bytes += len(piece)
            self._emit("response.audio.delta", delta=b64(piece), **self._delta_ids(running))

    def _usage(self, running: _Response, results: dict[int, Any]) -> dict[str, Any]:
        """OpenAI's shape: the prompt's tokens (a text stage's ``prompt_tokens``; a speech-only
        model's ``input_tokens``: a speech stage after a text stage reads the answer, not the
        prompt), the text stages' tokens, and the audio in 20 ms frames."""
        metrics = [result.metrics for result in results.values()]
        prompt = [int(m["prompt_tokens"]) for m in metrics if m.get("prompt_tokens") is not None]
        input_tokens = sum(prompt) if prompt else sum(int(m.get("input_tokens") or 0) for m in metrics)
        output_tokens = sum(int(m.get("completion_tokens") or 0) for m in metrics)
        samples = running.audio_bytes // 2
        audio_tokens = math.ceil(samples / self.settings["output_sample_rate"] * 50)
        return {
            "total_tokens": input_tokens + output_tokens + audio_tokens,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens + audio_tokens,
            "output_token_details": {"text_tokens": output_tokens, "audio_tokens": audio_tokens},
        }

    def _response_body(self, running: _Response, status: str, **extra: Any) -> dict[str, Any]:
        return {
            "id": running.id,
            "object": "realtime.response",
            "status": status,
            "modalities": list(running.modalities),
            **extra,
        }

    def _done(self, running: _Response, status: str, *, reason: str | None = None, **extra: Any) -> None:
        if status == "completed":
            for sid in sorted(running.texts):
                kind = "response.audio_transcript.done" if running.spoken else "response.text.done"
                field_name = "transcript" if running.spoken else "text"
                self._emit(kind, **{field_name: running.texts[sid]}, **self._delta_ids(running))
            if running.audio_bytes:
                self._emit("response.audio.done", **self._delta_ids(running))
        details = {"type": status, "reason": reason} if reason is not None else None
        extra.setdefault("usage", self._usage(running, {}))
        body = self._response_body(running, status, status_details=details, **extra)
        self.response = None
        self._emit("response.done", response=body)

    @property
    def responding(self) -> bool:
        return self.response is not None
