"""This process's one connection to Ray, shared by every engine in it. Any thread.

``ray.init`` and ``ray.shutdown`` act on the whole process, while a process may hold several
engines that start and close on their own (and a start may fail). So the connection is counted:
the first engine that needs it connects (or starts a private local cluster), later ones share
it, and only the last one's :func:`release` disconnects. A local cluster started here is then
stopped for good: its processes are waited for (the agents Ray leaves behind for minutes are
terminated) and its temp dir is removed unless the config named one to keep.

A connection the application made itself (Ray already initialised) is used as it is and never
shut down. Every connect is bounded by the caller's timeout and fails with StageStartupError.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any

from omni_runtime.exceptions import ConfigError, StageStartupError

logger = logging.getLogger(__name__)

#: Seconds the processes of a stopped local cluster get to exit before they are terminated,
#: and again before they are killed.
_EXIT_GRACE_S = 3.0


def ray_module() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "a stage has `runtime.backend: ray` but Ray is not installed: pip install 'omni_runtime[ray]'"
        ) from None
    return ray


class _Owner(threading.Thread):
    """Connects, holds the connection until told to let go, then disconnects: one thread for the
    connection's whole life, because Ray's local cluster processes get SIGKILL (``PR_SET_PDEATHSIG``)
    when the thread that started them ends, such as an engine's executor thread at its close."""

    def __init__(self, ray: Any, kwargs: dict[str, Any], temp_dir: str | None, remove_temp_dir: bool) -> None:
        super().__init__(name="ray-connection", daemon=True)
        self._ray, self._kwargs = ray, kwargs
        self.temp_dir, self._remove_temp_dir = temp_dir, remove_temp_dir
        self.connected = threading.Event()  # ray.init returned or raised
        self.error: BaseException | None = None
        self.let_go = threading.Event()  # set by the last user, or by a connect given up on

    def run(self) -> None:
        try:
            self._ray.init(**self._kwargs)
        except BaseException as e:
            self.error = e
        self.connected.set()
        if self.error is None:
            self.let_go.wait()
            _disconnect(self._ray, self.temp_dir)
        if self.temp_dir and self._remove_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        elif self.temp_dir:
            logger.info("the local Ray cluster's sessions (logs) are kept in %s", self.temp_dir)


