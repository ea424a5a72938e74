"""Shared fixtures, and the markers of every test file by its path.

Engines are expensive (processes, models): keep them module-scoped. A test's kind follows from
where it lives (:data:`MARKERS`), so ``pytest -m unit`` does not even import the files of the
other kinds: no torch, no processes, seconds for the whole selection.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
import pytest
from _pytest.mark.expression import Expression

from omni_runtime.config import DeployConfig, parse_config

REPO = Path(__file__).resolve().parent.parent

#: How each test file is marked: the first rule whose path (relative to the repository) starts
#: with the prefix wins. ``unit``: pure logic, milliseconds, no process and no model.
MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tests/reliability/test_http_", ("reliability", "e2e")),
    ("tests/reliability/test_soak.py", ("reliability", "slow")),
    ("tests/reliability/", ("reliability",)),
    ("tests/entrypoints/openai/", ("e2e",)),
    ("tests/entrypoints/jobs/test_memory_store.py", ("unit",)),
    ("tests/entrypoints/jobs/test_follow.py", ("unit",)),
    ("tests/entrypoints/test_cli.py", ("e2e",)),
    ("tests/entrypoints/test_cli_lora.py", ("e2e",)),
    ("tests/entrypoints/", ("integration",)),
    ("tests/omni_runtime/models/", ("integration",)),
    ("tests/omni_runtime/stage/runners/", ("integration",)),
    ("tests/omni_runtime/engine/test_orchestrator.py", ("integration",)),
    ("tests/omni_runtime/engine/test_stage_client.py", ("integration",)),
    ("tests/omni_runtime/engine/backends/", ("integration",)),
    ("tests/omni_runtime/test_processes.py", ("integration",)),
    ("tests/omni_runtime/", ("unit",)),
)


def markers_for(path: Path) -> tuple[str, ...]:
    try:
        relative = path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return ()
    return next((marks for prefix, marks in MARKERS if relative.startswith(prefix)), ())


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m EXPR``, a test file whose markers cannot match is not imported at all."""
    expr = config.option.markexpr
    if not expr or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    marks = set(markers_for(collection_path))
    return None if Expression.compile(expr).evaluate(lambda name, **_: name in marks) else True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for mark in markers_for(item.path):
            item.add_marker(mark)


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = "condition"
) -> float:
    """Wait until ``predicate()`` (a bool, or a coroutine giving one) holds; returns the seconds it took."""
    start = time.monotonic()
    while not await _value(predicate()):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout:g} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _value(x: bool | Awaitable[bool]) -> bool:
    return await x if inspect.isawaitable(x) else x


def make_config(stages: list[dict], **top: object) -> DeployConfig:
    """A DeployConfig from plain dicts (validated like a YAML file)."""
    return parse_config({"stage_args": stages, **top}, source="test")


def echo_stage(stage_id: int = 0, **overrides: object) -> dict:
    stage = {
        "stage_id": stage_id,
        "stage_type": "echo",
        "final_output": True,
        "final_output_type": "text",
        "runtime": {"backend": "process", "torch_threads": 1},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(stage.get(key), dict):
            stage[key] = {**stage[key], **value}
        else:
            stage[key] = value
    return stage


def children() -> list[psutil.Process]:
    return psutil.Process(os.getpid()).children(recursive=True)


def shm_segments() -> set[str]:
    """This runtime's shared-memory segments (other programs' files in /dev/shm are not ours).

    Under pytest-xdist another worker's engines make segments of their own at any time: a
    segment named for a live process outside this worker's process tree is that worker's."""
    try:
        names = {name for name in os.listdir("/dev/shm") if name.startswith(("omni", "psm_"))}
    except FileNotFoundError:
        return set()
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return names
    mine = {os.getpid()} | {p.pid for p in children()}
    return {name for name in names if _owner(name) in mine or not psutil.pid_exists(_owner(name) or 0)}


def _owner(segment: str) -> int | None:
    """The pid a segment's name starts with (``omni_rt-<pid>-...``), if any."""
    parts = segment.split("-")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server for the whole session (started on first use, stopped by PID)."""
    from tests.redis_server import RedisServer

    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def no_leaks():
    """Asserts that a test leaves no child process and no new /dev/shm segment behind."""
    before_shm = shm_segments()
    before = {p.pid for p in children()}  # module-scoped engines may already be running
    yield
    leftover = [p for p in children() if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftover, f"child processes left: {[(p.pid, p.cmdline()) for p in leftover]}"
    assert shm_segments() - before_shm == set()


class FakeClock:
    """A clock in seconds that moves only when told, in milliseconds (for the pure schedulers)."""

    def __init__(self) -> None:
        self.ms = 0.0

    def __call__(self) -> float:
        return self.ms / 1000.0

    def advance(self, ms: float) -> None:
        self.ms += ms


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory):
    """A private builtin-model cache for the module (stage processes inherit it through the
    environment) and one torch thread in this process: intra-op threads that wait for each
    other slow down badly on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_RUNTIME_CACHE", str(path))
        yield path
    torch.set_num_threads(threads)
