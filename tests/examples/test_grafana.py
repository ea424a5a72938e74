"""examples/observability/grafana_dashboard.json, read as Grafana reads it: it parses, has the
dashboard page's charts, picks a model through its ``model`` variable, and every panel's query
names only metrics of docs/observability.md's table (``rate`` only over counters and histograms).
test_prometheus.py runs the same queries against a live Prometheus."""

from __future__ import annotations

import re

import pytest

from tests.observability import REPO, dashboard, documented, queries, row_of

pytestmark = pytest.mark.unit

#: The server's own dashboard page, whose charts the Grafana dashboard draws.
PAGE = REPO / "entrypoints" / "openai" / "web" / "dashboard.js"
_METRIC = re.compile(r"\bomni_\w+")
_RATED = re.compile(r"\b(?:rate|irate|increase)\((omni_\w+)")


def page_charts() -> list[str]:
    """The titles of the page's charts (its ``CHARTS``), in its order."""
    source = PAGE.read_text()
    block = source[source.index("const CHARTS = [") :]
    return re.findall(r'title: "([^"]+)"', block[: block.index("];")])


def test_it_has_the_dashboard_pages_charts_each_with_a_query() -> None:
    board = dashboard()
    assert len(page_charts()) == 8
    assert [p["title"] for p in board["panels"]] == page_charts()
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in board["panels"]:
        assert panel["type"] == "timeseries" and panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


def test_a_template_variable_picks_the_model_and_every_query_reads_it() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    model = variables["model"]
    listed = re.fullmatch(r"label_values\((omni_\w+), model\)", model["query"]["query"])
    assert listed is not None and "model" in documented()[listed.group(1)].labels
    for title, expr in queries(board):
        assert expr.count("omni_") == expr.count('model=~"$model|"'), (title, expr)


def test_every_query_names_documented_metrics_and_rates_only_counters_and_histograms() -> None:
    rows = documented()
    for title, expr in queries(dashboard()):
        names = _METRIC.findall(expr)
        assert names, (title, expr)
        for name in names:
            assert row_of(name, rows) is not None, f"{title}: {name} is not in docs/observability.md"
        for name in _RATED.findall(expr):
            row = row_of(name, rows)
            assert row is not None and row.type in ("counter", "histogram"), f"{title}: rate over {name}"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), (title, expr)
