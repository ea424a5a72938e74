"""Small helpers shared by the benchmarks: percentiles, tables, JSON output, a server process."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``omni-runtime serve MODEL [ARGS...]`` in a subprocess, for the duration of a ``with`` block."""

    def __init__(self, model: str, *args: str) -> None:
        self.model = model
        self.args = list(args)
        self.url = f"http://127.0.0.1:{free_port()}"

    def __enter__(self) -> Server:
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve", self.model, "--port", port, *self.args]
        self.log = tempfile.TemporaryFile()  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read()[-2000:].decode(errors='replace')}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise TimeoutError("server did not become healthy")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()
