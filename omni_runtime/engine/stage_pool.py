"""StagePool: the replicas of one stage. Runs in the orchestrator thread.

Routes each request to the least-loaded live replica, knows which replica holds which request,
fans control calls out to every live replica, and restarts a replica that dies (exponential
backoff, at most ``runtime.max_restarts`` times) while the others keep serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from omni_runtime.config import StageConfig
from omni_runtime.engine.stage_client import StageClient
from omni_runtime.exceptions import RpcError, StageDeadError
from omni_runtime.messages import (
    RpcReplicaResult,
    StageAbort,
    StageOutput,
    StageRequest,
    StageRpc,
    StageRpcResult,
)

logger = logging.getLogger(__name__)

#: (replica_id, generation, on_message, on_dead) -> a client not yet started.
ClientFactory = Callable[[int, int, Any, Any], StageClient]

_call_ids = itertools.count(1)


class StagePool:
    """All replicas of one stage, and which requests each one holds."""

    def __init__(
        self,
        stage: StageConfig,
        make_client: ClientFactory,
        on_output: Callable[[int, Any], None],
        on_requests_lost: Callable[[int, list[str], str], None],
    ) -> None:
        self.stage = stage
        self.stage_id = stage.stage_id
        self._make_client = make_client
        self._on_output = on_output
        self._on_requests_lost = on_requests_lost
        n = stage.runtime.num_replicas
        self.replicas: list[StageClient | None] = [None] * n
        self.inflight: list[set[str]] = [set() for _ in range(n)]
        self.where: dict[str, int] = {}
        self._turn = 0
        self.restarts = [0] * n
        self.constraints: dict[str, Any] = {}
        self._rpc: dict[int, tuple[int, asyncio.Future]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start every replica concurrently; a failure closes the ones that did start."""
        clients = [self._new_client(i, 0) for i in range(len(self.replicas))]
        results = await asyncio.gather(*(c.start() for c in clients), return_exceptions=True)
        for i, (client, res) in enumerate(zip(clients, results, strict=True)):
            self.replicas[i] = client
            if isinstance(res, BaseException):
                await self.close()
                raise res
            self.constraints = dict(res.constraints)

    def _new_client(self, replica_id: int, generation: int) -> StageClient:
        return self._make_client(replica_id, generation, self._on_message, self._on_dead)

    async def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(c.close(timeout) for c in self.replicas if c is not None), return_exceptions=True)
        for _, fut in self._rpc.values():
            if not fut.done():
                fut.set_exception(RpcError("engine closed"))

    # ------------------------------------------------------------------ requests

    @property
    def live(self) -> list[StageClient]:
        return [c for c in self.replicas if c is not None and c.alive]

    def submit(self, msg: StageRequest) -> None:
        """Send to the least-loaded live replica; StageDeadError when none is alive."""
        live = self.live
        if not live:
            raise StageDeadError(f"stage {self.stage_id} has no live replica", stage_id=self.stage_id)
        # Least loaded; ties rotate, so an idle pool does not pile every request on replica 0.
        self._turn += 1
        n = len(self.replicas)
        client = min(live, key=lambda c: (len(self.inflight[c.replica_id]), (c.replica_id - self._turn) % n))
        self.inflight[client.replica_id].add(msg.request_id)
        self.where[msg.request_id] = client.replica_id
        client.send(msg)

    def done(self, request_id: str) -> None:
        replica = self.where.pop(request_id, None)
        if replica is not None:
            self.inflight[replica].discard(request_id)

    def abort(self, request_id: str) -> None:
        replica = self.where.get(request_id)
        if replica is not None:
            client = self.replicas[replica]
            if client is not None and client.alive:
                client.send(StageAbort(request_ids=[request_id]))
            self.done(request_id)

    # ------------------------------------------------------------------ replica events

    def _on_message(self, client: StageClient, msg: Any) -> None:
        if isinstance(msg, StageRpcResult):
            entry = self._rpc.pop(msg.call_id, None)
            if entry is not None and not entry[1].done():
                entry[1].set_result(msg)
            return
        if not isinstance(msg, StageOutput):  # e.g. a second READY: nothing to route
            logger.warning("stage %d: dropped unexpected %s", self.stage_id, type(msg).__name__)
            return
        self._on_output(self.stage_id, msg)

    def _on_dead(self, client: StageClient, reason: str) -> None:
        replica = client.replica_id
        lost = sorted(self.inflight[replica])
        for rid in lost:
            self.done(rid)
        for call_id, (rep, fut) in list(self._rpc.items()):
            if rep == replica and not fut.done():
                fut.set_exception(RpcError(reason))
                self._rpc.pop(call_id, None)
        # Count the restart before anyone hears of the death, so status() is never behind the errors.
        restart = not self._closed and self.restarts[replica] < self.stage.runtime.max_restarts
        if restart:
            self.restarts[replica] += 1
        if lost:
            self._on_requests_lost(self.stage_id, lost, reason)
        # Free the dead replica's sockets and reader now; a restart gets fresh ones.
        self._spawn(client.close(timeout=0.5))
        if restart:
            self._spawn(self._restart(replica))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, replica: int) -> None:
        attempt = self.restarts[replica]  # counted by the caller
        delay = min(0.5 * 2 ** (attempt - 1), 30.0)
        logger.warning(
            "stage %d replica %d: restart %d/%d in %.1f s",
            self.stage_id,
            replica,
            attempt,
            self.stage.runtime.max_restarts,
            delay,
        )
        await asyncio.sleep(delay)  # backoff: a crash loop must not spin
        client = self._new_client(replica, attempt)
        try:
            await client.start()
        except Exception as e:
            logger.error("stage %d replica %d: restart failed: %s", self.stage_id, replica, e)
            await client.close(timeout=1.0)
            if not self._closed and self.restarts[replica] < self.stage.runtime.max_restarts:
                self.restarts[replica] += 1
                await self._restart(replica)
            return
        if self._closed:
            await client.close()
            return
        self.replicas[replica] = client
        logger.warning("stage %d replica %d restarted (pid %s)", self.stage_id, replica, client.pid)

    # ------------------------------------------------------------------ control calls

    async def rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any], timeout: float | None
    ) -> list[RpcReplicaResult]:
        """Run a control call on every live replica concurrently; one result per replica."""
        loop = asyncio.get_running_loop()

        async def one(client: StageClient) -> RpcReplicaResult:
            call_id = next(_call_ids)
            fut = loop.create_future()
            self._rpc[call_id] = (client.replica_id, fut)
            client.send(StageRpc(call_id=call_id, method=method, args=args, kwargs=kwargs))
            try:
                reply: StageRpcResult = await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                self._rpc.pop(call_id, None)
                return RpcReplicaResult(
                    stage_id=self.stage_id, replica_id=client.replica_id, error=f"timed out after {timeout:g} s"
                )
            except RpcError as e:
                return RpcReplicaResult(stage_id=self.stage_id, replica_id=client.replica_id, error=str(e))
            if reply.error is not None:
                return RpcReplicaResult(
                    stage_id=self.stage_id,
                    replica_id=client.replica_id,
                    error=f"{reply.error.type}: {reply.error.message}",
                )
            return RpcReplicaResult(stage_id=self.stage_id, replica_id=client.replica_id, result=reply.result)

        asked = self.live  # fixed now: a replica that dies during the call answers once, with its death
        results = list(await asyncio.gather(*(one(c) for c in asked)))
        for i in sorted(set(range(len(self.replicas))) - {c.replica_id for c in asked}):
            results.append(RpcReplicaResult(stage_id=self.stage_id, replica_id=i, error="replica is not alive"))
        return sorted(results, key=lambda r: r.replica_id)

    def status(self) -> dict[str, Any]:
        return {
            "stage_id": self.stage_id,
            "stage_type": self.stage.stage_type,
            "replicas": len(self.replicas),
            "live_replicas": len(self.live),
            "restarts": sum(self.restarts),
            "inflight": sum(len(s) for s in self.inflight),
            "per_replica_inflight": [len(s) for s in self.inflight],
        }
