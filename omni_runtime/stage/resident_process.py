"""The resident program of a ``worker`` stage: one child in a process group of its own, spoken to
in JSON lines (its standard input and output), its standard error kept as a bounded tail.

Used by :class:`~omni_runtime.stage.runners.resident.ResidentRunner` in the stage worker's
forward thread. Every pipe is non-blocking and waited on with one selector: a program that stops
reading its input or floods its output never blocks the thread, and a line longer than
``max_line_bytes`` is a broken protocol (:attr:`ResidentProcess.failure`), not memory.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from collections.abc import Mapping

from omni_runtime.stage.program_run import stop_group

_CHUNK = 1 << 16


class ResidentProcess:
    """A started program (``start_new_session``) with a line protocol over its pipes."""

    def __init__(
        self,
        argv: list[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        max_line_bytes: int,
        max_stderr_bytes: int,
    ) -> None:
        self.max_line_bytes = max_line_bytes
        self.max_stderr_bytes = max_stderr_bytes
        #: Why the protocol broke (a line too long, its input closed), or None.
        self.failure: str | None = None
        #: When its standard output reached its end (it can answer nothing more), or None.
        self.output_closed_at: float | None = None
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=dict(env),
            start_new_session=True,
            close_fds=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        self._in, self._out, self._err = self.proc.stdin.fileno(), self.proc.stdout.fileno(), self.proc.stderr.fileno()
        for fd in (self._in, self._out, self._err):
            os.set_blocking(fd, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._out, selectors.EVENT_READ)
        self._selector.register(self._err, selectors.EVENT_READ)
        self._partial = bytearray()
        self._stderr = bytearray()
        self._unsent = bytearray()
        self._writing = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def stderr_tail(self) -> str:
        return self._stderr.decode("utf-8", "replace").strip()

    def send(self, line: bytes) -> None:
        """Queue one line for the program's input (written as its pipe takes it)."""
        self._unsent += line
        self._flush()

    def poll(self, timeout: float) -> list[bytes]:
        """The complete lines the program wrote within ``timeout`` seconds (none: it was quiet)."""
        lines: list[bytes] = []
        if not self._selector.get_map():
            time.sleep(timeout)  # nothing left to wait on: the caller's loop must not spin
            return lines
        for key, events in self._selector.select(timeout):
            if events & selectors.EVENT_WRITE:
                self._flush()
            if events & selectors.EVENT_READ:
                self._read(key.fd, lines)
        return lines

    def stop(self, grace_s: float) -> None:
        """Stop its whole group (SIGTERM, then SIGKILL after ``grace_s``)."""
        self._selector.close()
        stop_group(self.proc, grace_s)

    def _read(self, fd: int, lines: list[bytes]) -> None:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        if not chunk:
            self._selector.unregister(fd)
            if fd == self._out:
                self.output_closed_at = time.monotonic()
            return
        if fd == self._err:
            self._stderr += chunk
            del self._stderr[: max(len(self._stderr) - self.max_stderr_bytes, 0)]
            return
        self._partial += chunk
        complete: list[bytes] = []
        if b"\n" in chunk:  # only when a line ends: split at every read, a long line cost its square
            *complete, rest = bytes(self._partial).split(b"\n")
            lines.extend(complete)
            self._partial = bytearray(rest)
        if len(self._partial) > self.max_line_bytes or any(len(c) > self.max_line_bytes for c in complete):
            self.failure = f"wrote a line past {self.max_line_bytes} bytes to its standard output"

    def _flush(self) -> None:
        try:
            while self._unsent:
                written = os.write(self._in, self._unsent)
                del self._unsent[:written]
        except BlockingIOError:
            pass
        except (BrokenPipeError, OSError):
            self.failure = self.failure or "closed its standard input"
            self._unsent.clear()
        want = bool(self._unsent)
        if want != self._writing and self.failure is None:
            if want:
                self._selector.register(self._in, selectors.EVENT_WRITE)
            else:
                self._selector.unregister(self._in)
            self._writing = want
