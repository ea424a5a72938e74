"""What each kind of process imports: a stage process loads neither janus nor the orchestrator
nor the user-facing layer, and the package root loads that layer only when it is used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # each test starts a fresh interpreter

HEAVY = ("janus", "omni_runtime.engine", "omni_runtime.entrypoints", "fastapi", "uvicorn")


def loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_stage_process_loads_nothing_of_the_callers_side():
    modules = loaded_after(
        "import omni_runtime.stage.process, omni_runtime.stage.worker, omni_runtime.serialization, omni_runtime.shm"
    )
    assert not [m for m in modules if m.startswith(HEAVY)]


def test_the_package_root_loads_the_api_on_first_use():
    assert not [m for m in loaded_after("import omni_runtime") if m.startswith(HEAVY)]
    modules = loaded_after("from omni_runtime import AsyncOmni, Omni, InvalidRequestError")
    assert "omni_runtime.entrypoints.async_omni" in modules and "janus" in modules
