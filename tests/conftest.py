"""Shared fixtures, and the markers of every test: by what it does, with its path as the default.

Engines are expensive (processes, models): keep them module-scoped. A test's kind is

- what its file or the test itself declares (``pytestmark = pytest.mark.integration``, or a
  decorator): a file that loads a model or starts a process says so wherever it lives;
- else ``integration`` if it uses a fixture that starts a process or loads a model
  (:data:`FIXTURE_KINDS`);
- else what its path says (:data:`MARKERS`).

``unit`` means no child process and no model: :func:`_unit_guard` makes a unit test that starts a
process or builds or loads a model fail. ``pytest -m unit`` does not even import a file that cannot
hold a unit test (its path, the marks and fixtures named in its source say so, read without
importing it): no torch, no processes, seconds for the whole selection.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import multiprocessing.process
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from _pytest.mark.expression import Expression

from omni_runtime.config import DeployConfig, parse_config

REPO = Path(__file__).resolve().parent.parent

#: The kinds of test; every test has one (``reliability`` and ``slow`` come on top).
KINDS = ("unit", "integration", "e2e")

#: The default markers of a test file: the first rule whose path (relative to the repository)
#: starts with the prefix wins. A file or test that declares a kind, or uses a fixture of
#: :data:`FIXTURE_KINDS`, has that kind instead of the path's.
MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tests/reliability/test_http_", ("reliability", "e2e")),
    ("tests/reliability/test_soak.py", ("reliability", "integration", "slow")),
    ("tests/reliability/", ("reliability", "integration")),
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

#: Fixtures that start a process or load a model: a test that uses one is of this kind.
FIXTURE_KINDS: dict[str, str] = {
    "model_cache": "integration",  # builtin models are built and loaded into it
    "redis_server": "integration",  # a redis-server process
    "ray_cluster": "integration",  # a private Ray cluster (tests/omni_runtime/engine/backends/)
}

_MARK_IN_SOURCE = re.compile(r"pytest\.mark\.(\w+)")


def markers_for(path: Path) -> tuple[str, ...]:
    """The markers a file's path gives its tests (:data:`MARKERS`)."""
    try:
        relative = path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return ()
    return next((marks for prefix, marks in MARKERS if relative.startswith(prefix)), ())


