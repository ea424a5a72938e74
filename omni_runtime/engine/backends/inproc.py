"""The ``inproc`` backend: each replica is a StageWorker on the orchestrator's own event loop.

No socket and no process: messages are handed to the worker directly (delivered on the next loop
turn, as a socket would). Its forward still runs in the worker's executor thread. The seam for
unit tests, and for debugging a runner in one process.
"""

from __future__ import annotations

import asyncio
from typing import Any

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import StageDeadError, StageStartupError
from omni_runtime.messages import StageReady
from omni_runtime.stage.worker import StageWorker

from .base import OnDead, OnMessage, StageBackend, StageClient


class InProcBackend(StageBackend):
    name = "inproc"

    def client(
        self, stage: StageConfig, replica_id: int, generation: int, on_message: OnMessage, on_dead: OnDead
    ) -> StageClient:
        return InProcStageClient(stage, replica_id, on_message, on_dead)


class InProcStageClient(StageClient):
    """The worker on the orchestrator's loop (its forward still runs in an executor thread)."""

    def __init__(self, stage: StageConfig, replica_id: int, on_message: OnMessage, on_dead: OnDead) -> None:
        super().__init__(stage, replica_id, on_message, on_dead)
        self._worker: StageWorker | None = None

    async def start(self) -> StageReady:
        loop = asyncio.get_running_loop()

        def send(msg: Any) -> None:
            # Delivered on the next loop turn, as a socket would, so handlers never re-enter each other.
            loop.call_soon(self._on_message, self, msg)

        try:
            self._worker = StageWorker(
                self.stage,
                self.replica_id,
                send=send,
                on_fatal=self._on_worker_fatal,
            )
            self.ready = await self._worker.start()
        except Exception as e:
            raise StageStartupError(f"stage {self.stage_id} failed to load: {type(e).__name__}: {e}") from e
        self.alive = True
        return self.ready

    def _on_worker_fatal(self, exc: BaseException) -> None:
        # The in-process twin of a replica process exiting: its requests fail, the pool restarts it.
        if self.alive:
            self.alive = False
            self._on_dead(self, f"stage {self.stage_id} replica {self.replica_id}: worker loop died: {exc!r}")

    def send(self, msg: Any) -> None:
        if self._worker is None or not self.alive:
            raise StageDeadError(
                f"stage {self.stage_id} replica {self.replica_id} is not alive", stage_id=self.stage_id
            )
        self._worker.handle(msg)

    def kill(self, reason: str) -> None:
        # A thread cannot be killed: a wedged forward thread is abandoned, the worker replaced.
        if self.alive:
            self.alive = False
            self._on_dead(self, reason)

    async def close(self, timeout: float = 5.0) -> None:
        self.alive = False
        if self._worker is not None:
            await self._worker.close()
