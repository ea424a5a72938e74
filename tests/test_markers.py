"""The suite's own rules (tests/conftest.py): a test's kind follows what it does, and a unit test
that starts a process or builds a model fails."""

from __future__ import annotations

import multiprocessing
import subprocess

import pytest

from tests.conftest import KINDS, REPO, possible_markers

pytestmark = pytest.mark.unit

REGISTERED = frozenset({*KINDS, "reliability", "slow"})


def test_a_unit_test_that_starts_a_process_fails() -> None:
    with pytest.raises(AssertionError, match="a unit test starts a process"):
        subprocess.run(["true"], check=True)
    with pytest.raises(AssertionError, match="a unit test starts a process"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_unit_test_that_builds_a_model_fails(tmp_path) -> None:
    from omni_runtime.models import builtin

    with pytest.raises(AssertionError, match="a unit test builds a builtin model"):
        builtin.builder("tiny-sd")(tmp_path)


def test_a_file_that_declares_its_kind_is_read_without_importing_it() -> None:
    # Under tests/omni_runtime/ (unit by its path), but it loads tiny-sd and says so.
    steps = possible_markers(REPO / "tests/omni_runtime/stage/test_worker_steps.py", REGISTERED)
    assert frozenset({"integration"}) in steps
    # One test of it starts an interpreter and says so; the others are unit.
    images = possible_markers(REPO / "tests/omni_runtime/test_params_images.py", REGISTERED)
    assert set(images) >= {frozenset({"unit"}), frozenset({"integration"})}
    # A file that uses a process fixture (redis-server) is integration, whatever its folder.
    redis = possible_markers(REPO / "tests/entrypoints/jobs/test_redis_store.py", REGISTERED)
    assert frozenset({"integration"}) in redis
    soak = possible_markers(REPO / "tests/reliability/test_soak.py", REGISTERED)
    assert soak == (frozenset({"reliability", "integration", "slow"}),)


def test_this_test_is_unit(request: pytest.FixtureRequest) -> None:
    assert [m.name for m in request.node.iter_markers() if m.name in KINDS] == ["unit"]
