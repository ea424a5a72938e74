"""The engine's end of its stage launcher (:mod:`omni_runtime.stage.launcher`).

:class:`LauncherClient` starts the launcher with the engine, asks it for replicas, and reads its
answers on the orchestrator's event loop (and, in the engine's last clean-up, wherever that runs).
:class:`LaunchedProcess` is a forked replica seen through the few ``subprocess.Popen`` methods the
process backend uses (``pid``, ``poll``, ``wait``, ``kill``, ``terminate``, ``returncode``): the
replica is the launcher's child, so its exit code comes from the launcher's report, and signals
go through a pidfd, which can never reach a recycled pid. Its exit is known from the pidfd too:
a launcher that is stopped (SIGSTOP) reports and reaps nothing, and a replica's exit must not wait
for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from omni_runtime.exceptions import StageStartupError
from omni_runtime.stage.launcher import (
    MAX_PACKET,
    Exited,
    FromLauncher,
    Launch,
    Launched,
    LaunchFailed,
    Preload,
)

logger = logging.getLogger(__name__)

#: The code reported for replicas whose launcher died before reporting them: the launcher's death
#: kills them (``PR_SET_PDEATHSIG``), so they ended by SIGKILL.
_KILLED = -signal.SIGKILL


class LaunchedProcess:
    """A replica forked by the launcher."""

    def __init__(self, pid: int, pidfd: int, launcher: LauncherClient) -> None:
        self.pid = pid
        #: Open until the exit is known; readable once the process has exited.
        self.pidfd = pidfd
        self.returncode: int | None = None
        self._launcher = launcher
        self._cond = threading.Condition()
        self._on_exit: list[Callable[[int], None]] = []

    def _exited(self, code: int) -> None:
        with self._cond:
            if self.returncode is not None:
                return
            self.returncode = code
            callbacks, self._on_exit = self._on_exit, []
            os.close(self.pidfd)
            self._cond.notify_all()
        for callback in callbacks:
            callback(code)

    def on_exit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(code)`` once the launcher has reported the exit (at once if it has). It
        may be called from any thread."""
        with self._cond:
            if self.returncode is None:
                self._on_exit.append(callback)
                return
        callback(self.returncode)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._launcher.drain()
        if self.returncode is None:
            code = self._unreported_exit()
            if code is not None:
                self._exited(code)
        return self.returncode

    def dup_pidfd(self) -> int | None:
        """A pidfd of its own for the caller to wait on (None once the exit is known)."""
        with self._cond:
            return None if self.returncode is not None else os.dup(self.pidfd)

    def _unreported_exit(self) -> int | None:
        """The exit code of a process that exited and that its launcher has not reaped (a stopped
        launcher reaps nothing), read from its zombie's ``/proc`` entry; None while it runs, or
        once reaped (the launcher's report is then on its way)."""
        with self._cond:
            if self.returncode is not None or not select.select([self.pidfd], [], [], 0)[0]:
                return None
            try:
                with open(f"/proc/{self.pid}/stat", "rb") as f:
                    stat = f.read()
                # Not reaped after the read, so not before it: the entry was this process's, never
                # a recycled pid's.
                signal.pidfd_send_signal(self.pidfd, 0)
                fields = stat[stat.rindex(b")") + 2 :].split()
                # Field 3 is the state, field 52 (the last) the status as waitpid reports it.
                return os.waitstatus_to_exitcode(int(fields[-1])) if fields[0] == b"Z" else None
            except (OSError, ValueError, IndexError):
                return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            # The event loop may read the report first: wake up now and then to look.
            self._launcher.wait_readable(0.05 if remaining is None else min(remaining, 0.05))
        assert self.returncode is not None
        return self.returncode

    def _signal(self, sig: int) -> None:
        with self._cond:
            if self.returncode is not None:
                return
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass  # exited and reaped; the report is on its way

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)


class LauncherClient:
    """Starts the launcher and asks it for replicas. ``launch`` runs on the orchestrator's loop."""

    def __init__(self, stages: list[Any], env: dict[str, str], log_level: int = logging.INFO) -> None:
        self._stages = stages
        self._env = env
        self._log_level = log_level
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._tokens = 0
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._procs: dict[int, LaunchedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._decoder: msgspec.msgpack.Decoder[Launched | LaunchFailed | Exited] = msgspec.msgpack.Decoder(
            Launched | LaunchFailed | Exited
        )
        #: Launches go to it (False once it died, or was given up for not answering one).
        self.alive = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "omni_runtime.stage.launcher", str(theirs.fileno()), str(self._log_level)],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=self._env,
                close_fds=True,
            )
        finally:
            theirs.close()
        ours.send(msgspec.msgpack.encode(Preload(stages=self._stages)))
        ours.setblocking(False)
        self._sock = ours
        self._loop = loop
        loop.add_reader(ours.fileno(), self.drain)
        self.alive = True

    async def launch(self, args: bytes, title: str, timeout: float) -> LaunchedProcess | None:
        """A replica forked by the launcher; None if it did not answer within ``timeout`` (stopped,
        or stuck): it is then given up, and the caller starts the replica itself. Its answer, if it
        comes later, is a process nobody uses, which is killed."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[LaunchedProcess] = loop.create_future()
        with self._lock:
            if not self.alive or self._sock is None:
                raise StageStartupError("the stage launcher is not running")
            self._tokens += 1
            token = self._tokens
            self._pending[token] = (loop, fut)
            try:
                self._sock.send(msgspec.msgpack.encode(Launch(token=token, args=args, title=title)))
            except OSError as e:
                del self._pending[token]
                raise StageStartupError(f"the stage launcher cannot be reached: {e}") from None
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            if self.alive:
                self.alive = False
                logger.error(
                    "the stage launcher (pid %s) did not answer a launch within %g s; replicas start as new "
                    "processes from now on",
                    *(self.pid, timeout),
                )
            return None

    def wait_readable(self, timeout: float) -> None:
        sock = self._sock
        if sock is None:
            time.sleep(timeout)
            return
        try:
            select.select([sock], [], [], timeout)
        except (OSError, ValueError):
            time.sleep(timeout)

    def drain(self) -> None:
        """Read every answer waiting on the socket (never blocks). Safe from any thread."""
        with self._lock:
            messages: list[tuple[FromLauncher, list[int]]] = []
            gone = False
            while self._sock is not None:
                try:
                    data, fds, _, _ = socket.recv_fds(self._sock, MAX_PACKET, 1)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    gone = True
                    break
                if not data:
                    gone = True
                    break
                try:
                    messages.append((self._decoder.decode(data), fds))
                except msgspec.DecodeError:
                    for fd in fds:
                        os.close(fd)
            exited: list[tuple[LaunchedProcess, int]] = []
            settle: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, Any, BaseException | None]] = []
            for msg, fds in messages:
                if isinstance(msg, Launched):
                    pending = self._pending.pop(msg.token, None)
                    proc = LaunchedProcess(msg.pid, fds[0], self)
                    self._procs[msg.pid] = proc
                    if msg.pid in self._early_exits:
                        exited.append((proc, self._early_exits.pop(msg.pid)))
                    if pending is not None:
                        settle.append((*pending, proc, None))
                elif isinstance(msg, LaunchFailed):
                    pending = self._pending.pop(msg.token, None)
                    if pending is not None:
                        settle.append((*pending, None, StageStartupError(msg.error)))
                elif isinstance(msg, Exited):
                    known = self._procs.pop(msg.pid, None)
                    if known is None:
                        self._early_exits[msg.pid] = msg.code
                    else:
                        exited.append((known, msg.code))
            if gone:
                self._lost()
                exited.extend((proc, _KILLED) for proc in self._procs.values())
                self._procs.clear()
                settle.extend(
                    (*pending, None, StageStartupError("the stage launcher exited"))
                    for pending in self._pending.values()
                )
                self._pending.clear()
        for loop, fut, result, error in settle:
            loop.call_soon_threadsafe(_settle, fut, result, error)
        for proc, code in exited:
            proc._exited(code)

    def _lost(self) -> None:
        """The launcher is gone (it died): stop reading it."""
        if self.alive:
            logger.error("the stage launcher (pid %s) exited; replicas start as new processes from now on", self.pid)
        self.alive = False
        self._detach()

    def _detach(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(sock.fileno())
            except RuntimeError:
                pass  # another thread's loop, already stopping
        sock.close()

    def stop(self) -> None:
        """Launch nothing more and close our end: the launcher exits (its remaining children die
        with it). On the loop that reads it, or once that loop has stopped."""
        with self._lock:
            self.alive = False
            self._detach()  # the reader goes first, so a closed fd is never selected on

    def close(self, timeout: float = 1.0) -> None:
        """:meth:`stop`, then reap the launcher, killing it past ``timeout`` (a stopped launcher
        reads nothing): its replicas are closed already."""
        self.stop()
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
        for launched in list(self._procs.values()):
            launched._exited(_KILLED)
        self._procs.clear()


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        if isinstance(result, LaunchedProcess):
            result.kill()  # its start was given up (a time-out, a cancellation): nobody will use it
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
