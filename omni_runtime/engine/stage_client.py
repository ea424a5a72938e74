"""StageClient: the orchestrator's handle on one stage replica. Runs in the orchestrator thread.

One small interface, two implementations:

* :class:`ZmqStageClient` starts the replica as its own process (``python -m
  omni_runtime.stage.process``) and talks to it over two ZMQ sockets (ipc in a private 0700
  directory, or loopback TCP). Process death is noticed through a pidfd on the event loop, not by
  polling. Over ipc, large arrays travel through shared memory (:mod:`omni_runtime.shm`): this
  client remembers the handles it sent until the replica releases them, releases them itself if
  the replica dies first, and unlinks the replica's own segments once its process has exited.
* :class:`InProcStageClient` runs the same :class:`~omni_runtime.stage.worker.StageWorker` on the
  orchestrator's own loop, with no socket: the unit-test seam and ``runtime.process: false``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from omni_runtime import shm
from omni_runtime.config import StageConfig
from omni_runtime.exceptions import StageDeadError, StageStartupError
from omni_runtime.messages import ErrorInfo, StageOutput, StageReady, StageShutdown, StageStartupFailed
from omni_runtime.transport import SocketReader

logger = logging.getLogger(__name__)

OnMessage = Callable[["StageClient", Any], None]
OnDead = Callable[["StageClient", str], None]


class StageClient(ABC):
    """Sends messages to one replica; delivers what it says to ``on_message``."""

    def __init__(self, stage: StageConfig, replica_id: int, on_message: OnMessage, on_dead: OnDead) -> None:
        self.stage = stage
        self.stage_id = stage.stage_id
        self.replica_id = replica_id
        self._on_message = on_message
        self._on_dead = on_dead
        self.ready: StageReady | None = None
        self.alive = False

    @property
    def pid(self) -> int | None:
        return self.ready.pid if self.ready else None

    @abstractmethod
    async def start(self) -> StageReady:
        """Start the replica and wait for READY; StageStartupError on failure or time-out."""

    @abstractmethod
    def send(self, msg: Any) -> None:
        """Send one message; never blocks. Raises StageDeadError if the replica cannot be reached
        (it is then reported dead) and msgspec.EncodeError if ``msg`` cannot be encoded."""

    @abstractmethod
    def kill(self, reason: str) -> None:
        """Stop an unresponsive replica at once and report it dead with ``reason``."""

    @abstractmethod
    async def close(self, timeout: float = 5.0) -> None:
        """Stop the replica (gracefully, then by force after ``timeout``) and free its resources.
        Always returns: every wait is bounded."""


class InProcStageClient(StageClient):
    """The worker on the orchestrator's loop (its forward still runs in an executor thread)."""

    def __init__(self, stage: StageConfig, replica_id: int, on_message: OnMessage, on_dead: OnDead) -> None:
        super().__init__(stage, replica_id, on_message, on_dead)
        self._worker = None

    async def start(self) -> StageReady:
        from omni_runtime.stage.worker import StageWorker

        loop = asyncio.get_running_loop()
        # Delivered on the next loop turn, as a socket would, so handlers never re-enter each other.
        self._worker = StageWorker(
            self.stage,
            self.replica_id,
            send=lambda msg: loop.call_soon(self._on_message, self, msg),
            on_fatal=self._on_worker_fatal,
        )
        try:
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


