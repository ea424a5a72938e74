"""The shared event-stream reader of a Redis gateway. Runs one task on the server's event loop.

Every client that waits for a job's next event (an SSE stream, a WebSocket, a synchronous
``/v1/generate``, a ``DELETE`` waiting for the end) registers a waiter here: a future and the last
event id it has. One task runs a single ``XREAD BLOCK`` over all the streams waited on, on one
connection of its own, and resolves each waiter with the events after its id. So the gateway's
blocking reads hold one Redis connection however many clients wait, and the connections that
write job state never wait behind them.

A waiter that registers while an ``XREAD`` blocks is included in the next one (at most
``block_ms`` later); it misses nothing, since the next read starts from its own id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .store import JobStoreUnavailableError

logger = logging.getLogger(__name__)

Entries = list[tuple[str, dict[str, str]]]


def stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class _Waiter:
    __slots__ = ("after", "future")

    def __init__(self, after: tuple[int, int], future: asyncio.Future[Entries]) -> None:
        self.after, self.future = after, future


class StreamReader:
    """One ``XREAD BLOCK`` for every stream waited on (``redis``: a client of its own, one
    connection, read timeout longer than ``block_ms``)."""

    def __init__(self, redis: Any, *, block_ms: int = 200) -> None:
        self.redis, self.block_ms = redis, block_ms
        self._waiters: dict[str, list[_Waiter]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    async def wait(self, key: str, after: str, timeout: float) -> Entries:
        """Entries of stream ``key`` after id ``after``, once there are some; [] after ``timeout``."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="job-stream-reader")
        waiter = _Waiter(stream_id(after), asyncio.get_running_loop().create_future())
        self._waiters.setdefault(key, []).append(waiter)
        self._wake.set()
        try:
            return await asyncio.wait_for(waiter.future, timeout)
        except TimeoutError:
            return []
        finally:
            waiters = self._waiters.get(key)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[key]

    async def _run(self) -> None:
        """1) sleep while nobody waits  2) XREAD from each stream's oldest waited id  3) wake waiters."""
        while True:
            if not self._waiters:
                self._wake.clear()
                await self._wake.wait()
                continue
            streams = {key: "{}-{}".format(*min(w.after for w in ws)) for key, ws in self._waiters.items()}
            try:
                got = await self.redis.xread(streams, block=self.block_ms)
            except asyncio.CancelledError:
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                # Waiters get the error (an SSE stream ends with an error event, and the client
                # resumes from its last id); new waiters retry.
                self._fail(JobStoreUnavailableError(f"the job store (redis) cannot be reached: {e}"))
                await asyncio.sleep(self.block_ms / 1000.0)
                continue
            except Exception as e:
                logger.exception("job stream reader")
                self._fail(e)
                await asyncio.sleep(self.block_ms / 1000.0)
                continue
            for key, entries in got or []:
                self._dispatch(key, entries)

    def _dispatch(self, key: str, entries: Entries) -> None:
        # Each waiter gets the entries after its own id; the one with the oldest id always gets
        # some, so the next read starts later and nothing is read twice in a loop.
        for waiter in list(self._waiters.get(key, [])):
            mine = [e for e in entries if stream_id(e[0]) > waiter.after]
            if mine and not waiter.future.done():
                waiter.future.set_result(mine)
                self._waiters[key].remove(waiter)
        if not self._waiters.get(key, True):
            del self._waiters[key]

    def _fail(self, error: BaseException) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.future.done():
                    waiter.future.set_exception(error)
        self._waiters.clear()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._fail(JobStoreUnavailableError("the job store is closed"))
