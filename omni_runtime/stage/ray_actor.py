"""A stage replica hosted by a Ray actor: the ``ray`` backend's twin of :mod:`.process`.

The actor runs the same :class:`~omni_runtime.stage.replica_host.ReplicaHost` (start-up, lost
inputs, the worker with its scheduler and runner) on the actor's event loop; this module is the
transport. Messages are msgspec bytes both ways, nothing of ours is
pickled: the orchestrator calls :meth:`StageActor.handle` with a message's frames and the Ray
object refs its arrays were stored under, and reads everything the worker says from one
long-lived streaming generator, :meth:`StageActor.outputs`, item by item as ``(frames, refs)``.
Arrays of at least ``remote_min_bytes`` that the worker sends are put in Ray's object store here,
so an output handed to the next stage's actor goes actor to actor, never through the orchestrator.

Messages are handled strictly in the order they were sent (an abort never overtakes the request
it aborts): :meth:`handle` only queues them, and one task takes them in turn, fetching their
arrays first. A replica that hears nothing from the orchestrator (not even a ping) for
``orphan_timeout_s`` exits by itself: its node lost touch, and its memory must not stay held.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import msgspec

from omni_runtime.config import StageConfig
from omni_runtime.messages import StageStartupFailed
from omni_runtime.serialization import Encoder, inbound_decoder
from omni_runtime.stage.replica_host import ReplicaHost

logger = logging.getLogger("omni_runtime.stage")


class StageActor:
    """Wrapped with ``ray.remote`` by the backend (so this module does not need Ray to import)."""

    def __init__(
        self, stage: dict[str, Any], replica_id: int, *, orphan_timeout_s: float, remote_min_bytes: int
    ) -> None:
        self._stage_data = stage
        self._replica_id = replica_id
        self._orphan_timeout_s = orphan_timeout_s
        self._remote_min_bytes = remote_min_bytes
        self._inbox: asyncio.Queue | None = None
        self._outbox: asyncio.Queue | None = None
        self._host: Any = None
        self._heard_at = time.monotonic()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> tuple[list[bytes], list[Any]]:
        """Load the model and start serving; returns the encoded READY (or StageStartupFailed)."""
        self._inbox, self._outbox = asyncio.Queue(), asyncio.Queue()
        stage = msgspec.convert(self._stage_data, StageConfig)
        self._host = ReplicaHost(stage, self._replica_id, self._outbox.put_nowait, self._on_fatal)
        ready = await self._host.start()
        if isinstance(ready, StageStartupFailed):
            return self._encode(ready)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._take_inbox()))
        if self._orphan_timeout_s > 0:
            self._tasks.append(loop.create_task(self._watch_orphan()))
        return self._encode(ready)

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def handle(self, frames: list[bytes], refs: list[Any]) -> None:
        """Queue one message from the orchestrator (handled in the order they come)."""
        self._heard_at = time.monotonic()
        assert self._inbox is not None  # made by start, which the backend awaits first
        self._inbox.put_nowait((frames, refs))

    async def outputs(self):
        """Everything the worker says, as ``(frames, refs)``, for as long as the actor lives."""
        assert self._outbox is not None  # made by start
        while True:
            msg = await self._outbox.get()
            try:
                yield self._encode(msg)
            except Exception as e:  # the worker's own fallback made every answer encodable
                logger.error("dropped an unencodable %s: %s", type(msg).__name__, e)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._host is not None:
            await self._host.close()

    # ------------------------------------------------------------------ internals

    def _encode(self, msg: Any) -> tuple[list[bytes], list[Any]]:
        import ray

        encoder = Encoder(remote_put=ray.put, remote_min_bytes=self._remote_min_bytes)
        frames = encoder.encode(msg)
        return [bytes(f) for f in frames], list(encoder.remote)

    async def _take_inbox(self) -> None:
        decoder = inbound_decoder(params_cls=self._host.params_cls)
        assert self._inbox is not None  # made by start, before this task
        while True:
            frames, refs = await self._inbox.get()
            try:
                values = list(await asyncio.gather(*refs)) if refs else None
                msg = decoder.decode(frames, refs, values)
            except msgspec.DecodeError as e:
                self._host.malformed(e)
                continue
            except Exception as e:  # an input's object is gone (its producer died)
                self._host.input_lost(self._without_arrays(frames, refs), e)
                continue
            self._host.handle(msg)

    @staticmethod
    def _without_arrays(frames: list[bytes], refs: list[Any]) -> Any:
        """The message with its arrays left as handles (nothing to fetch), or None."""
        try:
            return inbound_decoder().decode(frames, refs)
        except Exception:
            return None

    async def _watch_orphan(self) -> None:
        while True:
            await asyncio.sleep(self._orphan_timeout_s / 4)
            silent = time.monotonic() - self._heard_at
            if silent > self._orphan_timeout_s:
                logger.critical("nothing heard from the engine for %.0f s: exiting", silent)
                os._exit(75)  # EX_TEMPFAIL: the node lost touch; nobody waits for this replica

    def _on_fatal(self, exc: BaseException) -> None:
        # A worker whose scheduling loop died would take requests and never answer: exit, so the
        # engine sees the actor die and restarts it, as with a process replica.
        logger.critical("the scheduling loop died: %r", exc)
        os._exit(70)
