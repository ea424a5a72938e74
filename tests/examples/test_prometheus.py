"""examples/observability/ against a real ``omni-runtime serve`` of two echo models (with an API
key) and Debian's ``prometheus`` (``make prometheus``), run here on a free port with its own
storage and a 1 s scrape, and stopped by its PID: Prometheus scrapes ``/metrics`` without the
key; the p99 end-to-end latency of the Grafana dashboard's query reads back through the HTTP query
API as a sane number; every query of the dashboard runs; every series scraped is in
docs/observability.md's table and carries the ``model`` label (but HTTP requests on no model)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.entrypoints.openai.server_process import ServerProcess, free_port, stop_server, wait_for
from tests.observability import REPO, dashboard, documented, queries, row_of

pytestmark = pytest.mark.e2e

CONFIG = REPO / "examples" / "observability" / "prometheus.yml"
KEY = "observability-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODELS = ("a", "b")
#: The dashboard's variables, as Grafana fills them in for model ``a``.
VARIABLES = {"$model": "a", "$__rate_interval": "30s"}
WAIT_S = 15.0


class Prometheus:
    """Debian's ``prometheus`` on a free loopback port, with the example's configuration aimed
    at ``target`` and scraping every second, its storage in ``tmp``; stopped by its PID."""

    def __init__(self, target: str, tmp: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed: `make prometheus` installs Debian's package")
        config = yaml.safe_load(CONFIG.read_text())
        config["global"] = {**config["global"], "scrape_interval": "1s", "evaluation_interval": "1s"}
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [target]}]
        self.job = job["job_name"]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = tmp / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if not wait_for(self._ready, timeout=WAIT_S, interval=0.05):
            self.stop()
            raise RuntimeError(f"prometheus did not start:\n{self.log_path.read_text()[-3000:]}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def scraped(self) -> bool:
        """Whether the target's latest scrape succeeded (``up`` is 1)."""
        result = self.query(f'up{{job="{self.job}"}}')
        return bool(result) and result[0]["value"][1] == "1"

    def api(self, path: str, **params: str) -> Any:
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=5.0).json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` gives now."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Prometheus]]:
    tmp = tmp_path_factory.mktemp("observability")
    # Prometheus hands its first targets to its scraper about 5 s after it starts: it starts
    # while the server loads.
    srv = ServerProcess(*(f"{name}=echo" for name in MODELS), "--api-key", KEY, log=tmp / "server.log")
    prom = None
    try:
        prom = Prometheus(f"127.0.0.1:{srv.port}", tmp)
        srv.wait_ready()

        def loaded() -> bool:
            models = httpx.get(f"{srv.url}/v1/models", headers=AUTH).json()["data"]
            return {m["id"]: m["state"] for m in models} == dict.fromkeys(MODELS, "loaded")

        assert wait_for(loaded, timeout=60), srv.log()[-3000:]
        assert wait_for(prom.scraped, timeout=WAIT_S, interval=0.1), prom.query("up")
        yield srv, prom
    finally:
        if prom is not None:
            prom.stop()
        stop_server(srv)


@pytest.fixture(scope="module")
def server(stack: tuple[ServerProcess, Prometheus]) -> ServerProcess:
    return stack[0]


@pytest.fixture(scope="module")
def prometheus(stack: tuple[ServerProcess, Prometheus]) -> Prometheus:
    return stack[1]


def _chat(server: ServerProcess, model: str, n: int) -> None:
    for i in range(n):
        body = {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}]}
        r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json=body, timeout=30.0)
        assert r.status_code == 200, r.text


def _value(prom: Prometheus, expr: str) -> float | None:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else None


def _dashboard_query(title: str, index: int = 0) -> str:
    expr = [e for t, e in queries(dashboard()) if t == title][index]
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def test_it_scrapes_metrics_without_the_api_key(server: ServerProcess, prometheus: Prometheus) -> None:
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the server has a key
    assert prometheus.scraped()
    assert prometheus.query('omni_model_state{model="b", state="loaded"}')[0]["value"][1] == "1"


def test_the_dashboards_p99_latency_reads_back_through_the_query_api(
    server: ServerProcess, prometheus: Prometheus
) -> None:
    # A rate needs two scrapes that differ: a first batch makes model a's histogram, scraped, then
    # a second one moves it.
    count = 'omni_request_e2e_seconds_count{model="a"}'
    _chat(server, "a", 3)
    assert wait_for(lambda: (_value(prometheus, count) or 0) >= 3, timeout=WAIT_S, interval=0.1)
    _chat(server, "a", 5)
    mean, p50, p99 = (_dashboard_query("Latency, end to end", i) for i in (0, 1, 2))
    assert wait_for(lambda: (_value(prometheus, count) or 0) >= 8, timeout=WAIT_S, interval=0.1)
    got = {"mean": _value(prometheus, mean), "p50": _value(prometheus, p50), "p99": _value(prometheus, p99)}
    # An echo answers in milliseconds: the quantiles fall within the histogram's low buckets.
    values = {k: v for k, v in got.items() if v is not None}
    assert values.keys() == got.keys(), got
    assert 0 < values["p50"] <= values["p99"] <= 2.5 and 0 < values["mean"] <= 2.5, got
    assert (_value(prometheus, _dashboard_query("Requests / s")) or 0) > 0
    # Model b ran nothing: its quantile is no number, not a's.
    assert _value(prometheus, p99.replace('"a|"', '"b|"')) is None
    # The HTTP series of a request on a model name it.
    assert prometheus.query('omni_http_requests_total{route="/v1/chat/completions", model="a", status="200"}')


def test_every_dashboard_query_runs(prometheus: Prometheus) -> None:
    answered = set()
    for title, expr in queries(dashboard()):
        for name, value in VARIABLES.items():
            expr = expr.replace(name, value)
        if prometheus.query(expr):  # an error fails in api(); an empty answer is a chart with no line yet
            answered.add(title)
    # The gauges' charts have a line from the first scrape; the rates' need requests (above).
    assert {"Queue depth", "Restarts", "Resident weights"} <= answered


def test_every_scraped_series_is_documented_and_labelled_by_model(prometheus: Prometheus) -> None:
    rows = documented()
    names = [n for n in prometheus.api("label/__name__/values") if n.startswith("omni_")]
    assert [n for n in names if row_of(n, rows) is None] == [], "scraped but not in docs/observability.md"
    unlabelled = prometheus.api("series", **{"match[]": '{__name__=~"omni_.+", model=""}'})
    assert {s["__name__"] for s in unlabelled if not s["__name__"].startswith("omni_http_")} == set(), unlabelled
    # /v1/models is a request on no model: its HTTP series has no model label.
    models = prometheus.query('omni_http_requests_total{route="/v1/models"}')
    assert models and all("model" not in r["metric"] for r in models), models
