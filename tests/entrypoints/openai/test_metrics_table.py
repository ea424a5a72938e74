"""docs/observability.md's table of metrics against the server's registry: every family the
server exports has its row (name, type, labels) and every row its family, with a server of
several models and with one (which leaves ``model`` off all but ``omni_model_*``); and every row
keeps the naming conventions (base units at the end, ``_total`` counters)."""

from __future__ import annotations

import pytest
from omni_runtime.entrypoints.model_specs import ModelCounts
from omni_runtime.entrypoints.openai.metrics import ServerMetrics
from omni_runtime.entrypoints.openai.model_metrics import ModelCollector
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime.engine.status import EngineHealth, StageStatus
from tests.observability import documented

pytestmark = pytest.mark.unit

STAGE = StageStatus(
    stage_id=0, stage_type="diffusion", replicas=1, live_replicas=1, replica_states=["live"],
    replica_nodes=["node-a"], restarts=0, unresponsive_kills=0, inflight=0, per_replica_inflight=[0],
)  # fmt: skip
HEALTH = EngineHealth(status="ok", reason=None, pending=0, max_pending=8, stages=[STAGE], dead_stages=[])
#: One stage's output metrics that feed every per-stage series: a wave, its caches, its cost.
WAVE = {
    "execution_ms": 5.0, "batch_id": 1, "replica_id": 0, "weight_bytes": 1024,
    "cache_blocks_called": 4, "cache_blocks_run": 2,
    "cost_key": "64x64", "cost_fixed_ms": 10.0, "cost_per_item_ms": 1.0,
    **{
        f"{cache}_{key}": 1
        for cache in ("prompt_cache", "result_cache")
        for key in ("hit", "evictions", "bytes", "entries")
    },
}  # fmt: skip


class _Models:
    def counts(self) -> dict[str, ModelCounts]:
        return {"sd": ModelCounts(state="loaded", loads=1, wakes=0, evictions=0, resident_bytes=1024)}


def exported(labelled: bool) -> dict[str, tuple[str, frozenset[str]]]:
    """The families of a registry built as the server builds it, with a series in each: name (a
    counter's with ``_total``) -> type and labels."""
    metrics = ServerMetrics((lambda: {"sd": HEALTH}) if labelled else (lambda: HEALTH), labelled=labelled)
    metrics.registry.register(ModelCollector(_Models()))  # type: ignore[arg-type]
    s, model = metrics.series, "sd"
    metrics.observe_stage(0, WAVE, model)
    s(metrics.e2e, model).observe(0.1)
    s(metrics.queue_wait, model, "0").observe(0.1)
    s(metrics.batch_size, model, "0").observe(1)
    s(metrics.http_requests, model, "/v1/images/generations", "POST", "200").inc()
    s(metrics.http_latency, model, "/v1/images/generations").observe(0.1)
    s(metrics.aborted, model, "shutdown").inc()
    s(metrics.images, model).inc()
    s(metrics.jobs, model, "queued").inc()
    families = list(text_string_to_metric_families(metrics.render().decode()))
    kinds = {f.name: f.type for f in families}
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for f in families:
        base = f.name.removesuffix("_created")
        if base != f.name and kinds.get(base) in ("counter", "histogram"):
            continue  # prometheus_client's creation time of a counter's or histogram's series
        assert f.samples, f"{f.name} has no series here: feed it in exported()"
        name = f.name + "_total" if f.type == "counter" else f.name
        out[name] = (f.type, frozenset(label for x in f.samples for label in x.labels) - {"le"})
    return out


def test_every_exported_metric_has_its_row_and_every_row_its_metric() -> None:
    rows, got = documented(), exported(labelled=True)
    assert sorted(got.keys() - rows.keys()) == [], "exported but not in docs/observability.md"
    assert sorted(rows.keys() - got.keys()) == [], "in docs/observability.md but not exported"
    for name, (kind, labels) in got.items():
        assert (kind, labels) == (rows[name].type, rows[name].labels), name


def test_one_model_served_has_no_model_label_but_on_the_model_series() -> None:
    rows, got = documented(), exported(labelled=False)
    assert got.keys() == rows.keys()
    for name, (_, labels) in got.items():
        want = rows[name].labels if name.startswith("omni_model_") else rows[name].labels - {"model"}
        assert labels == want, name


def test_every_row_keeps_the_naming_conventions() -> None:
    for name, row in documented().items():
        assert (row.type == "counter") == name.endswith("_total"), name
        base = name.removesuffix("_total")
        for unit in ("seconds", "bytes"):
            assert (row.unit == unit) == base.endswith(f"_{unit}"), name
        assert not base.endswith(("_ms", "_milliseconds", "_kb", "_mb", "_gb")), name
