"""A stage replica hosted by a Ray actor: the ``ray`` backend's twin of :mod:`.process`.

The actor runs the same :class:`~omni_runtime.stage.worker.StageWorker` (same scheduler, runner and
messages) on the actor's event loop. Messages are msgspec bytes both ways, nothing of ours is
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
        self._worker: Any = None
        self._heard_at = time.monotonic()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> tuple[list[bytes], list[Any]]:
        """Load the model and start serving; returns the encoded READY (or StageStartupFailed)."""
        import msgspec

        from omni_runtime.config import StageConfig
        from omni_runtime.messages import ErrorInfo, StageStartupFailed, encodable_text
        from omni_runtime.stage.worker import StageWorker

        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        self._inbox, self._outbox = asyncio.Queue(), asyncio.Queue()
        stage = msgspec.convert(self._stage_data, StageConfig)
        try:
            self._worker = StageWorker(stage, self._replica_id, self._outbox.put_nowait, on_fatal=self._on_fatal)
            ready = await self._worker.start()
        except Exception as e:
            logger.exception("stage %d failed to load", stage.stage_id)
            message = encodable_text(f"{type(e).__name__}: {e}")
            return self._encode(
                StageStartupFailed(error=ErrorInfo(type="StageStartupError", message=message, stage_id=stage.stage_id))
            )
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
        self._inbox.put_nowait((frames, refs))

    async def outputs(self):
        """Everything the worker says, as ``(frames, refs)``, for as long as the actor lives."""
        while True:
            msg = await self._outbox.get()
            try:
                yield self._encode(msg)
            except Exception as e:  # the worker's own fallback made every answer encodable
                logger.error("dropped an unencodable %s: %s", type(msg).__name__, e)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._worker is not None:
            await self._worker.close()

    # ------------------------------------------------------------------ internals

    def _encode(self, msg: Any) -> tuple[list[bytes], list[Any]]:
        import ray

        from omni_runtime.serialization import Encoder

        encoder = Encoder(remote_put=ray.put, remote_min_bytes=self._remote_min_bytes)
        frames = encoder.encode(msg)
        return [bytes(f) for f in frames], list(encoder.remote)

    async def _take_inbox(self) -> None:
        import msgspec

        from omni_runtime.serialization import inbound_decoder

        decoder = inbound_decoder()
        while True:
            frames, refs = await self._inbox.get()
            try:
                values = list(await asyncio.gather(*refs)) if refs else None
                msg = decoder.decode(frames, refs, values)
            except msgspec.DecodeError as e:
                logger.warning("dropped a malformed message: %s", e)
                continue
            except Exception as e:  # an input's object is gone (its producer died)
                logger.warning("dropped a message whose arrays are lost: %s", e)
                self._answer_lost(frames, refs, e)
                continue
            self._worker.handle(msg)

    def _answer_lost(self, frames: list[bytes], refs: list[Any], exc: BaseException) -> None:
        """A request whose input arrays cannot be fetched fails alone, at once."""
        from omni_runtime.messages import ErrorInfo, StageOutput, StageRequest
        from omni_runtime.serialization import inbound_decoder

        try:
            msg = inbound_decoder().decode(frames, refs)  # the arrays as handles: nothing to fetch
        except Exception:
            return
        if isinstance(msg, StageRequest):
            stage_id = self._stage_data.get("stage_id")
            err = ErrorInfo(type="StageExecutionError", message=f"input lost: {exc}", stage_id=stage_id)
            self._outbox.put_nowait(StageOutput(request_id=msg.request_id, error=err))

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
