"""docs/observability.md's table of every ``/metrics`` series and the example Grafana dashboard
(examples/observability/), read as data: the tests that hold them to the registry, to a live
Prometheus and to each other share it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "observability.md"
DASHBOARD = REPO / "examples" / "observability" / "grafana_dashboard.json"
#: The suffixes of a histogram's series, and of the ``_created`` gauge of a counter or histogram.
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_ROW = re.compile(r"^\| `(omni_\w+)` \| (\w+) \| ([^|]*) \| ([^|]+) \| ([^|]+) \|$")


@dataclass(frozen=True)
class Documented:
    """One row: the name a query uses (a counter's with ``_total``), type, labels on a server
    with several models, unit."""

    name: str
    type: str
    labels: frozenset[str]
    unit: str


def documented() -> dict[str, Documented]:
    """Every row of the metrics table, by name (a name twice is an error)."""
    rows: dict[str, Documented] = {}
    for line in DOC.read_text().splitlines():
        if (m := _ROW.match(line)) is None:
            continue
        name, kind, labels, unit, _ = m.groups()
        assert name not in rows, f"{name} is in the table twice"
        rows[name] = Documented(name, kind, frozenset(re.findall(r"`(\w+)`", labels)), unit.strip())
    return rows


def row_of(series: str, rows: dict[str, Documented]) -> Documented | None:
    """The row a series name Prometheus stores belongs to: its own, its histogram's (``_bucket``,
    ``_sum``, ``_count``), or the counter's or histogram's whose ``_created`` gauge it is."""
    if series in rows:
        return rows[series]
    for suffix in HISTOGRAM_SUFFIXES:
        base = series.removesuffix(suffix)
        if base != series and rows.get(base, _NONE).type == "histogram":
            return rows[base]
    if series.endswith("_created"):
        base = series.removesuffix("_created")
        for name in (base + "_total", base):
            if name in rows and rows[name].type in ("counter", "histogram"):
                return rows[name]
    return None


_NONE = Documented("", "", frozenset(), "")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of the dashboard ``board``."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]
