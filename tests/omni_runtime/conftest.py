"""Fixtures of the omni_runtime tests."""

from __future__ import annotations

import gc

import pytest

from omni_runtime import shm
from tests.conftest import shm_segments


@pytest.fixture
def engine():
    """An engine prefix whose segments are all gone after the test."""
    before = shm_segments()
    prefix = shm.engine_prefix()
    yield prefix
    shm.unlink_prefix(prefix + "-")
    gc.collect()
    assert shm_segments() - before == set()


@pytest.fixture
def pool(engine):
    p = shm.ShmPool(shm.orchestrator_prefix(engine))
    yield p
    p.close()
