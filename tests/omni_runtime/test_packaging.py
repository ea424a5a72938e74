"""Every Python package of the source tree is in pyproject.toml's explicit ``packages`` list: one
left out works in a checkout (and an editable install) but is missing from a built wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_of_the_tree_is_listed_in_pyproject():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    roots = {"omni_runtime": REPO / "omni_runtime"} | {
        name: REPO / folder for name, folder in setuptools["package-dir"].items()
    }
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root)
            found.add(".".join((name, *relative.parts)) if relative.parts else name)
    assert found - listed == set(), "packages missing from pyproject.toml's [tool.setuptools] packages"
