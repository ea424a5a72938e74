"""Shared fixtures. Engines are expensive (processes, models): keep them module-scoped."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from omni_runtime.config import DeployConfig, parse_config

REPO = Path(__file__).resolve().parent.parent


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
    """This runtime's shared-memory segments (other programs' files in /dev/shm are not ours)."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith(("omni", "psm_"))}
    except FileNotFoundError:
        return set()


@pytest.fixture
def no_leaks():
    """Asserts that a test leaves no child process and no new /dev/shm segment behind."""
    before_shm = shm_segments()
    before = {p.pid for p in children()}  # module-scoped engines may already be running
    yield
    leftover = [p for p in children() if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftover, f"child processes left: {[(p.pid, p.cmdline()) for p in leftover]}"
    assert shm_segments() - before_shm == set()
