"""Fixtures of the reliability tests."""

from __future__ import annotations

import os

import psutil
import pytest

from tests.conftest import children, shm_segments

try:
    from omni_runtime.shm import NAME_ROOT
except ImportError:  # a tree without shared-memory transfer: the names it will use
    NAME_ROOT = "omni_rt"


@pytest.fixture
def no_leaks():
    """The suite's ``no_leaks``, exact on a machine shared with other test runs: no child process
    left, and no /dev/shm segment left of an engine of this process (every segment an engine and
    its stage replicas make is named ``omni_rt-<engine pid>-...``). Segments of other processes'
    engines (another test run at the same time) are not this test's to answer for."""
    ours = f"{NAME_ROOT}-{os.getpid()}-"
    before_shm = shm_segments()
    before = {p.pid for p in children()}
    yield
    leftover = [p for p in children() if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftover, f"child processes left: {[(p.pid, p.cmdline()) for p in leftover]}"
    assert {n for n in shm_segments() - before_shm if n.startswith(ours)} == set()
