"""A quiet start: at the default log level the runtime's own lines only, the libraries' warnings
at ``debug``, and torchao imported only by a process whose stage quantizes
(omni_runtime/logs.py, omni_runtime/stage/optional_imports.py). Integration by its path; the
server's tests are e2e."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.entrypoints.openai.server_process import REPO, start_server, stop_server

#: A line the runtime writes: its log format (a stage's, or the server's) with one of its loggers.
RUNTIME_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ (stage\d+\.\d+ )?omni_runtime[\w.]*: ")
#: What uvicorn prints as it starts and stops (``INFO:     Started server process [12]``).
UVICORN_LINE = re.compile(r"^(INFO|WARNING|ERROR): +\S")


def probe_config(path: Path, quantization: dict | None) -> Path:
    """One ImportProbe stage (tests/helpers.py), forked from the launcher like any replica."""
    engine_args = {"quantization": quantization} if quantization else {}
    stage = {
        "stage_id": 0,
        "stage_type": "tests.helpers:ImportProbe",
        "runtime": {"backend": "process", "torch_threads": 1},
        "engine_args": engine_args,
        "final_output": True,
        "final_output_type": "text",
    }
    path.write_text(yaml.safe_dump({"model": "import-probe", "stage_args": [stage]}))
    return path


SCRIPT = """
import json, sys
from omni_runtime import Omni

omni = Omni("tiny-sd")
try:
    [out] = omni.generate("a fox", {"num_inference_steps": 1, "height": 32, "width": 32, "seed": 1})
    assert out.images, out
finally:
    omni.close()
stage = {}
for name, path in (("plain", sys.argv[1]), ("quantized", sys.argv[2])):
    omni = Omni(path)
    try:
        [reply] = omni.collective_rpc("imported", ["torchao"])
        stage[name] = reply.result
    finally:
        omni.close()
print("PROBE " + json.dumps({"parent": "torchao" in sys.modules, "stage": stage}))
"""


def test_an_engine_prints_no_library_lines_and_imports_torchao_only_to_quantize(tmp_path: Path) -> None:
    plain = probe_config(tmp_path / "plain.yaml", None)
    quantized = probe_config(tmp_path / "quantized.yaml", {"quant_type": "int8wo"})
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(plain), str(quantized)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    [probe] = [json.loads(line.removeprefix("PROBE ")) for line in lines if line.startswith("PROBE ")]
    noise = [line for line in lines if not (line.startswith("PROBE ") or RUNTIME_LINE.match(line))]
    assert not noise, "\n".join(noise)
    # The caller's process never imports it; a stage only when it quantizes (the control).
    assert probe == {"parent": False, "stage": {"plain": False, "quantized": True}}


def serve_until_ready(tmp_path: Path, level: str) -> tuple[str, list[str]]:
    """The server's output from its start until it is ready, and the lines of it that are neither
    the runtime's nor uvicorn's."""
    server = start_server("--log-level", level, log=tmp_path / "server.log")
    try:
        log = server.log()
    finally:
        stop_server(server)
    lines = [line for line in log.splitlines() if line.strip()]
    return log, [line for line in lines if not (RUNTIME_LINE.match(line) or UVICORN_LINE.match(line))]


@pytest.mark.e2e
def test_serve_prints_only_its_own_and_uvicorns_lines_until_ready(tmp_path: Path) -> None:
    log, others = serve_until_ready(tmp_path, "info")
    assert not others, "\n".join(others)
    assert "tiny-sd is ready" in log, log


@pytest.mark.e2e
def test_at_debug_the_libraries_lines_come_through(tmp_path: Path) -> None:
    log, others = serve_until_ready(tmp_path, "debug")
    assert any("transformers" in line for line in others), log[-3000:]
    assert any("diffusers" in line or "Registering attention backend" in line for line in others), log[-3000:]
