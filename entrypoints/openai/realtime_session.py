"""One realtime session's state machine (``WS /v1/realtime``): pure, no I/O and no clock, so every
event order is tested in milliseconds; the WebSocket adapter (``realtime.py``) only moves bytes.

Runs on the server's event loop. The adapter calls it with what happens and carries out what it
asks:

- :meth:`RealtimeSession.receive` takes one client message (JSON text) and returns the effects to
  carry out (:class:`StartResponse`: run a request on the engine; :class:`Transcribe`: run a
  segment of the user's audio through the speech-recognition stage alone; :class:`AbortResponse`:
  abort a request at once);
- :meth:`~RealtimeSession.on_event` takes each engine event of a running response
  (``omni_runtime.events``), :meth:`~RealtimeSession.on_error` the error that ended one;
  :meth:`~RealtimeSession.on_transcript` / :meth:`~RealtimeSession.on_transcript_error` what a
  segment's transcription gave;
- every server event goes to :attr:`~RealtimeSession.outbox`, in the order it is sent.

A response that ends (done, cancelled by ``response.cancel`` or by new speech, failed) is over for
good the moment its ``response.done`` is queued: anything its request still delivers is dropped
here, so nothing of it follows its ``response.done``.

The user's audio is heard as it arrives (``input_audio_transcription``, on by default for a model
whose first stage recognises speech): a pause after speech (``segment_silence_ms``) or the model's
window ends a segment, which is transcribed at once while the user goes on talking; the commit
sends only the tail since the last cut. Each segment's text is a
``conversation.item.input_audio_transcription.delta`` (in segment order), the whole a
``...completed`` once the turn is committed and every segment heard; a response to the turn runs
its text (the instructions, then the transcript) once it is complete. With the setting ``null`` a
turn's audio goes whole with its response, which transcribes it first.

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
#: Segments a session has being transcribed at once; more wait in the session, in order. While
#: that many are cut, a pause cuts nothing (the next cut takes the audio with it); the model's
#: window and the commit always cut.
MAX_SEGMENTS_IN_FLIGHT = 4
#: The input transcription a session starts with (for a model that hears audio).
DEFAULT_TRANSCRIPTION: dict[str, Any] = {"model": None, "segment_silence_ms": 200}


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
    #: The stage that hears audio, and the most seconds it hears in one request (None: unknown).
    audio_input_stage: int | None = None
    audio_window_s: float | None = None

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
            return cls(
                name, "chat", text=True, audio=audio, audio_input=capabilities.audio_input,
                audio_input_stage=capabilities.audio_input_stage, audio_window_s=capabilities.max_input_audio_s,
            )  # fmt: skip
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
    #: The prompt holds all the turn says (its text, or its transcript heard already): the
    #: request may enter the pipeline after its recognition stage.
    heard: bool = False


@dataclass(frozen=True)
class Transcribe:
    """Run segment ``index`` of item ``item_id``'s audio (pcm16 at ``sample_rate``) as request
    ``request_id`` through stage ``stage`` alone; its text goes to
    :meth:`RealtimeSession.on_transcript`."""

    item_id: str
    index: int
    request_id: str
    stage: int
    audio: bytes
    sample_rate: int


@dataclass
class _Transcript:
    """An audio item's transcript, heard a segment at a time."""

    item_id: str
    #: Segment index -> its text, as they come back (in any order).
    texts: dict[int, str] = field(default_factory=dict)
    #: Segment index -> its request, while it is being transcribed.
    running: dict[int, str] = field(default_factory=dict)
    segments: int = 0  # cut so far
    said: int = 0  # deltas sent, in segment order
    committed: bool = False  # no more segments come
    failed: bool = False

    @property
    def complete(self) -> bool:
        return self.committed and not self.failed and self.said == self.segments

    @property
    def text(self) -> str:
        return " ".join(t for t in (self.texts[i].strip() for i in range(self.said)) if t)


@dataclass(frozen=True)
class _Item:
    """A user item of the conversation: text, committed audio (pcm16 at ``sample_rate``, when
    the input is not transcribed as it arrives), or the transcript of committed audio."""

    id: str
    text: str | None = None
    audio: bytes | None = None
    sample_rate: int = DEFAULT_SAMPLE_RATE
    transcript: _Transcript | None = None


