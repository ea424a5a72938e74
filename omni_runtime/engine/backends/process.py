"""The ``process`` backend: each replica is its own process, reached over ZMQ; the default.

:class:`ProcessBackend` owns what the replicas of an engine share: a private 0700 directory for
the ipc sockets (named after this process, so a killed engine's directory is recognised and
removed), one ZMQ context, and the engine's shared-memory pool with its name prefix. It decides
that an output's shared-memory arrays go to their one consumer as they are (that stage releases
them) when the consumer is a process replica on ipc without an input function, and are copied out
once in the orchestrator otherwise (see :mod:`omni_runtime.shm`).

:class:`ProcessStageClient` starts a replica as ``python -m omni_runtime.stage.process`` and talks
to it over two ZMQ sockets (ipc in the private directory, or loopback TCP). Process death is
noticed through a pidfd on the event loop, not by polling. Over ipc, large arrays travel through
shared memory: the client remembers the handles it sent until the replica releases them,
releases them itself if the replica dies first, and unlinks the replica's own segments once its
process has exited.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from omni_runtime import shm
from omni_runtime.config import DeployConfig, StageConfig
from omni_runtime.exceptions import StageDeadError, StageStartupError
from omni_runtime.logs import runtime_log_level
from omni_runtime.messages import (
    ErrorInfo,
    StageOutput,
    StageOutputs,
    StageReady,
    StageShutdown,
    StageStartupFailed,
)
from omni_runtime.serialization import Encoder, outbound_decoder
from omni_runtime.stage.lifetime import child_env
from omni_runtime.stage.process import StageProcessArgs
from omni_runtime.transport import SocketReader

from .base import EngineResources, OnDead, OnMessage, StageBackend, StageClient
from .launcher_client import LaunchedProcess, LauncherClient

if TYPE_CHECKING:
    import zmq

#: How long a replica that exited before READY is given for its last words to arrive.
_LAST_WORDS_S = 1.0

logger = logging.getLogger(__name__)

_IPC_PREFIX = "omni_runtime-ipc-"


class ProcessOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``runtime:`` keys only the ``process`` backend reads."""

    #: Transport to a process replica: ``ipc`` (a unix socket in a private directory) or ``tcp``
    #: (loopback). Tensors use shared memory over ipc and raw msgpack buffers over tcp.
    transport: Literal["ipc", "tcp"] = "ipc"
    #: How a replica's process starts: ``fork``ed from the engine's stage launcher, which imported
    #: the runner's libraries once (restarts and the second replica onwards skip seconds of
    #: imports), or ``spawn``ed as a fresh interpreter that imports them itself. ``auto``: fork a
    #: stage on the CPU, spawn one on an accelerator (:func:`_forks`).
    start_method: Literal["auto", "fork", "spawn"] = "auto"


def _transport(stage: StageConfig) -> str:
    return stage.runtime.options.transport if isinstance(stage.runtime.options, ProcessOptions) else "ipc"


def _forks(stage: StageConfig) -> bool:
    """Whether the stage's replicas are forked from the launcher. A CUDA process cannot be forked
    once CUDA is initialized in it, and what the launcher imports (diffusers, torchao) may initialize
    it as it asks about the device: a stage on an accelerator is spawned, unless its config says
    ``fork``."""
    options = stage.runtime.options
    method = options.start_method if isinstance(options, ProcessOptions) else "auto"
    if method == "auto":
        return all(device.strip().split(":")[0] == "cpu" for device in stage.runtime.devices.split(","))
    return method == "fork"