class ZmqStageClient(StageClient):
    """A replica in its own process, reached over ZMQ PUSH/PULL sockets."""

    def __init__(
        self,
        stage: StageConfig,
        replica_id: int,
        on_message: OnMessage,
        on_dead: OnDead,
        *,
        zmq_context: Any,
        ipc_dir: Path,
        torch_threads: int,
        generation: int = 0,
        shm_engine: str | None = None,
        shm_pool: shm.ShmPool | None = None,
    ) -> None:
        super().__init__(stage, replica_id, on_message, on_dead)
        self._zctx = zmq_context
        self._ipc_dir = ipc_dir
        self._torch_threads = torch_threads
        self._generation = generation
        # Shared memory only over ipc, and only with the engine's pool for what we send.
        use_shm = stage.runtime.transport == "ipc" and shm_engine is not None
        self._shm_engine = shm_engine if use_shm else None
        self.shm_prefix = shm.replica_prefix(shm_engine, self.stage_id, replica_id, generation) if use_shm else None
        self._sent: list[shm.ShmHandle] = []  # handles this replica has not released yet (maybe)
        self._sent_check_at = 256
        self._proc: subprocess.Popen | None = None
        self._pidfd: int | None = None
        self._push = self._pull = None
        self._reader: SocketReader | None = None
        self._ready_fut: asyncio.Future | None = None
        self._closing = False
        from omni_runtime.serialization import Encoder, outbound_decoder

        self._encoder = Encoder(shm_pool if use_shm else None)
        self._decoder = outbound_decoder(self._shm_engine)

    def _bind(self, sock: Any, name: str) -> str:
        if self.stage.runtime.transport == "tcp":
            sock.bind("tcp://127.0.0.1:*")
            return sock.getsockopt_string(__import__("zmq").LAST_ENDPOINT)
        addr = f"ipc://{self._ipc_dir}/s{self.stage_id}r{self.replica_id}g{self._generation}-{name}"
        sock.bind(addr)
        return addr

    async def start(self) -> StageReady:
        """Spawn the process and wait for READY. Whatever stops that (a load failure, the time-out,
        an exit, a cancellation) closes the process and sockets before it propagates."""
        try:
            return await self._start()
        except BaseException as e:
            await self.close(timeout=1.0)
            if isinstance(e, TimeoutError):
                raise StageStartupError(
                    f"stage {self.stage_id} replica {self.replica_id} did not say READY "
                    f"within {self.stage.runtime.startup_timeout_s:g} s"
                ) from None
            if isinstance(e, Exception) and not isinstance(e, StageStartupError):
                raise StageStartupError(
                    f"stage {self.stage_id} replica {self.replica_id} could not start: {type(e).__name__}: {e}"
                ) from e
            raise

    async def _start(self) -> StageReady:
        import zmq

        from omni_runtime.stage.process import StageProcessArgs

        loop = asyncio.get_running_loop()
        # 1) bind both sockets here, so the child only connects (no race on who is first).
        self._push = self._zctx.socket(zmq.PUSH)
        self._pull = self._zctx.socket(zmq.PULL)
        for sock in (self._push, self._pull):
            sock.setsockopt(zmq.LINGER, 0)
            # Unbounded queues: with a connected peer a send never blocks, however slow or stopped
            # that peer is (admission is bounded upstream). Without one it would: sends are NOBLOCK.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        in_addr, out_addr = self._bind(self._push, "in"), self._bind(self._pull, "out")
        args = StageProcessArgs(
            stage=msgspec.to_builtins(self.stage),
            replica_id=self.replica_id,
            inbound_addr=in_addr,
            outbound_addr=out_addr,
            torch_threads=self._torch_threads,
            log_level=logging.getLogger("omni_runtime").getEffectiveLevel() or logging.INFO,
            shm_prefix=self.shm_prefix,
            shm_engine=self._shm_engine,
        )
        # 2) start the process; its arguments go on stdin as msgpack (nothing is pickled), and it
        #    sees this process's import path so custom runner modules resolve the same way.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        payload = msgspec.msgpack.encode(args)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "omni_runtime.stage.process"], stdin=subprocess.PIPE, env=env, close_fds=True
        )
        # 3) death sentinel first: a pidfd becomes readable when the process exits.
        self._pidfd = os.pidfd_open(self._proc.pid)
        loop.add_reader(self._pidfd, self._on_exit)
        self.alive = True
        self._ready_fut = loop.create_future()
        self._reader = SocketReader(self._pull, self._on_frames)
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(payload)  # a few KiB: fits the pipe, never blocks
            self._proc.stdin.close()
        except BrokenPipeError:
            pass  # it exited at once; the pidfd reports why
        # 4) READY handshake with a time-out.
        self.ready = await asyncio.wait_for(asyncio.shield(self._ready_fut), self.stage.runtime.startup_timeout_s)
        return self.ready

    def _on_frames(self, frames: list[Any]) -> None:
        try:
            msg = self._decoder.decode(frames)
        except shm.ShmLostError as e:
            msg = self._lost_output(e)
            if msg is None:
                return
        except msgspec.DecodeError as e:
            logger.warning("stage %d: dropped a malformed message: %s", self.stage_id, e)
            return
        if not isinstance(msg, StageOutput):
            msg = shm.materialize(msg)  # only stage outputs are routed on as refs
        if self._ready_fut is not None and not self._ready_fut.done():
            if isinstance(msg, StageReady):
                self._ready_fut.set_result(msg)
                return
            if isinstance(msg, StageStartupFailed):
                self._ready_fut.set_exception(
                    StageStartupError(
                        f"stage {self.stage_id} replica {self.replica_id} failed to load: {msg.error.message}"
                    )
                )
                return
        # A bug in routing one message is logged by the reader, which keeps reading.
        self._on_message(self, msg)

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        code = self._proc.wait()  # reaps it: no zombie
        os.close(self._pidfd)
        self._pidfd = None
        was_alive, self.alive = self.alive, False
        reason = f"stage {self.stage_id} replica {self.replica_id} (pid {self._proc.pid}) exited with code {code}"
        if self._ready_fut is not None and not self._ready_fut.done() and self._reader is not None:
            self._reader.drain()  # its last words (why it failed to load) may be queued already
        if self._ready_fut is not None and not self._ready_fut.done():
            self._ready_fut.set_exception(StageStartupError(f"{reason} before READY"))
            return
        if was_alive and not self._closing:
            logger.error("%s", reason)
            self._on_dead(self, reason)

    def _lost_output(self, exc: shm.ShmLostError) -> StageOutput | None:
        logger.warning("stage %d: %s", self.stage_id, exc)
        if not isinstance(exc.message, StageOutput):
            return None
        err = ErrorInfo(type="StageExecutionError", message=f"output lost: {exc}", stage_id=self.stage_id)
        return StageOutput(request_id=exc.message.request_id, error=err)

    def send(self, msg: Any) -> None:
        import zmq

        if not self.alive or self._push is None:
            raise StageDeadError(
                f"stage {self.stage_id} replica {self.replica_id} is not alive", stage_id=self.stage_id
            )
        frames = self._encoder.encode(msg)  # msgspec.EncodeError: nothing was sent
        try:
            # Never blocks: HWM 0 queues without bound while the peer is connected; a PUSH socket
            # with no peer (the process exited, its pipe is gone) would wait forever without NOBLOCK.
            self._push.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            for handle in self._encoder.handles:
                shm.release(handle)
            reason = f"stage {self.stage_id} replica {self.replica_id} (pid {self.pid}) cannot be reached: {e}"
            self._stop()
            # Reported on the next loop turn: the caller is in the middle of routing.
            asyncio.get_running_loop().call_soon(self._report_dead, reason)
            raise StageDeadError(reason, stage_id=self.stage_id) from None
        if self._encoder.handles:
            self._track(self._encoder.handles)

    def kill(self, reason: str) -> None:
        """SIGKILL (works on a stopped process too) and report the death now; the pidfd then
        reaps it without reporting it twice."""
        if self.alive:
            self._stop()
            self._report_dead(reason)

    def _stop(self) -> None:
        self.alive = False
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def _report_dead(self, reason: str) -> None:
        if not self._closing:
            logger.error("%s", reason)
            self._on_dead(self, reason)

    @property
    def unreleased(self) -> list[shm.ShmHandle]:
        """Shared-memory handles sent to this replica that it may not have released yet."""
        return list(self._sent)

    def _track(self, handles: list[shm.ShmHandle]) -> None:
        self._sent.extend(handles)
        if len(self._sent) >= self._sent_check_at:
            # Amortised: forget what the replica has released since (a word read per handle).
            self._sent = [h for h in self._sent if shm.pending(h)]
            self._sent_check_at = max(256, 2 * len(self._sent))

    def _release_unread(self) -> None:
        """Release what the (now exited) replica was sent and never read; nobody races us."""
        released = sum(shm.release(h) for h in self._sent)
        self._sent = []
        if released:
            logger.info(
                "stage %d replica %d: released %d unread shared-memory arrays", self.stage_id, self.replica_id, released
            )

    async def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            # 1) ask politely, 2) SIGTERM, 3) SIGKILL: each bounded, so close() always returns.
            if self.alive:
                try:
                    self.send(StageShutdown())
                except StageDeadError:
                    pass  # no peer to ask: go on to the signals
            for step in (proc.terminate, proc.kill, None):
                if await _wait_exit(proc, timeout):
                    break
                if step is None:
                    break
                step()
                timeout = 2.0
        self.alive = False
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if proc is not None and proc.poll() is None:
            # Not even SIGKILL ended it within the bound (a process in uninterruptible sleep):
            # never block the loop on it; the kernel reaps it with this process at the latest.
            logger.error(
                "stage %d replica %d (pid %d) did not exit after SIGKILL", self.stage_id, self.replica_id, proc.pid
            )
        if self._reader is not None:
            self._reader.close()
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if proc is not None and proc.returncode is not None:
            self._release_unread()
            if self.shm_prefix is not None:
                # The replica unlinks its pool on a clean exit; after a crash, its names tell us what was its.
                shm.unlink_prefix(self.shm_prefix + "-")


async def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for ``proc`` to exit without blocking the loop: a pidfd wakes us, no polling."""
    if proc.poll() is not None:
        return True
    loop = asyncio.get_running_loop()
    fd = os.pidfd_open(proc.pid)
    fut = loop.create_future()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await asyncio.wait_for(fut, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)
