"""What each kind of process imports, and how the project's modules import each other.

A stage process loads neither janus nor the orchestrator nor the user-facing layer, and the package
root loads that layer only when it is used (fresh interpreters). The import graph of
``omni_runtime/`` and ``entrypoints/`` has no cycle, and a project import inside a function says
why it is there (``# lazy: <why>``, on its line or just above): read from the sources with
``ast``, nothing imported, milliseconds.
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("janus", "omni_runtime.engine", "omni_runtime.entrypoints", "fastapi", "uvicorn")
#: The project's packages: folder -> the name it is imported as (``entrypoints/`` is installed as
#: ``omni_runtime.entrypoints``).
PACKAGES = {"omni_runtime": "omni_runtime", "entrypoints": "omni_runtime.entrypoints"}
#: What a function-level project import's comment starts with.
LAZY = "# lazy:"


def loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.integration  # a fresh interpreter
def test_a_stage_process_loads_nothing_of_the_callers_side():
    modules = loaded_after(
        "import omni_runtime.stage.process, omni_runtime.stage.worker, omni_runtime.serialization, omni_runtime.shm"
    )
    assert not [m for m in modules if m.startswith(HEAVY)]


@pytest.mark.integration  # a fresh interpreter
def test_the_package_root_loads_the_api_on_first_use():
    assert not [m for m in loaded_after("import omni_runtime") if m.startswith(HEAVY)]
    modules = loaded_after("from omni_runtime import AsyncOmni, Omni, InvalidRequestError")
    assert "omni_runtime.entrypoints.async_omni" in modules and "janus" in modules


# ---------------------------------------------------------------------------- the import graph


@dataclass(frozen=True)
class ProjectImport:
    """One import of a project module: where it is, what it imports, whether inside a function."""

    module: str
    path: Path
    line: int
    target: str
    in_function: bool
    lazy_comment: bool


def project_modules(root: Path, packages: dict[str, str]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's ``__init__``)."""
    modules = {}
    for folder, name in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            modules[".".join((name, *parts[: -1 if is_package else None]))] = (path, is_package)
    return modules


def _comment(line: str) -> str:
    """The comment on a line of an import statement, or a comment line ("" if none)."""
    return "#" + line.partition("#")[2] if "#" in line else ""


_ImportNode = ast.Import | ast.ImportFrom


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], in_function: bool = False) -> Iterator[tuple[_ImportNode, bool]]:
    """Every import statement and whether it is inside a function; not those under
    ``if TYPE_CHECKING:`` (they never run). Statements only: an expression holds no import."""
    for stmt in body:
        if isinstance(stmt, _ImportNode):
            yield stmt, in_function
        elif isinstance(stmt, ast.If) and _is_type_checking(stmt):
            yield from _import_nodes(stmt.orelse, in_function)
        else:
            inner = in_function or isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
            blocks = [getattr(stmt, name, []) for name in ("body", "orelse", "finalbody")]
            blocks += [part.body for part in (*getattr(stmt, "handlers", ()), *getattr(stmt, "cases", ()))]
            for block in blocks:
                yield from _import_nodes(block, inner)


def project_imports(root: Path = REPO, packages: dict[str, str] = PACKAGES) -> list[ProjectImport]:
    """Every import of one project module by another, read from the sources."""
    modules = project_modules(root, packages)
    aliases = {folder: name for folder, name in packages.items() if folder != name}

    def known(name: str) -> str | None:
        for folder, installed in aliases.items():
            if name == folder or name.startswith(folder + "."):
                name = installed + name[len(folder) :]
        while name and name not in modules:  # a module's attribute: its module
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for module, (path, is_package) in modules.items():
        source = path.read_text()
        tree = ast.parse(source, str(path))
        lines = source.splitlines()
        nodes = list(_import_nodes(tree.body))
        starts = {node.end_lineno: node.lineno for node, _ in nodes}  # a run of imports shares a comment
        package = module if is_package else module.rpartition(".")[0]
        for node, in_function in nodes:
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                targets = [known(f"{base}.{alias.name}") for alias in node.names]  # a name, or a module
            above = node.lineno - 1
            while above in starts:
                above = starts[above] - 1
            block = []
            while above > 0 and lines[above - 1].lstrip().startswith("#"):
                block.append(lines[above - 1].lstrip())
                above -= 1
            own = [_comment(lines[n - 1]) for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)]
            lazy = any(c.startswith(LAZY) for c in [*own, *block])
            for target in dict.fromkeys(t for t in targets if t is not None and t != module):
                found.append(ProjectImport(module, path, node.lineno, target, in_function, lazy))
    return found


@functools.cache
def repo_imports() -> tuple[ProjectImport, ...]:
    return tuple(project_imports())


def import_cycles(imports: list[ProjectImport] | tuple[ProjectImport, ...]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) for each group of modules that import each other."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.module, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def strongly_connect(v: str) -> None:  # Tarjan's
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongly_connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            strongly_connect(v)
    cycles = []
    for group in groups:  # a shortest path back to the group's first module
        members, start = set(group), group[0]
        paths = {start: [start]}
        todo = [start]
        cycle = None
        while todo and cycle is None:
            v = todo.pop(0)
            for w in sorted(graph[v] & members):
                if w == start:
                    cycle = [*paths[v], start]
                    break
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    todo.append(w)
        cycles.append(cycle or group)
    return cycles


def _where(imports: tuple[ProjectImport, ...], a: str, b: str) -> str:
    imp = next(i for i in imports if i.module == a and i.target == b)
    return f"{imp.path.relative_to(REPO) if imp.path.is_relative_to(REPO) else imp.path}:{imp.line}"


@pytest.mark.unit
def test_no_import_cycle_among_the_projects_modules():
    imports = repo_imports()
    assert len({i.module for i in imports}) > 100  # the scan found the project
    cycles = [
        " -> ".join(cycle) + " (" + ", ".join(_where(imports, a, b) for a, b in itertools.pairwise(cycle)) + ")"
        for cycle in import_cycles(imports)
    ]
    assert not cycles, "import cycles (move what both need to a module below both):\n" + "\n".join(cycles)


@pytest.mark.unit
def test_every_function_level_project_import_says_why():
    unsaid = [
        f"{i.path.relative_to(REPO)}:{i.line}: {i.module} imports {i.target}"
        for i in repo_imports()
        if i.in_function and not i.lazy_comment
    ]
    assert not unsaid, (
        f"project imports inside a function with no `{LAZY} <why>` comment on the line or just above "
        "(move them to the top unless they keep a library out of a light process):\n" + "\n".join(unsaid)
    )


@pytest.mark.unit
def test_the_checks_find_a_cycle_and_an_unsaid_function_level_import(tmp_path: Path):
    """The two checks above on a made-up package, so that their passing means something."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg import d\n"  # never runs: no edge
        "def f():\n    from .. import c\n"  # pkg.sub.b -> pkg.c, in a function, unsaid
        "def g():\n    # lazy: imports torch\n    import json\n    from pkg import d\n"  # said, for the run
    )
    (pkg / "c.py").write_text("import pkg.a  # lazy: not a function-level import, still an edge\n")
    (pkg / "d.py").write_text("")
    imports = project_imports(tmp_path, {"pkg": "pkg"})
    edges = {(i.module, i.target, i.in_function, i.lazy_comment) for i in imports}
    assert edges == {
        ("pkg.a", "pkg.sub.b", False, False),
        ("pkg.sub.b", "pkg.c", True, False),
        ("pkg.sub.b", "pkg.d", True, True),
        ("pkg.c", "pkg.a", False, True),
    }
    assert import_cycles(imports) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
