"""Read deadlines for HTTP connections: uvicorn's h11 protocol, plus a clock on slow clients.

uvicorn times out idle keep-alive connections between requests, but not a client that sends its
request slowly: a connection that trickles header bytes (or never sends any), or starts a body
and stalls, would hold a socket and a task forever. Here a request's headers must arrive within
``header_timeout_s`` of the connection (or of the previous response), and its body within
``body_timeout_s`` of its headers; otherwise the connection is closed (a 408 when nothing has been
answered yet). Once a request is complete, how long the answer takes is the app's business. A
request that upgrades to a WebSocket hands the socket to the WebSocket protocol: no deadline
here applies to it afterwards (a realtime session has its own idle timeout).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = (
    b'{"error":{"message":"the request was not received in time","type":"invalid_request_error",'
    b'"param":null,"code":"request_timeout"}}'
)


class TimedH11Protocol(H11Protocol):
    """``H11Protocol`` with read deadlines (class attributes, see :func:`timed_protocol`)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "headers" | "body" while a deadline runs
        self._upgraded = False
        super().connection_made(transport)
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # The upgrade request's headers are all there is: h11 still waits for a body that never
        # comes, and this protocol sees none of the socket's frames any more, so a deadline armed
        # now would close a live session.
        self._upgraded = True
        self._disarm()
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # idle until the next request: uvicorn's keep-alive timeout applies

    def _follow(self) -> None:
        """Run the deadline that fits what the client still owes us."""
        if self._upgraded:
            return
        theirs = self.conn.their_state
        if theirs is h11.SEND_BODY:
            if self._reading != "body":
                self._arm("body")
        elif theirs is h11.IDLE:
            if self.conn.trailing_data[0] and self._reading != "headers":
                self._arm("headers")  # a new request has begun arriving
        else:
            self._disarm()  # the request is complete (or the connection is ending)

    def _arm(self, what: str) -> None:
        self._disarm()
        seconds = self.header_timeout_s if what == "headers" else self.body_timeout_s
        self._reading = what
        self._read_timer = self.loop.call_later(seconds, self._timed_out, what)

    def _disarm(self) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
        self._read_timer, self._reading = None, None

    def _timed_out(self, what: str) -> None:
        self._read_timer, self._reading = None, None
        if self.transport.is_closing():
            return
        self.logger.info("closing a connection that did not send its request %s in time", what)
        if self.cycle is not None and not self.cycle.response_complete:
            # The app is reading the body: it sees a disconnect (and aborts what it started).
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        elif self.conn.our_state is h11.IDLE and self.conn.their_state is not h11.ERROR:
            self._send_408()
        self.transport.close()

    def _send_408(self) -> None:
        body = _TIMEOUT_BODY
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            data = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
            data += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
            self.transport.write(data)
        except h11.LocalProtocolError:
            pass  # the connection is in no state to answer: just close it


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type[Any]:
    """A ``TimedH11Protocol`` class with these deadlines, for ``uvicorn.Config(http=...)``."""
    return type(
        "TimedH11Protocol",
        (TimedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )
