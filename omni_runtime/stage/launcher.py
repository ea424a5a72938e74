"""The stage launcher: one process per engine that imports what the stage runners need once, then
forks every process replica of the engine from there.

A stage process started from scratch spends most of its start-up importing torch, diffusers and
transformers (about 3.5 s of a 5 s tiny-sd start on a 2-core machine), and a replica that is
restarted after a crash pays it again. Forked from the launcher, a replica starts with those
modules already imported and only loads its model: the engine's second and later replicas, and
every restart, skip the imports. The launcher itself starts with the engine and imports while
the engine sets up the rest.

Protocol (a ``SOCK_SEQPACKET`` socket pair, one msgpack message per packet, nothing pickled):
the engine sends :class:`Preload` once, then a :class:`Launch` per replica; the launcher answers
each with :class:`Launched` (the child's pid, with a pidfd for it passed as ``SCM_RIGHTS``) or
:class:`LaunchFailed`, and reports every child's exit with :class:`Exited` (its code as
``subprocess`` reports it: negative for a signal). It reaps its children itself, so no zombie
outlives an exit report.

Lifetime: the launcher dies with the engine (``PR_SET_PDEATHSIG``) and exits when the engine
closes its end; each child dies with the launcher in the same way, so a SIGKILLed engine leaves
nothing behind. Children carry their own process title (``omni_runtime.stage.process stage S
replica R``), so ``ps`` tells them apart from the launcher.

What a forked replica does not get that a spawned one does: environment changes made in the
engine's process after the engine started (a replica sees the environment of the engine's start).
``runtime.start_method: spawn`` starts each replica as a fresh interpreter instead.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

import msgspec

from omni_runtime.logs import configure_logging
from omni_runtime.stage.lifetime import die_with_parent
from omni_runtime.stage.process import run_stage_process

logger = logging.getLogger("omni_runtime.stage.launcher")

#: Largest message: a Launch carries a stage config, a few KiB.
MAX_PACKET = 1 << 20


class Preload(msgspec.Struct, tag="preload", kw_only=True):
    """The engine's process-backed stages (StageConfigs as builtins): what to import before forking."""

    stages: list[Any]


class Launch(msgspec.Struct, tag="launch", kw_only=True):
    token: int
    #: A msgpack-encoded ``StageProcessArgs``.
    args: bytes
    title: str


class Launched(msgspec.Struct, tag="launched", kw_only=True):
    token: int
    pid: int


class LaunchFailed(msgspec.Struct, tag="failed", kw_only=True):
    token: int
    error: str


class Exited(msgspec.Struct, tag="exited", kw_only=True):
    pid: int
    code: int


ToLauncher = Preload | Launch
FromLauncher = Launched | LaunchFailed | Exited


def set_title(title: str) -> None:
    """Name this process in ``ps`` (best effort)."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass


def preload(stages: list[Any]) -> None:
    """Import each stage's runner and what its ``preload`` names. Best effort: a stage whose
    imports fail here fails the same way in its replica, which reports it."""
    # lazy: numpy, yaml and the runtime's modules load after main() set up the process (its
    # parent-death signal, its logging); the engine imports this module for its messages only.
    from omni_runtime.config import StageConfig
    from omni_runtime.stage.optional_imports import keep_out_unrequested
    from omni_runtime.stage.runners.base import runner_class

    configs: list[tuple[Any, StageConfig | None]] = []
    for raw in stages:
        try:
            configs.append((raw, msgspec.convert(raw, StageConfig)))
        except Exception as e:
            configs.append((raw, None))
            logger.info("launcher: could not preload stage %s: %s: %s", raw.get("stage_id"), type(e).__name__, e)
    # Decided once for every replica forked from here: they share what this process imports.
    keep_out_unrequested(stage for _, stage in configs if stage is not None)
    for raw, stage in configs:
        if stage is None:
            continue
        try:
            runner_class(stage.stage_type).preload(stage)
        except Exception as e:
            logger.info("launcher: could not preload stage %s: %s: %s", raw.get("stage_id"), type(e).__name__, e)


class _Launcher:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder: msgspec.msgpack.Decoder[Preload | Launch] = msgspec.msgpack.Decoder(Preload | Launch)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd

    def send(self, msg: FromLauncher, fds: list[int] | None = None) -> None:
        data = self.encoder.encode(msg)
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.send(data)
        except OSError:
            pass  # the engine is gone; we exit on the next read

    def serve(self) -> None:
        while True:
            readable, _, _ = select.select([self.sock.fileno(), self.wake_r], [], [])
            if self.wake_r in readable:
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
                self.reap()
            if self.sock.fileno() in readable:
                try:
                    data = self.sock.recv(MAX_PACKET)
                except ConnectionError:
                    # The engine closed its end with our reports unread in it: gone, as at a close.
                    data = b""
                if not data:  # the engine closed its end (or died)
                    self.reap_before_exit()
                    return
                try:
                    msg = self.decoder.decode(data)
                except msgspec.DecodeError as e:
                    logger.warning("launcher: dropped a malformed message: %s", e)
                    continue
                if isinstance(msg, Preload):
                    preload(msg.stages)
                else:
                    self.launch(msg)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.send(Exited(pid=pid, code=os.waitstatus_to_exitcode(status)))

    def reap_before_exit(self, within_s: float = 0.5) -> None:
        """Collect the replicas that have exited before this process goes. The engine closes its
        replicas (reading their exits from pidfds) before it closes the launcher, and their
        SIGCHLD may come after its close: a replica not collected here would be left a zombie,
        handed to an init that may never collect it. One still running is not waited for past
        ``within_s`` (the engine kills what it started)."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return  # no child left
            if pid == 0:
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.01)

    def launch(self, msg: Launch) -> None:
        try:
            pid = os.fork()
        except OSError as e:
            self.send(LaunchFailed(token=msg.token, error=f"fork failed: {e}"))
            return
        if pid == 0:
            self._child(msg)  # never returns
        # The child cannot have been reaped yet (only reap() does that), so the pidfd is its.
        pidfd = os.pidfd_open(pid)
        try:
            self.send(Launched(token=msg.token, pid=pid), [pidfd])
        finally:
            os.close(pidfd)

    def _child(self, msg: Launch) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.sock.close()
            set_title(msg.title)
            run_stage_process(msg.args)  # ends the process itself
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)


def main() -> None:
    """``python -m omni_runtime.stage.launcher FD [LEVEL]``: FD is this end of the engine's socket
    pair, LEVEL the engine's log level (a number; default INFO)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides how its stages stop
    # Before anything is preloaded: libraries read their log level as they are imported.
    level = int(sys.argv[2]) if len(sys.argv) > 2 else logging.INFO
    configure_logging(level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_title("omni_runtime stage launcher")
    sock = socket.socket(fileno=int(sys.argv[1]))
    _Launcher(sock).serve()
    logging.shutdown()
    os._exit(0)  # skip the teardown of everything preloaded


if __name__ == "__main__":
    main()
