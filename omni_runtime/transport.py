"""Reading ZMQ sockets from an asyncio loop without a future per message.

``zmq.asyncio`` makes a future and a poll registration for every ``recv``; at thousands of small
messages a second that bookkeeping costs more than the message. :class:`SocketReader` registers
the socket's file descriptor with ``loop.add_reader`` once and, when it fires, drains every
message that is ready with non-blocking receives. The descriptor is edge-triggered (it signals
when the socket *becomes* readable), so a drain must run until ``zmq.Again``: a burst larger than
``budget`` is finished on the next loop turn, so one busy socket cannot starve the loop.
Sends are the sender's business: a PUSH socket with an unbounded high-water mark queues without
blocking while it has a peer, and senders pass ``NOBLOCK`` so that having none is an error, not a wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

logger = logging.getLogger(__name__)


class SocketReader:
    """Calls ``on_frames(frames)`` on the loop for every multipart message ``sock`` receives."""

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list[Any]], None], *, budget: int = 256) -> None:
        self._sock = sock
        self._on_frames = on_frames
        self._budget = budget
        self._loop = asyncio.get_running_loop()
        fd = sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)  # an int option (bytes only for string options)
        self._fd = fd
        self._closed = False
        self._loop.add_reader(self._fd, self._drain)
        # Messages may already be queued: the edge that announced them came before we listened.
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        if self._closed:
            return
        for _ in range(self._budget):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:  # the socket was closed under us
                if not self._closed:
                    logger.warning("socket reader stopped: %s", e)
                return
            try:
                self._on_frames(frames)
            except Exception:  # one bad message must not leave the socket unheard
                logger.exception("failed to handle a message")
        self._loop.call_soon(self._drain)  # more may be waiting: go on after other work

    def drain(self) -> None:
        """Handle what is queued now (e.g. a last message from a process that just exited)."""
        self._drain()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)