@dataclass(frozen=True)
class AbortResponse:
    """Abort request ``request_id`` (its response is over); ``reason`` for the metrics."""

    request_id: str
    reason: str


Effect = StartResponse | AbortResponse | Transcribe


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
    #: The user item it answers.
    answers: str = ""
    #: Its request, until that item's transcript is complete (then it is started).
    waiting: StartResponse | None = None
    #: The instructions its prompt starts with (the transcript comes after them).
    instructions: str = ""

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
            "input_audio_transcription": dict(DEFAULT_TRANSCRIPTION) if model.audio_input else None,
        }
        #: Server events waiting to be sent, oldest first.
        self.outbox: deque[dict[str, Any]] = deque()
        self.buffer = bytearray()
        self.vad: EnergyVad | None = None
        #: The turn being heard (its audio transcribed as it arrives), until it is committed.
        self.turn: _Transcript | None = None
        self._cut = 0  # bytes of ``buffer`` already sent as segments
        self._voiced = False  # speech was heard since the last cut
        self._segmenter: EnergyVad | None = None
        self._queued: deque[Transcribe] = deque()  # segments cut, waiting for room
        self._hearing: set[str] = set()  # segments' requests out (at most MAX_SEGMENTS_IN_FLIGHT)
        #: The conversation's user items, oldest first.
        self.items: list[_Item] = []
        self.response: _Response | None = None
        self._resegment()
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
                return self._update(settings)
            case proto.AudioAppend(audio=audio):
                return self._append(audio)
            case proto.AudioCommit():
                return self._commit(event.event_id, by_vad=False)
            case proto.AudioClear():
                effects = self._drop_turn("input_audio_buffer_cleared")
                self.buffer.clear()
                if self.vad is not None:
                    self.vad.reset()
                self._emit("input_audio_buffer.cleared")
                return effects
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

    def _update(self, settings: proto.SessionSettings) -> list[Effect]:
        given = settings.model_fields_set
        if "modalities" in given and settings.modalities is not None:
            self._check_modalities(settings.modalities, "session.modalities")
        if settings.input_audio_transcription is not None and not self.model.audio_input:
            raise ApiError(
                400, f"{self.model.name} takes no audio input, so none is transcribed",
                param="session.input_audio_transcription", code="no_audio_input",
            )  # fmt: skip
        for name in given:
            value = getattr(settings, name)
            if name in ("turn_detection", "input_audio_transcription"):
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
        effects: list[Effect] = []
        if given & {"turn_detection", "input_sample_rate", "input_audio_transcription"}:
            # The turn being heard is heard again from its start, if at all, under the new settings.
            effects = self._drop_turn("session_updated")
            self._resegment()
        self._emit("session.updated", session=self._session())
        return effects

    def _resegment(self) -> None:
        """The segmenter for the session's settings: a pause of ``segment_silence_ms`` after
        speech (at the turn detector's threshold, or its default) ends a segment. None: the input
        is not transcribed as it arrives."""
        hearing = self.settings["input_audio_transcription"]
        self._segmenter = None
        if hearing is None or self.model.audio_input_stage is None:
            return
        detection = self.settings["turn_detection"]
        threshold = detection["threshold"] if detection is not None else proto.TurnDetection().threshold
        self._segmenter = EnergyVad(self.settings["input_sample_rate"], threshold, hearing["segment_silence_ms"])

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
        if len(self.buffer) + self._waiting_bytes() + len(pcm) > self.limits.max_buffer_bytes:
            raise ApiError(
                400, f"the input audio buffer holds at most {self.limits.max_buffer_bytes} bytes; "
                "commit or clear it", param="audio", code="input_audio_buffer_full",
            )  # fmt: skip
        self.buffer += pcm
        effects: list[Effect] = self._hear(pcm)
        if self.vad is None:
            return effects
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

    # ------------------------------------------------------------------ hearing the turn

    def _hear(self, pcm: bytes) -> list[Effect]:
        """The segments that ``pcm`` ends: at a pause after speech (while fewer than
        :data:`MAX_SEGMENTS_IN_FLIGHT` are being heard), and at the model's window."""
        if self._segmenter is None:
            return []
        if self.turn is None:
            self.turn = _Transcript(f"item_{uuid.uuid4().hex[:20]}")
        window = self._window_bytes()
        while window is not None and len(self.buffer) - self._cut >= window:
            self._segment(self._cut + window)
        changes = self._segmenter.feed(pcm)
        self._voiced = self._voiced or self._segmenter.speaking or bool(changes)
        paused = any(isinstance(change, SpeechStopped) for change in changes)
        busy = len(self._hearing) + len(self._queued) >= MAX_SEGMENTS_IN_FLIGHT
        if paused and not busy and len(self.buffer) > self._cut:
            self._segment(len(self.buffer))
        return self._release()

    def _release(self) -> list[Effect]:
        """The segments waiting, oldest first, while fewer than :data:`MAX_SEGMENTS_IN_FLIGHT` are out."""
        effects: list[Effect] = []
        while self._queued and len(self._hearing) < MAX_SEGMENTS_IN_FLIGHT:
            segment = self._queued.popleft()
            self._hearing.add(segment.request_id)
            effects.append(segment)
        return effects

    def _waiting_bytes(self) -> int:
        """Audio of committed turns that waits in the session to be heard (the open turn's is in
        the buffer still): it counts against the buffer's bound."""
        open_id = self.turn.item_id if self.turn is not None else None
        return sum(len(s.audio) for s in self._queued if s.item_id != open_id)

    def _unhear(self, transcript: _Transcript, reason: str) -> list[Effect]:
        """Stop hearing ``transcript``'s segments: those waiting are dropped, those out aborted."""
        self._queued = deque(s for s in self._queued if s.item_id != transcript.item_id)
        out = [rid for rid in transcript.running.values() if rid in self._hearing]
        self._hearing.difference_update(out)
        transcript.running.clear()
        return [AbortResponse(rid, reason) for rid in out]

    def _window_bytes(self) -> int | None:
        window = self.model.audio_window_s
        return None if window is None else 2 * max(1, int(window * self.settings["input_sample_rate"]))

    def _segment(self, end: int) -> None:
        """The open turn's audio from the last cut to ``end``, queued to be transcribed."""
        turn = self.turn
        assert turn is not None and self.model.audio_input_stage is not None
        audio = bytes(self.buffer[self._cut : end])
        self._cut, self._voiced = end, False
        index = turn.segments
        turn.segments += 1
        request_id = f"realtime-asr-{uuid.uuid4().hex}"
        turn.running[index] = request_id
        rate = self.settings["input_sample_rate"]
        self._queued.append(Transcribe(turn.item_id, index, request_id, self.model.audio_input_stage, audio, rate))

    def _drop_turn(self, reason: str) -> list[Effect]:
        """Forget the open turn (its buffer is cleared): its segments still being heard are
        aborted, and those of other turns waiting take their place."""
        turn, self.turn, self._cut, self._voiced = self.turn, None, 0, False
        if self._segmenter is not None:
            self._segmenter.reset()
        if turn is None:
            return []
        return self._unhear(turn, reason) + self._release()

    def _commit(self, event_id: str | None, *, by_vad: bool) -> list[Effect]:
        if not self.buffer:
            raise ApiError(400, "the input audio buffer is empty", code="input_audio_buffer_commit_empty")
        previous = self.items[-1].id if self.items else None
        effects: list[Effect] = []
        if self._segmenter is not None:
            if self.turn is None:  # hearing was turned on after this audio came: all of it now
                self.turn = _Transcript(f"item_{uuid.uuid4().hex[:20]}")
            # The tail since the last cut, unless it is silence after a pause that was cut.
            if len(self.buffer) > self._cut and (self._voiced or not self.turn.segments):
                self._segment(len(self.buffer))
            effects += self._release()
            turn, self.turn, self._cut, self._voiced = self.turn, None, 0, False
            self._segmenter.reset()
            turn.committed = True
            item = _Item(turn.item_id, transcript=turn)
        else:
            rate = self.settings["input_sample_rate"]
            item = _Item(f"item_{uuid.uuid4().hex[:20]}", audio=bytes(self.buffer), sample_rate=rate)
        self._add_item(item)
        self.buffer.clear()
        if self.vad is not None:
            self.vad.reset()
        self._emit("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id)
        if item.transcript is not None:
            self._said(item.transcript)  # every segment may be heard already
        detection = self.settings["turn_detection"]
        if by_vad and detection is not None and detection["create_response"]:
            try:
                effects += self._create(None, event_id)
            except ApiError as e:
                self.error(e, event_id)
        return effects

    def on_transcript(self, item_id: str, index: int, text: str) -> list[Effect]:
        """Segment ``index`` of item ``item_id`` was heard as ``text``: its delta (once every
        earlier segment's is sent), then, once the turn is complete, ``...completed`` and the
        response waiting for it."""
        transcript = self._transcript(item_id)
        request_id = transcript.running.pop(index, None) if transcript is not None else None
        if transcript is None or request_id is None:
            return []  # the turn was cleared, or failed meanwhile
        self._hearing.discard(request_id)
        effects = self._release()
        transcript.texts[index] = text
        self._said(transcript)
        running = self.response
        if not transcript.complete or running is None or running.waiting is None or running.answers != item_id:
            return effects
        start = replace(running.waiting, prompt=self._prompt(running.instructions, transcript.text))
        running.waiting, running.prompt = None, start.prompt
        return [start, *effects]

    def on_transcript_error(self, item_id: str, index: int, exc: BaseException) -> list[Effect]:
        """Segment ``index`` of item ``item_id`` could not be heard: ``...failed`` for the item,
        its other segments aborted, and a response waiting for it fails; the session goes on."""
        transcript = self._transcript(item_id)
        request_id = transcript.running.pop(index, None) if transcript is not None else None
        if transcript is None or request_id is None:
            return []
        self._hearing.discard(request_id)
        transcript.failed = True
        _, body = error_body(exc)
        self._emit(
            "conversation.item.input_audio_transcription.failed", item_id=item_id, content_index=0, error=body["error"]
        )
        effects = self._unhear(transcript, "transcription_failed") + self._release()
        running = self.response
        if running is not None and running.waiting is not None and running.answers == item_id:
            self.on_error(running.id, exc)
        return effects

    def _transcript(self, item_id: str) -> _Transcript | None:
        if self.turn is not None and self.turn.item_id == item_id:
            return self.turn
        item = next((i for i in reversed(self.items) if i.id == item_id), None)
        return item.transcript if item is not None else None

    def _said(self, transcript: _Transcript) -> None:
        """The deltas of the segments heard, in order; ``...completed`` once the turn is."""
        while transcript.said in transcript.texts:
            text = transcript.texts[transcript.said]
            transcript.said += 1
            self._emit(
                "conversation.item.input_audio_transcription.delta",
                item_id=transcript.item_id, content_index=0, delta=text,
            )  # fmt: skip
        if transcript.complete:
            self._emit(
                "conversation.item.input_audio_transcription.completed",
                item_id=transcript.item_id, content_index=0, transcript=transcript.text,
            )  # fmt: skip

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
        if item.transcript is not None and item.transcript.failed:
            raise ApiError(
                400, f"item `{item.id}`'s audio could not be transcribed; send the turn again",
                code="input_audio_transcription_failed",
            )  # fmt: skip
        instructions = self.settings["instructions"]
        if settings is not None and settings.instructions is not None:
            instructions = settings.instructions
        heard = item.transcript
        prompt = self._prompt(instructions, heard.text if heard is not None else item.text or "")
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
            answers=item.id,
            instructions=instructions,
        )
        self.response = response
        self._emit("response.created", response=self._response_body(response, "in_progress"))
        rate = item.sample_rate if item.audio is not None else None
        start = StartResponse(
            response.id, response.request_id, prompt, voice, response.modalities, max_tokens, item.audio, rate,
            heard=item.audio is None,
        )  # fmt: skip
        if heard is not None and not heard.complete:
            response.waiting = start  # started once every segment is heard (on_transcript)
            return []
        return [start]

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
        effects += [AbortResponse(rid, "client_disconnect") for rid in sorted(self._hearing)]
        self._hearing.clear()
        self._queued.clear()
        self.turn = None
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
