"""ReplicaHost: what every transport of a stage replica does around its worker. Runs on the
replica's event loop: in a stage process (:mod:`.process`) or a Ray actor (:mod:`.ray_actor`).

A transport (ZMQ sockets, Ray calls) decodes what arrives and sends what the worker says; the host
owns the rest, the same for each: loading the worker and turning a failed load into
``StageStartupFailed``, answering a request whose input arrays are lost (its producer died) with an
error of its own, dropping a malformed message, and closing the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omni_runtime.config import StageConfig
from omni_runtime.messages import (
    ErrorInfo,
    StageOutput,
    StageReady,
    StageRequest,
    StageStartupFailed,
    encodable_text,
)
from omni_runtime.stage.optional_imports import keep_out_unrequested
from omni_runtime.stage.worker import StageWorker

logger = logging.getLogger("omni_runtime.stage")


class ReplicaHost:
    """One replica's :class:`~omni_runtime.stage.worker.StageWorker`, behind a transport."""

    def __init__(
        self,
        stage: StageConfig,
        replica_id: int,
        send: Callable[[Any], None],
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self.stage = stage
        self.stage_id = stage.stage_id
        self.replica_id = replica_id
        #: Sends one message to the engine (encoding errors reach the worker, which answers them).
        self.send = send
        #: Called if the worker's scheduling loop dies: the transport must end the replica, so that
        #: the engine fails what it held with StageDeadError and restarts it.
        self._on_fatal = on_fatal
        self.worker: Any = None

    async def start(self) -> StageReady | StageStartupFailed:
        """Build the worker and load its model: READY, or why it failed (to send as it is)."""
        # Before the runner imports its libraries: torchao only for a stage that quantizes.
        keep_out_unrequested([self.stage])
        try:
            # The runner class is imported and built here too: a bad module is a load failure.
            self.worker = StageWorker(self.stage, self.replica_id, self.send, on_fatal=self._on_fatal)
            return await self.worker.start()
        except Exception as e:
            logger.exception("stage %d failed to load", self.stage_id)
            message = encodable_text(f"{type(e).__name__}: {e}")
            return StageStartupFailed(
                error=ErrorInfo(type="StageStartupError", message=message, stage_id=self.stage_id)
            )

    @property
    def params_cls(self) -> Any:
        """The class a request's params decode as: the loaded runner's (after :meth:`start`)."""
        return self.worker.runner.params_cls

    def handle(self, msg: Any) -> None:
        """One decoded message from the engine, to the worker."""
        self.worker.handle(msg)

    def input_lost(self, msg: Any, exc: BaseException) -> None:
        """``msg`` arrived but its input arrays cannot be had (their producing stage died): a
        request fails alone, at once; anything else is dropped."""
        logger.warning("dropped a message whose arrays are lost: %s", exc)
        if isinstance(msg, StageRequest):
            err = ErrorInfo(type="StageExecutionError", message=f"input lost: {exc}", stage_id=self.stage_id)
            self.send(StageOutput(request_id=msg.request_id, error=err))

    def malformed(self, exc: BaseException) -> None:
        """A message that cannot be decoded: dropped (nothing in it can be answered)."""
        logger.warning("dropped a malformed message: %s", exc)

    async def close(self) -> None:
        if self.worker is not None:
            await self.worker.close()