class ProcessBackend(StageBackend):
    name = "process"
    options = ProcessOptions

    def __init__(self, config: DeployConfig, resources: EngineResources) -> None:
        super().__init__(config, resources)
        self.ipc_dir: Path | None = None
        self.zmq_context: Any = None
        #: Name prefix of every shared-memory segment of this engine (None: no ipc stage).
        self.shm_prefix: str | None = None
        self.shm_pool: shm.ShmPool | None = None
        stages = [s for s in config.stage_args if s.runtime.backend == self.name]
        # Every process that computes: each rank of a parallel group counts.
        self._process_replicas = sum(
            s.runtime.num_replicas * (s.runtime.parallel.world_size if s.runtime.parallel is not None else 1)
            for s in stages
        )
        self._uses_shm = any(_transport(s) == "ipc" for s in stages)
        self._forked = [s for s in stages if _forks(s)]
        #: The stage launcher the forked replicas come from (None: every replica is spawned).
        self.launcher: LauncherClient | None = None
        self._launcher_resource: int | None = None

    async def open(self) -> None:
        import zmq

        # 1) sockets live in a private directory (mkdtemp makes it 0700), named after this process
        #    so that one left by a killed engine can be recognised and removed.
        _remove_stale_ipc_dirs()
        self.ipc_dir = Path(tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getpid()}-"))
        self.resources.add(f"ipc directory {self.ipc_dir}", partial(shutil.rmtree, self.ipc_dir, ignore_errors=True))
        # 2) plain sockets: SocketReader drains them from the loop; destroyed once every socket closed
        self.zmq_context = zmq.Context()
        self.resources.add("zmq context", partial(self.zmq_context.destroy, linger=0))
        if self._uses_shm:
            # 3) segments of engines that were killed before they could clean up go first
            shm.sweep_dead_engines()
            prefix = shm.engine_prefix()
            self.resources.add(f"shared memory {prefix}-*", partial(shm.unlink_prefix, prefix + "-"))
            self.shm_prefix = prefix
            self.shm_pool = shm.ShmPool(shm.orchestrator_prefix(prefix))
            self.resources.add("the orchestrator's shared-memory pool", self.shm_pool.close)
        if self._forked:
            # 4) the launcher imports while the rest of the engine starts; released after every
            #    replica (resources go last made first), so it never outlives one of them.
            stages = [msgspec.to_builtins(s) for s in self._forked]
            launcher = LauncherClient(stages, child_env(), runtime_log_level())
            launcher.start(asyncio.get_running_loop())
            self._launcher_resource = self.resources.add(f"stage launcher (pid {launcher.pid})", launcher.close)
            self.launcher = launcher

    async def release_spare(self) -> None:
        # The launcher (the size of every library it imported) forks nothing for a dead engine.
        launcher, self.launcher = self.launcher, None
        if launcher is not None:
            launcher.stop()  # on this loop, which reads it
            await asyncio.to_thread(launcher.close)
            self.resources.discard(self._launcher_resource)

    def torch_threads(self, stage: StageConfig) -> int:
        """Intra-op threads of one replica: as configured, or the cores shared by every process
        replica of the engine (several processes each using every core run several times slower)."""
        return stage.runtime.torch_threads or max(1, (os.cpu_count() or 1) // max(1, self._process_replicas))

    def client(
        self, stage: StageConfig, replica_id: int, generation: int, on_message: OnMessage, on_dead: OnDead
    ) -> StageClient:
        return ProcessStageClient(stage, replica_id, generation, on_message, on_dead, self)

    def settle(self, out: StageOutput, consumer: StageConfig | None) -> StageOutput:
        if consumer is not None and self.passes_shm(consumer):
            return out  # its arrays go on as handles; the consumer releases them
        # Shared-memory arrays have one owner: the caller, or several stages, each get a copy.
        return shm.materialize(out)

    def passes_shm(self, stage: StageConfig) -> bool:
        """Whether ``stage`` maps this engine's shared memory (a process replica over ipc)."""
        return self.shm_prefix is not None and stage.runtime.backend == self.name and _transport(stage) == "ipc"


class ProcessStageClient(StageClient):
    """A replica in its own process, reached over ZMQ PUSH/PULL sockets."""

    def __init__(
        self,
        stage: StageConfig,
        replica_id: int,
        generation: int,
        on_message: OnMessage,
        on_dead: OnDead,
        backend: ProcessBackend,
    ) -> None:
        super().__init__(stage, replica_id, on_message, on_dead)
        self._backend = backend
        self._zctx = backend.zmq_context
        self._ipc_dir = backend.ipc_dir
        self._torch_threads = backend.torch_threads(stage)
        self._generation = generation
        # Shared memory only over ipc, and only with the engine's pool for what we send.
        shm_engine = backend.shm_prefix
        use_shm = _transport(stage) == "ipc" and shm_engine is not None
        shm_pool = backend.shm_pool
        self._shm_engine = shm_engine if use_shm else None
        self.shm_prefix = (
            shm.replica_prefix(self._shm_engine, self.stage_id, replica_id, generation) if self._shm_engine else None
        )
        self._resource: int | None = None  # the process's registration with the engine's resources
        self._sent: list[shm.ShmHandle] = []  # handles this replica has not released yet (maybe)
        self._sent_check_at = 256
        self._proc: subprocess.Popen | LaunchedProcess | None = None
        self._pidfd: int | None = None
        self._push: zmq.Socket | None = None
        self._pull: zmq.Socket | None = None
        self._reader: SocketReader | None = None
        self._ready_fut: asyncio.Future | None = None
        self._closing = False
        self._encoder = Encoder(shm_pool if use_shm else None)
        self._decoder = outbound_decoder(self._shm_engine)

    def _bind(self, sock: Any, name: str) -> str:
        if _transport(self.stage) == "tcp":
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
            fut = self._ready_fut
            if fut is not None and fut.done() and not fut.cancelled():
                fut.exception()  # the exit that ended the wait was seen; nobody else will look
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
            log_level=runtime_log_level(),
            shm_prefix=self.shm_prefix,
            shm_engine=self._shm_engine,
        )
        # 2) start the process; its arguments go on stdin as msgpack (nothing is pickled), and it
        #    sees this process's import path so custom runner modules resolve the same way.
        payload = msgspec.msgpack.encode(args)
        launcher = self._backend.launcher
        launched = None
        if _forks(self.stage) and launcher is not None and launcher.alive:
            title = f"omni_runtime.stage.process stage {self.stage_id} replica {self.replica_id}"
            title += f" ({self.stage.model})" if self.stage.model else ""
            # A fork takes milliseconds; a launcher that does not answer within the start-up bound
            # (stopped, stuck) is given up, and this replica is spawned like any after it.
            launched = await launcher.launch(payload, title, self.stage.runtime.startup_timeout_s)
        proc: subprocess.Popen | LaunchedProcess
        if launched is not None:
            proc = launched
            pidfd = os.dup(launched.pidfd)
        else:
            proc = subprocess.Popen(
                [sys.executable, "-m", "omni_runtime.stage.process"],
                stdin=subprocess.PIPE,
                env=child_env(),
                close_fds=True,
            )
            pidfd = os.pidfd_open(proc.pid)
        self._proc = proc
        self._resource = self._backend.resources.add(
            f"stage {self.stage_id} replica {self.replica_id} (pid {proc.pid})", partial(_kill_and_reap, proc)
        )
        # 3) death sentinel first: a pidfd becomes readable when the process exits.
        self._pidfd = pidfd
        loop.add_reader(self._pidfd, self._on_exit)
        self.alive = True
        self._ready_fut = loop.create_future()
        self._reader = SocketReader(self._pull, self._on_frames)
        if isinstance(proc, subprocess.Popen):
            assert proc.stdin is not None
            try:
                proc.stdin.write(payload)  # a few KiB: fits the pipe, never blocks
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it exited at once; the pidfd reports why
        # 4) READY handshake with a time-out.
        timeout = self.stage.runtime.startup_timeout_s
        ready: StageReady = await asyncio.wait_for(asyncio.shield(self._ready_fut), timeout)
        self.ready = ready
        return ready

    def _on_frames(self, frames: list[Any]) -> None:
        try:
            msg = self._decoder.decode(frames)
        except shm.ShmLostError as e:
            msg = self._lost_output(e)
            if msg is None:
                return
        except msgspec.DecodeError as e:
            self._unreadable(frames, e)
            return
        if not isinstance(msg, StageOutput | StageOutputs):
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
        proc, pidfd = self._proc, self._pidfd
        assert proc is not None and pidfd is not None  # set by _start before this reader was added
        loop.remove_reader(pidfd)
        os.close(pidfd)
        self._pidfd = None
        if isinstance(proc, LaunchedProcess):
            code = proc.poll()  # read from the process itself if the launcher has not reaped it
            if code is not None:
                self._exited(proc, code)
                return
            # The launcher reaped it and reports its code a moment later.
            proc.on_exit(lambda code: _call_soon(loop, self._exited, proc, code))
        else:
            self._exited(proc, proc.wait())  # reaps it: no zombie

    def _exited(self, proc: subprocess.Popen | LaunchedProcess, code: int) -> None:
        was_alive, self.alive = self.alive, False
        reason = f"stage {self.stage_id} replica {self.replica_id} (pid {proc.pid}) exited with code {code}"
        if self._ready_fut is not None and not self._ready_fut.done():
            self._await_last_words(reason, asyncio.get_running_loop().time() + _LAST_WORDS_S)
            return
        if was_alive and not self._closing:
            logger.error("%s", reason)
            self._on_dead(self, reason)

    def _await_last_words(self, reason: str, until: float) -> None:
        """A replica that exits before READY has usually said why (its load failed) just before:
        read what has come, and give a message still on its way through the sockets' I/O threads
        until ``until`` (a fresh clone's loaded run saw the exit before the words once), then
        fail with the bare exit."""
        if self._reader is not None:
            self._reader.drain()
        fut = self._ready_fut
        if fut is None or fut.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() < until:
            loop.call_later(0.02, self._await_last_words, reason, until)
            return
        fut.set_exception(StageStartupError(f"{reason} before READY"))

    def _lost_output(self, exc: shm.ShmLostError) -> StageOutput | StageOutputs | None:
        """An output whose shared memory vanished fails its request (every request of its wave,
        which cannot be told apart)."""
        logger.warning("stage %d: %s", self.stage_id, exc)
        message = exc.message
        outputs = message.outputs if isinstance(message, StageOutputs) else [message]
        if not all(isinstance(o, StageOutput) for o in outputs):
            return None
        err = ErrorInfo(type="StageExecutionError", message=f"output lost: {exc}", stage_id=self.stage_id)
        return StageOutputs(outputs=[StageOutput(request_id=o.request_id, error=err) for o in outputs])

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
        if proc is not None and proc.poll() is not None:
            self._backend.resources.discard(self._resource)
        elif proc is not None:
            # Not even SIGKILL ended it within the bound (a process in uninterruptible sleep):
            # never block the loop on it; the engine's resources try again when it stops.
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


