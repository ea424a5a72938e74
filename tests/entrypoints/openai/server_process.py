"""A real ``omni-runtime serve`` in a subprocess on a free localhost port, for the e2e tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml

REPO = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "omni_runtime.entrypoints.cli"]

#: A line the runtime writes: its log format (a stage's, or the server's) with one of its loggers.
RUNTIME_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ (stage\d+\.\d+ )?omni_runtime[\w.]*: ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def one_thread_config(path: Path, name: str = "tiny-sd", **engine_args: object) -> str:
    """The bundled config ``name`` with one torch thread in each stage (intra-op threads that wait
    for each other slow down badly on a busy machine) and ``engine_args`` over its own, written to
    ``path``; the path, for ``serve``."""
    config = yaml.safe_load((REPO / "stage_configs" / f"{name}.yaml").read_text())
    for stage in config["stage_args"]:
        stage["runtime"] = {**stage.get("runtime", {}), "torch_threads": 1}
        stage["engine_args"] = {**stage.get("engine_args", {}), **engine_args}
    return str(write_config(path, config))


def flaky_echo_config(path: Path, delay_ms: float, **runtime: object) -> Path:
    """One echo stage whose prompts can say ``hang`` (blocks until aborted) or ``poison`` (raises);
    see tests/helpers.py. No restarts, so a killed stage stays dead."""
    return write_config(
        path,
        {
            "model": "flaky-echo",
            "stage_args": [
                {
                    "stage_id": 0,
                    "stage_type": "tests.helpers:FlakyRunner",
                    "runtime": {"backend": "process", "torch_threads": 1, "max_restarts": 0, **runtime},
                    "engine_args": {"max_num_seqs": 8, "request_batch_max_wait_ms": 0},
                    "final_output": True,
                    "final_output_type": "text",
                    "default_sampling_params": {"delay_ms": delay_ms},
                }
            ],
        },
    )


class ServerProcess:
    """``omni-runtime serve ARGS --port <free>``; output goes to ``log``. Its environment is this
    one without ``$OMNI_RUNTIME_API_KEY`` (the server's key is what ``args`` say), plus ``env``."""

    def __init__(self, *args: str, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        inherited = {k: v for k, v in os.environ.items() if k != "OMNI_RUNTIME_API_KEY"}
        env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [*CLI, "serve", *args, "--port", str(self.port)],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log()[-3000:]}")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stage_processes(self) -> list[psutil.Process]:
        return [p for p in self.children() if "omni_runtime.stage.process" in " ".join(p.cmdline())]

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it hangs (and fail through the return code)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait_stopped(timeout)

    def wait_stopped(self, timeout: float = 30.0) -> int:
        """Wait for the exit a SIGTERM already asked for; SIGKILL if it hangs (return code -9)."""
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9


def assert_gone(processes: list[psutil.Process], timeout: float = 10.0) -> None:
    """Every process in ``processes`` has exited (zombies count as gone)."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left running: {[(p.pid, p.cmdline()) for p in alive]}"


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def start_server(*args: str, log: Path) -> ServerProcess:
    server = ServerProcess(*args, log=log)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def start_servers(*specs: tuple[tuple[str, ...], Path]) -> list[ServerProcess]:
    """Several servers, ``(args, log)`` each, started at once: their imports and model loads
    overlap instead of queueing. All are healthy on return, or all are stopped and it raises."""
    servers: list[ServerProcess] = []
    try:
        for args, log in specs:
            servers.append(ServerProcess(*args, log=log))
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def stop_server(server: ServerProcess) -> None:
    """Stop a module's server: exit status 0 and no stage process left behind."""
    stop_servers(server)


def stop_servers(*servers: ServerProcess) -> None:
    """:func:`stop_server` for each, their shutdowns overlapping: every one is signalled first."""
    children = [server.children() for server in servers]
    for server in servers:
        if server.proc.poll() is None:
            server.signal(signal.SIGTERM)
    codes = [server.wait_stopped() for server in servers]
    for server, rc in zip(servers, codes, strict=True):
        assert rc == 0, f"server exit status {rc}:\n{server.log()[-3000:]}"
    for processes in children:
        assert_gone(processes)