@functools.cache
def possible_markers(path: Path, registered: frozenset[str]) -> tuple[frozenset[str], ...]:
    """Every set of markers a test of this file may end up with, read from its path and its source
    text (the registered marks it names, the fixtures of :data:`FIXTURE_KINDS` it mentions)
    without importing it: one kind each, the path's other markers, and any of the others named."""
    by_path = set(markers_for(path))
    try:
        source = path.read_text(errors="replace")
    except OSError:
        return (frozenset(by_path),)
    named = set(_MARK_IN_SOURCE.findall(source)) & registered
    used = {kind for name, kind in FIXTURE_KINDS.items() if re.search(rf"\b{name}\b", source)}
    always = by_path - set(KINDS)
    kinds = (by_path | named | used) & set(KINDS) or {""}
    optional = sorted(named - set(KINDS) - always)
    subsets = [{m for i, m in enumerate(optional) if bits >> i & 1} for bits in range(2 ** len(optional))]
    return tuple(frozenset((always | {kind} | sub) - {""}) for kind in sorted(kinds) for sub in subsets)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m EXPR``, a test file none of whose tests can match is not imported at all."""
    expr = config.option.markexpr
    if not expr or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    registered = frozenset(line.split(":")[0].strip() for line in config.getini("markers"))
    compiled = Expression.compile(expr)
    for marks in possible_markers(collection_path, registered):
        if compiled.evaluate(lambda name, marks=marks, **_: name in marks):
            return None
    return True


def kinds_of(item: pytest.Item) -> tuple[str, ...]:
    """The markers :func:`pytest_collection_modifyitems` adds to a test (see the module's doc)."""
    declared = {m.name for m in item.iter_markers() if m.name in KINDS}
    by_path = markers_for(item.path)
    extra = tuple(m for m in by_path if m not in KINDS)
    if declared:
        return extra
    used = sorted({FIXTURE_KINDS[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURE_KINDS})
    return (*extra, *used) if used else by_path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        for mark in kinds_of(item):
            item.add_marker(mark)
        if item.get_closest_marker("unit") and FIXTURE_KINDS.keys() & set(getattr(item, "fixturenames", ())):
            wrong.append(item.nodeid)
    if wrong:
        raise pytest.UsageError(f"declared unit but using a process or model fixture: {wrong}")
    items[:] = heaviest_files_first(items)


#: The files that take longest (seconds of one worker, a quiet fresh-clone run), longest first.
#: ``make test`` hands files to its two workers in collection order (``--no-loadscope-reorder``):
#: a long file started last would leave one worker busy while the other has nothing left, so
#: these go first, then every other file that starts processes, and the unit files fill the end.
HEAVIEST_FILES = (
    "tests/omni_runtime/engine/backends/test_ray.py",
    "tests/entrypoints/test_cli.py",
    "tests/entrypoints/openai/test_jobs_outage.py",
    "tests/entrypoints/openai/test_jobs_redis.py",
    "tests/entrypoints/test_batching.py",
    "tests/omni_runtime/models/test_families.py",
    "tests/omni_runtime/models/test_fake_family.py",
    "tests/entrypoints/test_step_batching.py",
    "tests/entrypoints/test_split_pipeline.py",
    "tests/entrypoints/openai/test_http_videos.py",
    "tests/entrypoints/openai/test_jobs.py",
    "tests/entrypoints/openai/test_jobs_hostile.py",
    "tests/entrypoints/openai/test_pages.py",
    "tests/entrypoints/openai/test_http_espeak.py",
    "tests/omni_runtime/stage/test_rank_group.py",
    "tests/entrypoints/test_multistage.py",
)


def heaviest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with whole files reordered (a file's own order kept): :data:`HEAVIEST_FILES`,
    then the files with a test that is not ``unit``, then the rest."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}

    def key(entry: tuple[int, str]) -> tuple[int, int, int]:
        position, name = entry
        if name in rank:
            return (0, rank[name], position)
        light = all(item.get_closest_marker("unit") for item in files[name])
        return (2 if light else 1, 0, position)

    order = sorted(enumerate(files), key=key)
    return [item for _, name in order for item in files[name]]


#: Where the libraries' model classes live (``from_pretrained`` loads a model).
_MODEL_CLASSES = (
    ("diffusers.pipelines.pipeline_utils", "DiffusionPipeline"),
    ("diffusers.models.modeling_utils", "ModelMixin"),
    ("transformers.modeling_utils", "PreTrainedModel"),
)


class UnitTestViolation(AssertionError):
    """A ``unit`` test did what only an integration or e2e test may."""


@pytest.fixture(autouse=True)
def _unit_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``unit`` test fails when it starts a child process, builds a builtin model or loads a
    model: it belongs to ``integration`` (see the module's doc)."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*_: object, **__: object) -> Any:
            raise UnitTestViolation(f"a unit test {what}: mark it integration (tests/conftest.py)")

        return refused

    before = {p.pid for p in children()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", refuse("starts a process"))
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse("starts a process"))
        mp.setattr("omni_runtime.models.builtin.builder", refuse("builds a builtin model"))
        for module, cls in _MODEL_CLASSES:
            if module in sys.modules:  # only patched where loaded: importing them takes seconds
                mp.setattr(getattr(sys.modules[module], cls), "from_pretrained", refuse("loads a model"))
        yield
    started = [p.pid for p in children() if p.pid not in before]
    if started:
        raise UnitTestViolation(f"a unit test left child processes {started}: mark it integration")


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


def has_progress(outputs: Iterable[Any]) -> bool:
    """Whether any of a request's outputs so far reports denoising progress (a step of a running
    forward): what a test waits for instead of sleeping until a request "must be" running."""
    return any(out.progress is not None and not out.progress.stage_done for out in outputs)


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


def stage_processes() -> list[psutil.Process]:
    """The stage replicas among this process's descendants (not their launcher)."""
    found = []
    for p in children():
        try:
            if "omni_runtime.stage.process" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


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
