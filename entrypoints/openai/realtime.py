"""``WS /v1/realtime?model=...``: a realtime session over a WebSocket, with OpenAI Realtime's event
names. Runs on the server's event loop; what the session does is :class:`RealtimeSession`'s (pure,
``realtime_session.py``), and this adapter only moves messages and runs its responses.

Per connection, four kinds of task: the reader (this handler: client messages into the session),
one writer (the session's outbox onto the socket, in order), at most one response (an engine
request read as typed events into the session) and the segments of the user's audio being heard
(each a request to the speech-recognition stage alone, ``stages=[...]``). A response that the session ends (cancel, new
speech, the client gone) is aborted on the engine at once, and its task cancelled.

Bounds: ``--realtime-sessions`` sessions at once (one more: an ``error`` event and close code
4503 before anything starts), messages of at most ``max_message_bytes`` (a larger one: an
``error`` event, dropped), the idle timeout (no client message while no response runs: an
``error`` event ``idle_timeout`` and close code 4408), the input buffer's bytes (the session's).
The API key is checked before the socket is accepted, as on every route (close code 4401): an
``Authorization`` header, or from a browser the subprotocol ``openai-insecure-api-key.<key>``
beside ``realtime``, which the socket is accepted with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from omni_runtime.events import Final
from omni_runtime.exceptions import InvalidRequestError, OmniError

from ..tasks import TASKS
from .body import BodyRoute
from .dependencies import AUTH, RealtimeModel, State, websocket_subprotocol
from .jobs import refuse_websocket
from .protocol import ApiError
from .realtime_session import AbortResponse, Effect, RealtimeSession, SessionModel, StartResponse, Transcribe
from .state import ModelHandle, ServerState

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", dependencies=[AUTH], route_class=BodyRoute)

#: Close codes: the session idled out; the server is full (4000 + the HTTP status, as refusals).
IDLE_CLOSE, FULL_CLOSE = 4408, 4503


@router.websocket("/realtime")
async def realtime(websocket: WebSocket, state: State, model: RealtimeModel) -> None:
    limits = state.realtime
    if state.realtime_sessions >= limits.max_sessions:
        full = ApiError(
            503, f"this server holds {limits.max_sessions} realtime sessions already; retry later",
            type="service_unavailable", code="too_many_sessions",
        )  # fmt: skip
        await refuse_websocket(websocket, full)
        return
    state.realtime_sessions += 1
    try:
        await websocket.accept(subprotocol=websocket_subprotocol(websocket))
        session = RealtimeSession(SessionModel.of(model.name, model.capabilities), limits)
        await _Connection(websocket, state, model, session).run()
    finally:
        state.realtime_sessions -= 1


class _Connection:
    """One accepted socket and its session (see the module docstring)."""

    def __init__(self, websocket: WebSocket, state: ServerState, model: ModelHandle, session: RealtimeSession) -> None:
        self.websocket, self.state, self.model, self.session = websocket, state, model, session
        self.task = TASKS[session.model.task]
        self.fields = self.task.fields["realtime"]
        self.wake = asyncio.Event()
        self.running: dict[str, asyncio.Task[None]] = {}  # response id -> its task
        self.hearing: dict[str, asyncio.Task[None]] = {}  # a segment's request id -> its task
        self.closed = False

    async def run(self) -> None:
        writer = asyncio.create_task(self._write())
        self.wake.set()  # session.created
        close_code = 1000
        try:
            close_code = await self._read()
        except (WebSocketDisconnect, RuntimeError):
            close_code = 0  # gone: nothing more is sent
        finally:
            self.closed = True
            gone = close_code == 0
            if gone:
                self._apply(self.session.close())
            else:
                self._apply(self.session.cancel("client_disconnect"))
            tasks = [*self.running.values(), *self.hearing.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not gone:  # the last events (an idle timeout's error), then the close
                await self._flush()
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
            if not gone:
                with contextlib.suppress(Exception):
                    await self.websocket.close(code=close_code)

    async def _read(self) -> int:
        """Client messages into the session until the client goes (0) or idles out (the close
        code)."""
        limits = self.session.limits
        while True:
            try:
                message = await asyncio.wait_for(self.websocket.receive(), limits.idle_timeout_s)
            except TimeoutError:
                if self.session.responding:
                    continue
                self._refuse(ApiError(408, f"no event for {limits.idle_timeout_s:g} s", code="idle_timeout"))
                return IDLE_CLOSE
            if message["type"] == "websocket.disconnect":
                return 0
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            if len(data) > limits.max_message_bytes:
                too_large = f"a message may hold at most {limits.max_message_bytes} bytes"
                self._refuse(ApiError(413, too_large, code="message_too_large"))
                continue
            try:
                effects = self.session.receive(data)
            except Exception as e:  # a bug: said as a server_error (and logged), the session goes on
                self.session.error(e)
                effects = []
            self._apply(effects)

    def _refuse(self, error: ApiError) -> None:
        self.session.error(error)
        self.wake.set()

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            match effect:
                case StartResponse():
                    self.running[effect.response_id] = asyncio.create_task(self._respond(effect))
                case Transcribe():
                    self.hearing[effect.request_id] = asyncio.create_task(self._hear(effect))
                case AbortResponse(request_id=rid, reason=reason):
                    if rid in self.state.inflight:
                        self.state.count_aborted(reason, [rid])
                    self.model.engine.abort(rid)  # at once, in every stage
                    hearing = self.hearing.pop(rid, None)
                    if hearing is not None:
                        hearing.cancel()
        for response_id, task in list(self.running.items()):
            if not self.session.running(response_id) and not task.done():
                task.cancel()
        self.wake.set()

    async def _respond(self, start: StartResponse) -> None:
        """Run one response's request, its events into the session."""
        omni, rid = self.model.engine, start.request_id
        stream = None
        try:
            try:
                modalities = None if "audio" in start.modalities else ["text"]
                params = self.task.sampling_params(omni, self.fields.params(start))
                try:
                    valid = omni.validate(start.prompt, params, modalities=modalities, entry_stages=self._entry(start))
                except InvalidRequestError as e:
                    if e.param != "entry_stages":
                        raise
                    # A pipeline whose later stages also need the recognition stage's output.
                    valid = omni.validate(start.prompt, params, modalities=modalities)
            except InvalidRequestError as e:
                raise self.fields.rename(e) from None
            self.state.inflight[rid] = self.model.name
            stream = omni.events(valid, request_id=rid)
            async for event in stream:
                if isinstance(event, Final):
                    self.state.metrics.observe_output(event.output, self.model.name)
                self.session.on_event(start.response_id, event)
                self.wake.set()
        except (OmniError, ApiError) as e:
            self.session.on_error(start.response_id, e)
        except asyncio.CancelledError:
            pass  # ended by the session (it said so), or the connection closing
        except Exception as e:  # a bug: the session goes on, the error is logged and said
            logger.exception("realtime response %s failed", start.response_id)
            self.session.on_error(start.response_id, e)
        finally:
            self.state.inflight.pop(rid, None)
            if stream is not None:
                await stream.aclose()  # aborts the request if it is still running
            self.running.pop(start.response_id, None)
            self.wake.set()

    def _entry(self, start: StartResponse) -> list[int] | None:
        """Where a turn with nothing left to hear (text, or a transcript heard already) enters the
        pipeline: the stages its recognition stage feeds (it would only pass the text on, behind
        the other turns' audio there). None: at the sources."""
        hears = self.session.model.audio_input_stage
        if not start.heard or hears is None:
            return None
        fed = [s.stage_id for s in self.model.engine.config.stage_args if hears in s.engine_input_source]
        return fed or None

    async def _hear(self, segment: Transcribe) -> None:
        """Transcribe one segment of the user's audio (the speech-recognition stage alone); its
        text, or the error, into the session."""
        omni, rid = self.model.engine, segment.request_id
        effects: list[Effect] = []
        try:
            samples = np.frombuffer(segment.audio, "<i2")
            params = omni.sampling_params(shared={"audio": samples, "sample_rate": segment.sample_rate})
            valid = omni.validate("", params, stages=[segment.stage])
            self.state.inflight[rid] = self.model.name
            text = ""
            async for out in omni.generate(valid, request_id=rid):
                if out.finished:
                    text = out.outputs_by_stage[segment.stage].text or ""
            effects = self.session.on_transcript(segment.item_id, segment.index, text)
        except asyncio.CancelledError:
            pass  # the turn was cleared, or the connection is closing
        except Exception as e:  # an engine error, a refusal, or a bug: said, and the session goes on
            if not isinstance(e, OmniError | ApiError):
                logger.exception("realtime transcription %s failed", rid)
            effects = self.session.on_transcript_error(segment.item_id, segment.index, e)
        finally:
            self.state.inflight.pop(rid, None)
            self.hearing.pop(rid, None)
        if not self.closed:
            self._apply(effects)

    async def _write(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await self._flush()

    async def _flush(self) -> None:
        outbox = self.session.outbox
        while outbox:
            await self.websocket.send_text(json.dumps(outbox.popleft(), separators=(",", ":")))
