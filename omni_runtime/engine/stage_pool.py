"""StagePool: the replicas of one stage. Runs in the orchestrator thread.

Routes each request to the least-loaded live replica, knows which replica holds which request,
fans control calls out to every live replica, and restarts a replica that dies (exponential
backoff, at most ``runtime.max_restarts`` times) while the others keep serving.

Liveness: every replica is pinged from this loop a few times per ``runtime.heartbeat_timeout_s``
and answers from its own event loop. A replica that stays silent that long (stopped with SIGSTOP,
its loop blocked), or whose forward made no progress for ``runtime.stall_timeout_s`` (stuck in
native code), is killed: its requests fail with StageDeadError and it is restarted like a crash.
A stage left with no live replica and no restart is *gone*, which the orchestrator hears once.

Placement: a restart that no node can host now (StageUnplacedError: on Ray, every node offering
what the replica needs is gone) spends no restart attempt; the replica is ``unplaced`` and its
restart tries again every ``_PLACE_RETRY_S`` until a node can host it. Meanwhile the stage's
requests fail at once (StageDeadError saying why), they never wait for a node.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from omni_runtime.config import StageConfig
from omni_runtime.engine.backends import StageBackend, StageClient
from omni_runtime.engine.status import ReplicaState, StageStatus
from omni_runtime.exceptions import (
    InvalidRequestError,
    OmniError,
    RpcError,
    StageDeadError,
    StageStartupError,
    StageUnplacedError,
)
from omni_runtime.messages import (
    RpcReplicaResult,
    StageAbort,
    StageConstraints,
    StageOutput,
    StageOutputs,
    StagePing,
    StagePong,
    StageReady,
    StageRequest,
    StageRpc,
    StageRpcResult,
)
from omni_runtime.tasks import BackgroundTasks

logger = logging.getLogger(__name__)

_call_ids = itertools.count(1)

#: Seconds between attempts to place an unplaced replica (each asks the cluster what it offers).
_PLACE_RETRY_S = 1.0


def heartbeat_interval(timeout_s: float) -> float:
    """How often replicas are pinged: a few times per timeout, at most once a second."""
    return max(0.02, min(1.0, timeout_s / 4))


class StagePool:
    """All replicas of one stage, and which requests each one holds."""

    def __init__(
        self,
        stage: StageConfig,
        backend: StageBackend,
        on_output: Callable[[int, Any], None],
        on_requests_lost: Callable[[int, list[str], OmniError], None],
        on_gone: Callable[[int, str], None] | None = None,
    ) -> None:
        self.stage = stage
        self.stage_id = stage.stage_id
        self._backend = backend
        self._on_output = on_output
        self._on_requests_lost = on_requests_lost
        self._on_gone = on_gone
        n = stage.runtime.num_replicas
        self.replicas: list[StageClient | None] = [None] * n
        self.inflight: list[set[str]] = [set() for _ in range(n)]
        self.where: dict[str, int] = {}
        self._turn = 0
        self.restarts = [0] * n
        #: Replicas killed because they missed heartbeats or their forward stalled.
        self.unresponsive_kills = 0
        self.constraints = StageConstraints()
        self._rpc: dict[int, tuple[int, asyncio.Future]] = {}
        self._tasks = BackgroundTasks()  # restarts, and the closing of dead replicas
        self._restarting: dict[int, asyncio.Task] = {}
        #: Replicas whose restart waits for a node that can host them, and why.
        self._unplaced: dict[int, str] = {}
        self._pong_at = [0.0] * n
        self._stalled: list[float | None] = [None] * n
        self._ping_seq = itertools.count(1)
        self._heartbeat: asyncio.TimerHandle | None = None
        #: When this pool's own check last ran (a gap longer than the timeout is ours, not the stage's).
        self._beat_at = time.monotonic()
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start every replica concurrently; if one fails, all of them are closed again.

        Each replica is heartbeaten from the moment it is READY, not once the whole pool is: its
        siblings may wait a long time to be placed (on Ray, for resources another replica holds),
        and a replica that hears nothing for a while exits by itself."""
        clients = [self._new_client(i, 0) for i in range(len(self.replicas))]

        async def start_one(client: StageClient) -> StageReady:
            ready = await client.start()
            if ready.compile_s is not None:
                sid, rid = self.stage_id, client.replica_id
                logger.info("stage %d replica %d: compiled in %.1f s before READY", sid, rid, ready.compile_s)
            self.replicas[client.replica_id] = client
            self._pong_at[client.replica_id] = time.monotonic()
            if self._heartbeat is None:
                self._schedule_heartbeat()
            return ready

        results = await asyncio.gather(*(start_one(c) for c in clients), return_exceptions=True)
        for c in clients:  # close() must reach every replica (one restarted meanwhile is newer)
            if self.replicas[c.replica_id] is None:
                self.replicas[c.replica_id] = c
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.close()
            first = failed[0]
            if isinstance(first, OmniError | asyncio.CancelledError):
                raise first
            raise StageStartupError(f"stage {self.stage_id} failed to start: {type(first).__name__}: {first}")
        ready = results[0]
        assert not isinstance(ready, BaseException)  # a failure was raised above
        self.constraints = ready.constraints

    def _new_client(self, replica_id: int, generation: int) -> StageClient:
        return self._backend.client(self.stage, replica_id, generation, self._on_message, self._on_dead)

    async def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        # A restart that is starting a process closes it when cancelled; wait for that, and for
        # the closing of dead replicas, so nothing is left when this returns.
        for task in self._restarting.values():
            task.cancel()
        await self._tasks.wait()
        await asyncio.gather(*(c.close(timeout) for c in self.replicas if c is not None), return_exceptions=True)
        for _, fut in self._rpc.values():
            if not fut.done():
                fut.set_exception(RpcError("engine closed"))

    # ------------------------------------------------------------------ requests

    @property
    def live(self) -> list[StageClient]:
        return [c for c in self.replicas if c is not None and c.alive]

    def submit(self, msg: StageRequest) -> None:
        """Send to the least-loaded live replica. StageDeadError when none is alive or it cannot be
        reached; InvalidRequestError when the request holds what no message can carry."""
        live = self.live
        if not live:
            why = next(iter(self._unplaced.values()), None)
            raise StageDeadError(
                f"stage {self.stage_id} has no live replica" + (f": {why}" if why else ""), stage_id=self.stage_id
            )
        # Least loaded; ties rotate, so an idle pool does not pile every request on replica 0.
        self._turn += 1
        n = len(self.replicas)
        client = min(live, key=lambda c: (len(self.inflight[c.replica_id]), (c.replica_id - self._turn) % n))
        self.inflight[client.replica_id].add(msg.request_id)
        self.where[msg.request_id] = client.replica_id
        try:
            client.send(msg)
        except msgspec.EncodeError as e:
            self.done(msg.request_id)
            raise InvalidRequestError(f"the request cannot be sent to stage {self.stage_id}: {e}") from None
        except BaseException:
            self.done(msg.request_id)
            raise

    def done(self, request_id: str) -> None:
        replica = self.where.pop(request_id, None)
        if replica is not None:
            self.inflight[replica].discard(request_id)

    def abort(self, request_id: str) -> None:
        replica = self.where.get(request_id)
        if replica is not None:
            client = self.replicas[replica]
            if client is not None and client.alive:
                try:
                    client.send(StageAbort(request_ids=[request_id]))
                except StageDeadError:
                    pass  # the replica is gone, and its death fails what it held
            self.done(request_id)

    # ------------------------------------------------------------------ replica events

    def _on_message(self, client: StageClient, msg: Any) -> None:
        if isinstance(msg, StagePong):
            self._pong_at[client.replica_id] = time.monotonic()
            self._stalled[client.replica_id] = msg.stalled_s
            return
        if isinstance(msg, StageRpcResult):
            entry = self._rpc.pop(msg.call_id, None)
            if entry is not None and not entry[1].done():
                entry[1].set_result(msg)
            return
        if isinstance(msg, StageOutputs):
            for out in msg.outputs:
                self._on_output(self.stage_id, out)
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
            self._on_requests_lost(self.stage_id, lost, StageDeadError(reason, stage_id=self.stage_id))
        # Free the dead replica's sockets and reader now; a restart gets fresh ones.
        self._tasks.spawn(client.close(timeout=0.5))
        if restart:
            self._restarting[replica] = self._tasks.spawn(self._restart(replica))
        else:
            self._check_gone(reason)

    def _check_gone(self, reason: str) -> None:
        if not self._closed and not self.live and not self._restarting and self._on_gone is not None:
            self._on_gone(self.stage_id, reason)

    async def _restart(self, replica: int) -> None:
        """Start a new process for ``replica`` after a backoff, retrying within ``max_restarts``."""
        max_restarts = self.stage.runtime.max_restarts
        failure = None
        try:
            while True:
                attempt = self.restarts[replica]  # counted by the caller
                if replica in self._unplaced:
                    delay = _PLACE_RETRY_S  # no attempt was spent: ask again for a node
                else:
                    delay = min(0.5 * 2 ** (attempt - 1), 30.0)
                    logger.warning(
                        "stage %d replica %d: restart %d/%d in %.1f s",
                        *(self.stage_id, replica, attempt, max_restarts, delay),
                    )
                await asyncio.sleep(delay)  # backoff: a crash loop must not spin
                client = self._new_client(replica, attempt)
                try:
                    await client.start()  # closes its own process if it fails or is cancelled
                except StageUnplacedError as e:
                    # Nowhere to go: no attempt spent, wait for a node (a worker that comes back).
                    if self._closed:
                        return
                    if replica not in self._unplaced:
                        logger.error("stage %d replica %d waits for a node: %s", self.stage_id, replica, e)
                    self._unplaced[replica] = str(e)
                    continue
                except Exception as e:
                    self._unplaced.pop(replica, None)
                    logger.error("stage %d replica %d: restart failed: %s", self.stage_id, replica, e)
                    if self._closed or self.restarts[replica] >= max_restarts:
                        failure = f"restart failed: {e}"
                        return
                    self.restarts[replica] += 1
                    continue
                if self._closed:
                    await client.close()
                    return
                self._unplaced.pop(replica, None)
                self.replicas[replica] = client
                self._pong_at[replica], self._stalled[replica] = time.monotonic(), None
                logger.warning("stage %d replica %d restarted (pid %s)", self.stage_id, replica, client.pid)
                return
        finally:
            self._restarting.pop(replica, None)
            self._unplaced.pop(replica, None)
            if failure is not None:
                self._check_gone(failure)

    # ------------------------------------------------------------------ liveness

    def _schedule_heartbeat(self) -> None:
        timeout = self.stage.runtime.heartbeat_timeout_s
        if timeout > 0 and not self._closed:
            self._heartbeat = asyncio.get_running_loop().call_later(heartbeat_interval(timeout), self._beat)

    def _beat(self) -> None:
        """1) kill replicas that stayed silent or stalled too long  2) ping the others  3) again later."""
        runtime = self.stage.runtime
        now = time.monotonic()
        if now - self._beat_at > runtime.heartbeat_timeout_s:
            # This checker itself did not run for longer than the timeout (the process was paused
            # or its loop blocked): the replicas' silence is the observer's; their clocks restart.
            self._pong_at = [now] * len(self._pong_at)
        self._beat_at = now
        for client in self.live:
            r = client.replica_id
            silent, stalled = now - self._pong_at[r], self._stalled[r]
            if silent > runtime.heartbeat_timeout_s:
                self._kill(client, f"answered no heartbeat for {silent:.1f} s (stopped, or its event loop is blocked)")
            elif runtime.stall_timeout_s and stalled is not None and stalled > runtime.stall_timeout_s:
                self._kill(client, f"its forward made no progress for {stalled:.1f} s (wedged)")
            else:
                try:
                    client.send(StagePing(seq=next(self._ping_seq)))
                except StageDeadError:
                    pass  # reported dead by the client itself
        self._schedule_heartbeat()

    def _kill(self, client: StageClient, why: str) -> None:
        self.unresponsive_kills += 1
        client.kill(f"stage {self.stage_id} replica {client.replica_id} (pid {client.pid}) {why}; killed")

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
            try:
                client.send(StageRpc(call_id=call_id, method=method, args=args, kwargs=kwargs))
                reply: StageRpcResult = await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                return RpcReplicaResult(
                    stage_id=self.stage_id, replica_id=client.replica_id, error=f"timed out after {timeout:g} s"
                )
            except (RpcError, StageDeadError) as e:
                return RpcReplicaResult(stage_id=self.stage_id, replica_id=client.replica_id, error=str(e))
            except msgspec.EncodeError as e:
                return RpcReplicaResult(
                    stage_id=self.stage_id, replica_id=client.replica_id, error=f"arguments cannot be sent: {e}"
                )
            finally:
                self._rpc.pop(call_id, None)
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

    def status(self) -> StageStatus:
        live = {c.replica_id for c in self.live}
        states: list[ReplicaState] = [
            "live"
            if i in live
            else "unplaced"
            if i in self._unplaced
            else "restarting"
            if i in self._restarting
            else "dead"
            for i in range(len(self.replicas))
        ]
        return StageStatus(
            stage_id=self.stage_id,
            stage_type=self.stage.stage_type,
            replicas=len(self.replicas),
            live_replicas=len(live),
            replica_states=states,
            replica_nodes=[None if c is None else c.node for c in self.replicas],
            restarts=sum(self.restarts),
            unresponsive_kills=self.unresponsive_kills,
            inflight=sum(len(s) for s in self.inflight),
            per_replica_inflight=[len(s) for s in self.inflight],
            unplaced=next(iter(self._unplaced.values()), None),
        )
