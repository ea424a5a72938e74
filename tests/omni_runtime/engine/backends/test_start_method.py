"""How a process replica starts (``runtime.start_method``): ``auto`` forks a stage on the CPU from
the stage launcher and spawns one on an accelerator, whose CUDA a fork could not use once the
launcher's imports initialized it (every engine of the first GPU run failed that way)."""

from __future__ import annotations

import pytest

from omni_runtime.engine.backends.process import _forks
from tests.conftest import echo_stage, make_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("runtime", "forks"),
    [
        ({}, True),
        ({"devices": "cpu"}, True),
        ({"devices": "cuda:0"}, False),
        ({"devices": "cuda"}, False),
        ({"devices": "cpu,cuda:1"}, False),
        ({"devices": "cuda:0", "start_method": "fork"}, True),
        ({"devices": "cpu", "start_method": "spawn"}, False),
        ({"devices": "cuda:0", "start_method": "auto"}, False),
    ],
)
def test_auto_forks_on_the_cpu_and_spawns_on_an_accelerator(runtime, forks):
    [stage] = make_config([echo_stage(runtime=runtime)]).stage_args
    assert _forks(stage) is forks
