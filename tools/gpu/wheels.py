"""Download the CPython 3.12 wheels a GPU machine lacks, at the versions of the 3.12 lock.

    python tools/gpu/wheels.py --lock locks/py3.12.txt --names tools/gpu/wheels.txt --dest .whl

The GPU machines have no network: these wheels travel with the working tree (64 MiB in all), so
the set is only what the GPU kit's run imports, and its size is checked against a budget.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lock import normalize, parse_lock  # tools/ is not a package: its folder is put on the path

#: manylinux tags of x86-64 wheels, newest first: pip matches a platform tag exactly, so every
#: glibc level a wheel may be tagged with is named.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
#: What travels beside the working tree (the limit is 64 MiB with the source).
BUDGET_MIB = 48


def wanted(names_file: Path, lock: dict[str, str]) -> list[str]:
    """``name==version`` for each name listed (comments and blank lines skipped), from the lock."""
    pins = []
    for raw in names_file.read_text().splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        version = lock.get(normalize(name))
        if version is None:
            raise SystemExit(f"{names_file}: {name} is not in the lock")
        pins.append(f"{name}=={version}")
    return pins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lock", type=Path, required=True)
    parser.add_argument("--names", type=Path, required=True)
    parser.add_argument("--dest", type=Path, required=True)
    args = parser.parse_args()
    pins = wanted(args.names, parse_lock(args.lock.read_text()))
    args.dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", "-d", str(args.dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + pins, check=True)
    # One version of each: a wheel left from an older lock would stop the install there.
    keep = {normalize(p.split("==")[0]).replace("-", "_") + "-" + p.split("==")[1] for p in pins}
    total = 0
    for wheel in sorted(args.dest.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        if f"{normalize(name).replace('-', '_')}-{version}" not in keep:
            wheel.unlink()
            continue
        total += wheel.stat().st_size
    print(f"{args.dest}: {len(pins)} wheels, {total / 2**20:.1f} MiB")
    if total > BUDGET_MIB * 2**20:
        print(f"over the {BUDGET_MIB} MiB budget: leave out what the GPU kit's run does not import", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
