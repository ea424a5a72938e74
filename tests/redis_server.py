"""A private ``redis-server`` for a test session: a free loopback port, persistence off (or an
append-only file, for the outage tests that kill and restart it), stopped by its PID (SIGTERM,
then SIGKILL after 5 s). ``make test`` installs the Debian package."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, *, appendonly: bool = False) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(self.binary).exists():
            raise RuntimeError("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
        self.dir = Path(tempfile.mkdtemp(prefix="omni-redis-"))
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.appendonly = appendonly
        self._start()

    def _start(self) -> None:
        # A killed test run must not leave the server behind: it lives in its own process group
        # only as long as the session, and the fixture stops it by PID.
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--daemonize", "no",
                "--dir", str(self.dir),
                "--save", "",
                *persistence,
                "--loglevel", "warning",
                "--logfile", str(self.dir / "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._wait_pong(10.0)

    def _wait_pong(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.01)
        self.stop()
        raise TimeoutError("redis-server did not answer PING")

    def kill(self) -> None:
        """SIGKILL: nothing listens on the port until :meth:`restart`."""
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        """The same server again (same port and append-only file), once it answers PING."""
        self._start()

    def kill_and_restart(self, down_s: float) -> None:
        """SIGKILL, ``down_s`` seconds with nothing listening, then the same server again."""
        self.kill()
        time.sleep(down_s)  # the outage itself, not a synchronisation
        self.restart()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def command(self, *args: str) -> bytes:
        """One command in RESP, its raw reply (for ACL set-up in tests)."""
        payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(payload.encode())
            return s.recv(4096)

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused server could not take SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
