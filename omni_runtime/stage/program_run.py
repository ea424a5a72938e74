"""One run of an external program: a child in a session (and process group) of its own, its
standard output and error drained into bounded buffers, its output files watched for size, and
the whole group stopped with SIGTERM, then SIGKILL after a grace period.

Used by the ``subprocess`` runner (:mod:`omni_runtime.stage.runners.program`) in the stage
worker's forward thread: :class:`RunSet` waits on every run of a wave at once (one selector over
their pipes), so a wave's programs run side by side and a run that ends wakes the thread at once.
Nothing here knows what the program is for; the runner decides what a limit passed means.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: Bytes read from a pipe at a time.
_CHUNK = 1 << 16
#: Seconds between two looks at a group that is being stopped.
_STOP_POLL_S = 0.01
#: Seconds a run whose leader has exited may still hold its pipes open (a child it left behind)
#: before the rest of its group is killed.
_LINGER_S = 0.5


@dataclass
class Limits:
    """What one run may do (the stage's ``runner_args``)."""

    timeout_s: float
    kill_grace_s: float
    max_stdout_bytes: int
    max_stderr_bytes: int
    max_output_bytes: int


@dataclass
class _Pipe:
    data: bytearray = field(default_factory=bytearray)
    #: Bytes read and dropped past the limit.
    dropped: int = 0
    open: bool = True


class ProgramRun:
    """One child process in its own process group (``start_new_session``): started at once,
    waited on by a :class:`RunSet`, stopped with :meth:`stop`."""

    def __init__(
        self,
        argv: list[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        stdin: Path | None,
        limits: Limits,
        watch: Iterable[Path] = (),
    ) -> None:
        self.limits = limits
        self.watch = tuple(watch)
        #: Why the run was stopped early (a limit it passed, an abort), or None.
        self.failure: str | None = None
        self.timed_out = False
        self.started = time.monotonic()
        self._exited_at: float | None = None
        with open(stdin if stdin is not None else os.devnull, "rb") as stdin_file:
            # argv only, never a shell: each element reaches the program as one argument.
            self.proc = subprocess.Popen(
                argv,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=dict(env),
                start_new_session=True,
                close_fds=True,
            )
        self.pgid = self.proc.pid  # a session leader's group id is its pid
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._out, self._err = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        self._pipes = {self._out: _Pipe(), self._err: _Pipe()}
        for fd in self._pipes:
            os.set_blocking(fd, False)

    @property
    def stdout(self) -> bytes:
        return bytes(self._pipes[self._out].data)

    @property
    def stderr_tail(self) -> str:
        """What the program wrote to its standard error (at most ``max_stderr_bytes``), as text."""
        pipe = self._pipes[self._err]
        text = pipe.data.decode("utf-8", "replace").strip()
        return text + (f" [... {pipe.dropped} more bytes]" if pipe.dropped else "")

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def fds(self) -> list[int]:
        return list(self._pipes)

    def open_fds(self) -> list[int]:
        return [fd for fd, pipe in self._pipes.items() if pipe.open]

    def read(self, fd: int) -> None:
        """Read what ``fd`` holds now; past the standard output's limit the run fails."""
        pipe = self._pipes[fd]
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        if not chunk:
            pipe.open = False
            return
        if fd == self._out:
            if len(pipe.data) + len(chunk) > self.limits.max_stdout_bytes:
                self.failure = (
                    self.failure or f"wrote more than {self.limits.max_stdout_bytes} bytes to its standard output"
                )
                pipe.dropped += len(chunk)
                return
        else:
            room = max(self.limits.max_stderr_bytes - len(pipe.data), 0)
            pipe.dropped += max(len(chunk) - room, 0)
            chunk = chunk[:room]
        pipe.data += chunk

    def check(self, now: float) -> None:
        """Limits that are not reads: time, and the output files' sizes."""
        if self.failure is not None:
            return
        if now - self.started > self.limits.timeout_s:
            self.timed_out = True
            self.failure = f"ran past its timeout of {self.limits.timeout_s:g} s"
            return
        for path in self.watch:
            try:
                size = path.lstat().st_size
            except OSError:
                continue
            if size > self.limits.max_output_bytes:
                self.failure = f"wrote {path.name} past {self.limits.max_output_bytes} bytes"
                return

    def done(self, now: float) -> bool:
        """Whether the run is over: its leader exited and its pipes are closed (or stayed open past
        a short linger: a child it left behind holds them), or it was stopped."""
        if self.proc.poll() is None:
            return False
        if self._exited_at is None:
            self._exited_at = now
        return not self.open_fds() or now - self._exited_at > _LINGER_S

    def stop(self) -> None:
        """Stop the whole group: SIGTERM, SIGKILL after ``kill_grace_s``, and reap the leader. Also
        what ends a run that finished, for whatever it left behind in its group."""
        stop_group(self.proc, self.limits.kill_grace_s)
        for pipe in self._pipes.values():
            pipe.open = False


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop the process group ``proc`` leads (``start_new_session``): SIGTERM, SIGKILL after
    ``grace_s``; ``proc`` reaped and its pipes closed. A group already gone costs nothing."""
    pgid = proc.pid
    if group_alive(pgid) or proc.poll() is None:
        signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # a zombie leader still counts as a member of its group
            if not group_alive(pgid):
                break
            time.sleep(_STOP_POLL_S)
        else:
            signal_group(pgid, signal.SIGKILL)
    proc.wait()
    # Members outside the leader (reparented to init) go as soon as they are killed.
    deadline = time.monotonic() + 1.0
    while group_alive(pgid) and time.monotonic() < deadline:
        signal_group(pgid, signal.SIGKILL)
        time.sleep(_STOP_POLL_S)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


def group_alive(pgid: int) -> bool:
    """Whether a process that is not a zombie is in the group ``pgid``. A zombie has ended: an
    orphan's waits for whoever adopted it to reap it, which is not this process."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after it.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class RunSet:
    """The runs of one wave, waited on together: one selector over every open pipe, so a run that
    writes or ends wakes the wait at once, and the limits and ``cancelled`` are looked at every
    ``tick_s`` at least."""

    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s = tick_s
        self._selector = selectors.DefaultSelector()
        self._runs: dict[str, ProgramRun] = {}

    def add(self, key: str, run: ProgramRun) -> None:
        self._runs[key] = run
        for fd in run.open_fds():
            self._selector.register(fd, selectors.EVENT_READ, run)

    def wait(self, cancelled: Callable[[str], bool]) -> dict[str, ProgramRun]:
        """Run every run to its end; each is stopped (its group gone) before this returns. A run
        whose key ``cancelled`` says is cancelled is stopped with ``failure`` set."""
        pending = dict(self._runs)
        try:
            while pending:
                # 1) read what the pipes hold (a closed pipe reads empty: unregister it)
                for key, _ in self._selector.select(self.tick_s):
                    run: ProgramRun = key.data
                    run.read(key.fd)
                    if key.fd not in run.open_fds():
                        self._selector.unregister(key.fd)
                # 2) limits, cancellation, ends
                now = time.monotonic()
                for name, run in list(pending.items()):
                    if run.failure is None and cancelled(name):
                        run.failure = "cancelled"
                    run.check(now)
                    if run.failure is not None or run.done(now):
                        self._finish(run)
                        del pending[name]
        finally:
            for run in pending.values():  # an error above: nothing is left running
                run.failure = run.failure or "stopped"
                self._finish(run)
            self._selector.close()
        return self._runs

    def _finish(self, run: ProgramRun) -> None:
        for fd in run.open_fds():
            try:
                run.read(fd)  # what is already there, then no more
            finally:
                self._selector.unregister(fd)
        for fd in run.fds():
            if fd in self._selector.get_map():
                self._selector.unregister(fd)
        run.stop()