async def _wait_exit(proc: subprocess.Popen | LaunchedProcess, timeout: float) -> bool:
    """Wait for ``proc`` to exit without blocking the loop: a pidfd wakes us, no polling. A forked
    replica's exit is its pidfd's too, not its launcher's report, which a stopped launcher never
    sends."""
    if proc.poll() is not None:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    fd = os.pidfd_open(proc.pid) if isinstance(proc, subprocess.Popen) else proc.dup_pidfd()
    if fd is None:
        return True
    try:
        if not await _readable(loop, fd, timeout):
            return False
    finally:
        os.close(fd)
    if isinstance(proc, LaunchedProcess) and proc.poll() is None:
        # Reaped by its launcher a moment ago: its report (the code) is on its way.
        reported: asyncio.Future[None] = loop.create_future()
        proc.on_exit(lambda _: _call_soon(loop, _set_none, reported))
        try:
            await asyncio.wait_for(reported, max(0.0, deadline - loop.time()))
        except TimeoutError:
            return False
    return True


async def _readable(loop: asyncio.AbstractEventLoop, fd: int, timeout: float) -> bool:
    """Whether ``fd`` (a pidfd: the process exited) became readable within ``timeout``."""
    fut = loop.create_future()

    def on_exit() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, on_exit)
    try:
        await asyncio.wait_for(fut, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` on ``loop``, from any thread; dropped if the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _set_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _kill_and_reap(proc: subprocess.Popen | LaunchedProcess) -> None:
    """The last resort at the engine's end: a replica process still running is killed."""
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            logger.error("pid %d did not exit after SIGKILL", proc.pid)


def _remove_stale_ipc_dirs() -> None:
    """Remove socket directories of engines whose process is gone (killed with SIGKILL, say)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_IPC_PREFIX}*-*"):
        pid = path.name.removeprefix(_IPC_PREFIX).split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # another user's live engine
