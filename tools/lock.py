"""The package lock: every package a virtualenv of this project holds, at one exact version, per Python.

    python tools/lock.py compile       # make lock: resolve pyproject.toml's ranges for each locked Python
    python tools/lock.py sync          # make: this virtualenv holds exactly its lock, and the project
    python tools/lock.py check         # make test: this Python's installed packages are exactly its lock
    python tools/lock.py verify 3.12   # that Python's lock resolves, from binary wheels, to itself

uv resolves and installs. It resolves for a Python and platform other than the one it runs on,
with environment markers evaluated for that target, which pip's ``--python-version`` does not do;
and it installs a lock exactly (``uv pip sync`` removes what the lock does not name) in seconds
where pip took a minute on a new machine. It is told the folders of local wheels pip is configured
with (``find-links``), where this machine keeps the CPU build of torch that the lock's
``torch==...+cpu`` names. The check reads only the standard library, so it runs in a second.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
#: The Pythons locked: the CPU machines run 3.11, the GPU machines 3.12.
PYTHONS = ("3.11", "3.12")
#: Linux x86-64, glibc 2.28 or newer (Debian 12 has 2.36): the platform every lock is for.
PLATFORM = "x86_64-manylinux_2_28"
#: What the virtualenv holds besides pyproject.toml's packages: pip, and the build backend that
#: the editable install of the project uses (installed with --no-build-isolation, so it is locked
#: too rather than fetched anew for each build).
TOOLS = LOCKS / "tools.in"
#: The project itself, installed editable from the working tree: never in its own lock.
PROJECT = "omni-runtime"


def lock_path(python: str) -> Path:
    return LOCKS / f"py{python}.txt"


def normalize(name: str) -> str:
    """A distribution name as the package index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> dict[str, str]:
    """``name==version`` lines, comments and blank lines skipped: {normalized name: version}."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip() or ";" in line:
            raise ValueError(f"lock line {number}: expected NAME==VERSION, got {raw!r}")
        pins[normalize(name.strip())] = version.strip()
    return pins


def compare(installed: dict[str, str], locked: dict[str, str]) -> list[str]:
    """What differs between an environment and its lock, one line per package, sorted by name."""
    problems = []
    for name in sorted(installed.keys() | locked.keys()):
        have, want = installed.get(name), locked.get(name)
        if have == want or name == PROJECT:
            continue
        if want is None:
            problems.append(f"{name} {have}: installed, not in the lock")
        elif have is None:
            problems.append(f"{name} {want}: in the lock, not installed")
        else:
            problems.append(f"{name}: installed {have}, locked {want}")
    return problems


def installed_packages() -> dict[str, str]:
    """{normalized name: version} of every distribution this interpreter can import."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:  # a half-removed distribution leaves a metadata folder without a name
            found.setdefault(normalize(name), dist.version)
    return found


def current_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def read_lock(python: str) -> dict[str, str]:
    path = lock_path(python)
    if not path.exists():
        raise SystemExit(f"no lock for Python {python} ({path.relative_to(REPO)}); locked: {', '.join(PYTHONS)}")
    return parse_lock(path.read_text())


def find_links() -> list[str]:
    """The folders of local wheels pip is configured with (where this machine keeps the CPU build of
    torch), so that uv resolves against the same files pip will install."""
    value = os.environ.get("PIP_FIND_LINKS")
    if value is None:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
        )
        value = out.stdout.strip() if out.returncode == 0 else ""
    return value.split()


def uv_compile(python: str, extra: list[str]) -> str:
    """``uv pip compile`` of pyproject.toml (every extra) and the tools, for ``python`` on Linux x86-64,
    from binary wheels only; the resolved pins as text."""
    command = [
        sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--no-header", "--no-annotate",
        "--all-extras", "--only-binary", ":all:", "--python-version", python, "--python-platform", PLATFORM,
        "-c", str(REPO / "constraints.txt"), str(REPO / "pyproject.toml"), str(TOOLS),
    ]  # fmt: skip
    for folder in find_links():
        command += ["--find-links", folder]
    out = subprocess.run(command + extra, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"uv pip compile for Python {python} failed:\n{out.stderr}")
    return out.stdout


def header(python: str) -> str:
    return (
        f"# The lock for CPython {python} on Linux x86-64: every package `make` installs, at one version.\n"
        "# Made by `make lock` (tools/lock.py) from pyproject.toml, locks/tools.in and constraints.txt;\n"
        "# do not edit by hand.\n"
    )


def compile_locks() -> None:
    for python in PYTHONS:
        pins = uv_compile(python, [])
        lock_path(python).write_text(header(python) + pins)
        print(f"{lock_path(python).relative_to(REPO)}: {len(parse_lock(pins))} packages")


def sync() -> None:
    """Install exactly this Python's lock into the running virtualenv (from binary wheels; what the
    lock does not name is removed), then the project itself, editable, built by the locked setuptools."""
    read_lock(current_python())  # a Python without a lock is told so here
    lock = lock_path(current_python())
    uv = [sys.executable, "-m", "uv", "pip"]
    links = [arg for folder in find_links() for arg in ("--find-links", folder)]
    # Bytecode compiled as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing is cached at
    # import, and every stage process and server would compile torch's sources anew.
    quiet = ["--quiet", "--python", sys.executable, "--compile-bytecode"]
    subprocess.run([*uv, "sync", *quiet, "--only-binary", ":all:", *links, str(lock)], check=True)
    subprocess.run([*uv, "install", *quiet, "--no-deps", "--no-build-isolation", "-e", str(REPO)], check=True)


def verify(python: str) -> list[str]:
    """The lock resolved again with its own pins as constraints: a lock that no longer resolves
    (a release removed, a pyproject range it breaks, a package without a wheel for that Python)
    fails here, and one that resolves to anything but itself is not closed."""
    locked = read_lock(python)
    return compare(parse_lock(uv_compile(python, ["-c", str(lock_path(python))])), locked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("compile", help="resolve pyproject.toml's ranges into a lock per Python")
    sub.add_parser("sync", help="install exactly this Python's lock, then the project (editable)")
    sub.add_parser("check", help="this Python's installed packages are exactly its lock")
    verify_parser = sub.add_parser("verify", help="a lock resolves from binary wheels to itself")
    verify_parser.add_argument("python", choices=PYTHONS)
    args = parser.parse_args(argv)
    if args.command == "compile":
        compile_locks()
        return 0
    if args.command == "sync":
        sync()
        return 0
    if args.command == "verify":
        problems = verify(args.python)
        if problems:
            print(f"{lock_path(args.python).relative_to(REPO)} resolves to another set:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 1 if problems else 0
    python = current_python()
    problems = compare(installed_packages(), read_lock(python))
    if problems:
        print(f"{sys.prefix} differs from {lock_path(python).relative_to(REPO)}:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        print(
            "`make clean test` installs exactly the lock; to move to newer releases, `make lock`, `make test`,\n"
            "and commit the lock with the change (README, 'Upgrading packages').",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
