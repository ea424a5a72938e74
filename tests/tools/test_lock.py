"""The package lock (tools/lock.py): its parsing and comparison, the committed locks, and the gate's
check against a real interpreter's packages. That the 3.12 lock resolves again from binary wheels
is checked by make test itself, beside the suite (it waits on the package index, not on a core)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tools import lock

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_parse_lock_reads_pins_and_skips_comments():
    text = "# header\n\nTorch==2.13.0+cpu\nzope.interface==8.0  # a comment\n"
    assert lock.parse_lock(text) == {"torch": "2.13.0+cpu", "zope-interface": "8.0"}


@pytest.mark.unit
@pytest.mark.parametrize("line", ["torch>=2", "torch", "==1.0", "torch==", "torch==1; python_version<'3.12'"])
def test_parse_lock_refuses_anything_but_exact_pins(line):
    with pytest.raises(ValueError, match="line 1"):
        lock.parse_lock(line)


@pytest.mark.unit
def test_compare_names_each_difference():
    locked = {"torch": "2.13.0+cpu", "numpy": "2.4.0", "redis": "8.1.0"}
    installed = {"torch": "2.14.0", "numpy": "2.4.0", "left-pad": "1.0", "omni-runtime": "0.1.0"}
    assert lock.compare(installed, locked) == [
        "left-pad 1.0: installed, not in the lock",
        "redis 8.1.0: in the lock, not installed",
        "torch: installed 2.14.0, locked 2.13.0+cpu",
    ]
    assert lock.compare(locked, locked) == []


@pytest.mark.unit
@pytest.mark.parametrize("python", lock.PYTHONS)
def test_each_lock_pins_every_declared_dependency(python):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    pins = lock.read_lock(python)
    names = {lock.normalize(Requirement(r).name) for r in requirements}
    assert names - pins.keys() == set()
    # The CPU machines' torch is their CPU build; the GPU machines run 2.11 on 3.12.
    assert pins["torch"] == {"3.11": "2.13.0+cpu", "3.12": "2.11.0"}[python]
    assert not [name for name in pins if name.startswith("nvidia-")] or python == "3.12"


def _check(tmp_path: Path, fake: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``tools/lock.py check`` in this interpreter with ``fake`` distributions first on its path."""
    for name, version in fake.items():
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, str(REPO / "tools" / "lock.py"), "check"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.integration
def test_the_test_environment_is_exactly_its_lock(tmp_path):
    out = _check(tmp_path, {})
    assert out.returncode == 0, out.stderr


@pytest.mark.integration
def test_a_newer_or_unlocked_package_fails_the_check_by_name(tmp_path):
    out = _check(tmp_path, {"torch": "99.0", "left_pad": "1.0"})
    assert out.returncode == 1
    assert "torch: installed 99.0, locked 2.13.0+cpu" in out.stderr
    assert "left-pad 1.0: installed, not in the lock" in out.stderr
    assert "make lock" in out.stderr
