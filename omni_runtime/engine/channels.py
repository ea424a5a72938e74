"""The engine's answers in the callers' event loops: an output channel per loop, and the requests and
control calls waiting on each.

One engine serves any number of event loops, one after another or at once (threads, a server and
a script): each loop that uses it gets a *channel*, a janus output queue of its own drained by a
dispatcher task on that loop, and every request and control call names the channel its answer
goes to. :class:`Channels` keeps the shared bookkeeping (which requests are pending, which control
calls wait, on which loop), guarded by the engine's lock, and ends what waits with an error on its
own loop.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

import janus

from omni_runtime.engine.orchestrator import Orchestrator
from omni_runtime.messages import EngineAbort, EngineDead, EngineOutput, EngineRpcResult, ErrorInfo


class Channel:
    """The outputs for what one event loop asked: a janus queue and the task that drains it."""

    __slots__ = ("dispatcher", "id", "loop", "queue")

    def __init__(self, channel_id: int, loop: asyncio.AbstractEventLoop) -> None:
        self.id = channel_id
        self.loop = loop
        self.queue: janus.Queue = janus.Queue()
        self.dispatcher: asyncio.Task | None = None


class PendingRequest:
    """One admitted request: its outputs arrive on ``stream`` (an asyncio.Queue of EngineOutput)
    on the loop that admitted it; the last one has ``finished=True``."""

    __slots__ = ("channel", "open_input", "request_id", "stream", "timer", "wire_id")

    def __init__(self, request_id: str, wire_id: str, channel: Channel, open_input: bool = False) -> None:
        self.request_id = request_id
        #: Opened with ``streaming_input`` and its final update not sent yet.
        self.open_input = open_input
        #: Its id inside the engine, unique per admission (see ``Channels.pending``).
        self.wire_id = wire_id
        self.channel = channel
        self.stream: asyncio.Queue = asyncio.Queue()
        self.timer: asyncio.TimerHandle | None = None


class Channels:
    """The channels of one engine's orchestrator, and what waits on them."""

    def __init__(self, orchestrator: Orchestrator, lock: threading.Lock) -> None:
        self._orchestrator = orchestrator
        #: The engine's lock: it guards everything here (and the engine's own state).
        self.lock = lock
        #: Caller's request id -> its pending request. Inside the engine each admission has an id
        #: of its own, so a caller may reuse an id once its request ended (aborted, timed out) and
        #: a late output of the old one neither reaches the new one nor collides in a stage's queue.
        self.pending: dict[str, PendingRequest] = {}
        #: Control call id -> the channel its answer comes on and the future it settles.
        self.rpcs: dict[int, tuple[Channel, asyncio.Future]] = {}
        self._by_loop: dict[asyncio.AbstractEventLoop, Channel] = {}
        self._ids = itertools.count(1)

    def current(self) -> Channel:
        """This loop's channel, made on first use (and channels of closed loops dropped)."""
        loop = asyncio.get_running_loop()
        channel = self._by_loop.get(loop)
        if channel is not None:
            if channel.dispatcher is None or channel.dispatcher.done():
                # Cancelled under us (asyncio.run cancels every task it leaves): drain again.
                channel.dispatcher = loop.create_task(self._dispatch(channel), name=f"omni-dispatch-{channel.id}")
            return channel
        with self.lock:
            channel = self._by_loop.get(loop)
            if channel is not None:
                return channel
            gone = [c for c in self._by_loop.values() if c.loop.is_closed()]
            for c in gone:
                del self._by_loop[c.loop]
                self._orchestrator.channels.pop(c.id, None)
            orphans = [p for p in self.pending.values() if p.channel in gone]
            for p in orphans:
                del self.pending[p.request_id]
            channel = Channel(next(self._ids), loop)
            self._by_loop[loop] = channel
            self._orchestrator.channels[channel.id] = channel.queue
        if orphans:
            # Nobody can read their answers any more (their loop is closed): stop the work.
            try:
                self._orchestrator.request_queue.sync_q.put_nowait(
                    EngineAbort(request_ids=[p.wire_id for p in orphans])
                )
            except (janus.SyncQueueFull, janus.SyncQueueShutDown):
                pass
        channel.dispatcher = loop.create_task(self._dispatch(channel), name=f"omni-dispatch-{channel.id}")
        return channel

    def open_channels(self) -> list[Channel]:
        """Every channel (the caller holds ``lock``)."""
        return list(self._by_loop.values())

    async def _dispatch(self, channel: Channel) -> None:
        queue = channel.queue.async_q
        while True:
            try:
                msg = await queue.get()
            except janus.AsyncQueueShutDown:
                return
            if isinstance(msg, EngineOutput):
                rid = msg.request_id.rpartition("#")[0]
                with self.lock:
                    pending = self.pending.get(rid)
                    if pending is None or pending.wire_id != msg.request_id:
                        continue  # aborted by the caller meanwhile (and its id perhaps reused since)
                    if msg.finished:
                        del self.pending[rid]
                if msg.finished and pending.timer is not None:
                    pending.timer.cancel()
                pending.stream.put_nowait(msg)
            elif isinstance(msg, EngineRpcResult):
                with self.lock:
                    entry = self.rpcs.get(msg.call_id)
                if entry is not None and not entry[1].done():
                    if msg.error is not None:
                        entry[1].set_exception(msg.error.to_exception())
                    else:
                        entry[1].set_result(msg.results)
            elif isinstance(msg, EngineDead):
                self.fail_everything(msg.error.to_exception(), channel)

    def end(self, pending: PendingRequest, error: ErrorInfo) -> None:
        """Give a request (no longer in ``pending``) its last output, on its own loop."""
        msg = EngineOutput(request_id=pending.request_id, stage_id=-1, finished=True, error=error)
        on_loop(pending.channel.loop, _end_stream, pending, msg)

    def fail_everything(self, error: BaseException, channel: Channel | None = None) -> None:
        """End every pending request and control call (of ``channel`` only, if given)."""
        with self.lock:
            pending = [p for p in self.pending.values() if channel is None or p.channel is channel]
            ended = [(c, call_id) for call_id, c in self.rpcs.items() if channel is None or c[0] is channel]
            for p in pending:
                del self.pending[p.request_id]
            for _, call_id in ended:
                del self.rpcs[call_id]
        info = ErrorInfo.from_exception(error)
        for p in pending:
            self.end(p, info)
        for (rpc_channel, fut), _ in ended:
            on_loop(rpc_channel.loop, _fail_future, fut, info)

    def close(self) -> None:
        """Forget every channel and stop its dispatcher, on its own loop."""
        with self.lock:
            channels = list(self._by_loop.values())
            self._by_loop.clear()
        for channel in channels:
            if channel.dispatcher is not None:
                on_loop(channel.loop, channel.dispatcher.cancel)


def on_loop(loop: asyncio.AbstractEventLoop, func: Callable[..., Any], *args: Any) -> None:
    """Run ``func(*args)`` on ``loop``: now if that is the running loop, else soon from any thread."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        func(*args)
    elif not loop.is_closed():
        try:
            loop.call_soon_threadsafe(func, *args)
        except RuntimeError:
            pass  # closed meanwhile: nobody waits there any more


def _end_stream(pending: PendingRequest, msg: EngineOutput) -> None:
    if pending.timer is not None:
        pending.timer.cancel()
    pending.stream.put_nowait(msg)


def _fail_future(fut: asyncio.Future, error: ErrorInfo) -> None:
    if not fut.done():
        fut.set_exception(error.to_exception())
