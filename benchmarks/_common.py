"""Small helpers shared by the benchmarks: percentiles, tables, JSON output."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary(latencies_ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": pct(latencies_ms, 50),
        "p90_ms": pct(latencies_ms, 90),
        "p99_ms": pct(latencies_ms, 99),
        "mean_ms": statistics.fmean(latencies_ms) if latencies_ms else float("nan"),
    }


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str))