class _Connection:
    """What this process holds of Ray (guarded by ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.address: str | None = None
        #: The thread holding a connection made here (None: none, or the application's own).
        self.owner: _Owner | None = None
        #: A connect given up on at its time-out, still running (it lets go when it ends).
        self.abandoned: _Owner | None = None


_conn = _Connection()

#: Seconds the last release waits for the disconnect (it bounds each of its own waits).
_DISCONNECT_WAIT_S = 60.0


def acquire(address: str, timeout: float, temp_dir: str | None = None) -> None:
    """Join (or start, for ``local``) the cluster at ``address`` for one more user, within
    ``timeout`` seconds. Blocking: call it off an event loop. ``temp_dir``: where a local cluster
    keeps its sessions, kept after it stops (None: a fresh directory, removed)."""
    deadline = time.monotonic() + timeout
    if not _conn.lock.acquire(timeout=timeout):
        raise StageStartupError(f"another engine of this process was still connecting to Ray after {timeout:g} s")
    try:
        ray = ray_module()
        if _conn.abandoned is not None:
            _conn.abandoned.join(max(0.0, deadline - time.monotonic()))
            if _conn.abandoned.is_alive():
                raise StageStartupError(
                    f"an earlier attempt to connect to Ray at {_conn.address!r} has not ended yet "
                    f"(still running after this engine's {timeout:g} s)"
                )
            _conn.abandoned = None
        if _conn.users == 0 and not ray.is_initialized():
            _conn.owner = _connect(ray, address, deadline, timeout, temp_dir)
            _conn.address = address
        elif _conn.owner is not None and address not in ("auto", _conn.address):
            raise StageStartupError(
                f"this process is already connected to Ray at {_conn.address!r} (ray_address); a process "
                f"joins one cluster, so an engine cannot use {address!r} beside it"
            )
        _conn.users += 1
    finally:
        _conn.lock.release()


def release() -> None:
    """One user fewer; the last one disconnects, and stops a local cluster started here."""
    with _conn.lock:
        _conn.users = max(0, _conn.users - 1)
        owner = _conn.owner
        if _conn.users > 0 or owner is None:
            return
        _conn.owner = None
        owner.let_go.set()
        owner.join(_DISCONNECT_WAIT_S)
        if owner.is_alive():
            logger.warning("Ray did not disconnect within %g s", _DISCONNECT_WAIT_S)


def _connect(ray: Any, address: str, deadline: float, timeout: float, temp_dir: str | None) -> _Owner:
    kwargs: dict[str, Any] = {"address": address, "log_to_driver": True}
    made_temp_dir = False
    if address == "local":
        # Said explicitly: ray.init() without an address would follow RAY_ADDRESS, or a cluster
        # file some other process left. The temp dir is this cluster's own; Ray's socket paths
        # must fit 107 bytes, so it is short and under the system temp dir.
        if temp_dir is None:
            temp_dir, made_temp_dir = tempfile.mkdtemp(prefix="omr-ray-"), True
        kwargs["_temp_dir"] = temp_dir
    else:
        _probe(address, deadline, timeout)
        temp_dir = None
    owner = _Owner(ray, kwargs, temp_dir, made_temp_dir)
    owner.start()
    if not owner.connected.wait(max(0.0, deadline - time.monotonic())):
        owner.let_go.set()  # whenever it connects, it disconnects again at once
        _conn.abandoned, _conn.address = owner, address
        raise StageStartupError(
            f"could not connect to Ray at {address!r} within {timeout:g} s (runtime.startup_timeout_s)"
        )
    if owner.error is not None:
        owner.join()
        error = owner.error
        raise StageStartupError(f"could not connect to Ray at {address!r}: {type(error).__name__}: {error}") from error
    return owner


def _probe(address: str, deadline: float, timeout: float) -> None:
    """Fail at once, or within the bound, when nothing listens at ``host:port``: Ray itself keeps
    retrying for a minute and then ends the whole process."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")  # what ray.init(address="auto") would follow
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # discovered by Ray itself (auto without RAY_ADDRESS): bounded by the connect's time-out
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, deadline - time.monotonic())):
            pass
    except OSError as e:
        raise StageStartupError(
            f"no Ray cluster answers at {address!r} ({type(e).__name__}: {e}; waited at most {timeout:g} s)"
        ) from None


def _disconnect(ray: Any, temp_dir: str | None) -> None:
    """Disconnect; for a local cluster started here (its sessions in ``temp_dir``), make sure its
    processes are gone: Ray's shutdown leaves its agents to exit by themselves minutes later."""
    procs = _cluster_processes(temp_dir) if temp_dir else []
    try:
        ray.shutdown()
    except Exception:
        logger.exception("ray.shutdown failed")
    if procs:
        _stop(procs)


def _cluster_processes(temp_dir: str) -> list[Any]:
    """The processes of the local cluster whose sessions live in ``temp_dir``: every process
    started with that path on its command line, and their descendants (workers rename theirs)."""
    import psutil

    found: dict[int, Any] = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in proc.info["cmdline"] or ()):
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
        except psutil.Error:
            continue
    found.pop(os.getpid(), None)
    return list(found.values())


def _stop(procs: list[Any]) -> None:
    """Wait for ``procs`` to exit (ray.shutdown signalled most of them), then terminate, then kill
    what is left, each by its own PID."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=_EXIT_GRACE_S)
    for sig in ("terminate", "kill"):
        if not alive:
            return
        for proc in alive:
            try:
                getattr(proc, sig)()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=_EXIT_GRACE_S)
    for proc in alive:
        logger.warning("a process of the local Ray cluster did not exit: pid %d", proc.pid)
