"""The GPU kit's dry run (benchmarks/gpu.py --tiny on the CPU): every part runs its code path on the
tiny configs and records figures or a reason it was skipped, none an error; what the figures are
worth is for the GPU run (docs/benchmarks.md, "GPU")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.gpu import PARTS
from tests.conftest import REPO

pytestmark = pytest.mark.integration

#: A guard against a hung dry run, not a timing: it takes about 20 s on two cores with the
#: suite's other worker busy (the subprocess's start and imports included).
DRY_RUN_S = 90


def test_the_dry_run_records_every_part_and_no_error(tmp_path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--tiny", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=DRY_RUN_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["parts"]) == {part.key for part in PARTS} | {"h"}
    for key, part in results["parts"].items():
        assert part["status"] in ("ok", "skipped"), (key, part.get("error"), part.get("traceback"))
        if part["status"] == "skipped":
            assert part["reason"], key
            continue
        assert part["rows"], key
        for row in part["rows"]:
            # A row holds figures, or says why it was left out (float8 on a CPU).
            assert "error" not in row, (key, row)
            assert row.get("skipped") or any(isinstance(v, int | float) for v in row.values()), (key, row)
    assert results["parts"]["h"]["rows"][0]["leftover_processes"] == 0
    assert (out / "results.md").read_text().count("\n## ") == len(results["parts"])
