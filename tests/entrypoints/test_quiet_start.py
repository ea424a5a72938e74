"""A quiet start: at the default log level the runtime's own lines only, the libraries' warnings
at ``debug``, and torchao imported only by a process whose stage quantizes
(omni_runtime/logs.py, omni_runtime/stage/optional_imports.py). A server's own default is checked
on the running server of tests/entrypoints/openai/test_http_images.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.entrypoints.openai.server_process import REPO, RUNTIME_LINE


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


DEBUG_SCRIPT = """
import logging
from omni_runtime.logs import configure_logging

configure_logging(logging.DEBUG, "%(levelname)s %(name)s: %(message)s")
import diffusers.models.modeling_utils  # noqa: F401
logging.getLogger("transformers.probe").debug("a library's debug line")
logging.getLogger("omni_runtime.probe").debug("the runtime's debug line")
"""


def test_at_debug_the_libraries_lines_come_through() -> None:
    """The other side of the quiet start (serve's default is checked on a running server in
    tests/entrypoints/openai/test_http_images.py): at debug every library speaks, from its import on."""
    run = subprocess.run([sys.executable, "-c", DEBUG_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    # transformers prints its records with a handler and format of its own.
    assert "a library's debug line" in run.stderr
    assert "omni_runtime.probe: the runtime's debug line" in run.stderr
    # What the libraries log as they import is not held back either.
    imports = [line for line in run.stderr.splitlines() if "debug line" not in line]
    assert len(imports) > 3, run.stderr[-3000:]
