"""Prometheus metrics of the HTTP server, in a registry of its own (one per app).

A per-app :class:`CollectorRegistry` keeps two apps in one process (tests, embedding) from
colliding on metric names. Request-level histograms are fed from the metrics the engine reports
with each output (``e2e_ms``, ``queue_wait_ms``, ``batch_size``); engine gauges (queue depth,
live replicas, restarts) are read from ``stage_status()`` at scrape time, so they are never stale
and cost nothing between scrapes.

With several models served, every series carries a ``model`` label (``ServerMetrics.series``
puts it first). docs/observability.md tables every metric; a test holds the table to this
registry, so a metric added or relabelled here needs its row there.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omni_runtime.outputs import OmniRequestOutput

from ..async_omni import EngineHealth

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: How many of the latest latencies the status route's quantiles are taken over.
RECENT = 1024
#: Keys per stage that get a cost gauge; later keys are not exported (bounded label cardinality).
_COST_KEYS_PER_STAGE = 16
_M = TypeVar("_M", Histogram, Counter, Gauge)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)


class _EngineCollector(Collector):
    """Engine gauges read at scrape time; nothing is exported before the engine has started.
    ``health`` gives one engine's health, or each model's by name: the series then carry a
    ``model`` label (a model without an engine yet exports nothing)."""

    def __init__(self, health: Callable[[], EngineHealth | Mapping[str, EngineHealth | None] | None]) -> None:
        self._health = health

    def collect(self) -> Iterator[Metric]:
        got = self._health()
        if got is None:
            return
        by_model = got if isinstance(got, Mapping) else None
        m = ["model"] if by_model is not None else []
        pending = GaugeMetricFamily("omni_engine_pending_requests", "Requests admitted and not yet finished.", labels=m)
        limit = GaugeMetricFamily("omni_engine_max_pending", "Admission limit; past it requests get 429.", labels=m)
        running = GaugeMetricFamily("omni_engine_running", "1 while the engine serves, 0 once it stopped.", labels=m)
        dead = GaugeMetricFamily(
            "omni_engine_dead", "1 once the engine can no longer serve (the server then exits).", labels=m
        )
        depth = GaugeMetricFamily(
            "omni_stage_queue_depth", "Requests inside a stage (waiting or running).", labels=[*m, "stage"]
        )
        live = GaugeMetricFamily("omni_stage_live_replicas", "Live replicas of a stage.", labels=[*m, "stage"])
        replicas = GaugeMetricFamily("omni_stage_replicas", "Configured replicas of a stage.", labels=[*m, "stage"])
        restarts = CounterMetricFamily("omni_stage_restarts", "Replica restarts of a stage.", labels=[*m, "stage"])
        by_node = GaugeMetricFamily(
            "omni_stage_replicas_by_node", "Live replicas of a stage on each node.", labels=[*m, "stage", "node"]
        )
        kills = CounterMetricFamily(
            "omni_stage_unresponsive_kills",
            "Replicas killed for missing heartbeats or a stalled forward.",
            labels=[*m, "stage"],
        )
        engines = by_model.items() if by_model is not None else [(None, got)]
        for name, h in engines:
            if h is None or isinstance(h, Mapping):
                continue
            key = [name] if name is not None else []
            pending.add_metric(key, h.pending)
            limit.add_metric(key, h.max_pending)
            running.add_metric(key, 1 if h.status in ("ok", "unhealthy") else 0)
            dead.add_metric(key, 1 if h.status == "dead" else 0)
            for status in h.stages:
                label = [*key, str(status.stage_id)]
                depth.add_metric(label, status.inflight)
                live.add_metric(label, status.live_replicas)
                replicas.add_metric(label, status.replicas)
                restarts.add_metric(label, status.restarts)
                kills.add_metric(label, status.unresponsive_kills)
                nodes = status.replica_nodes
                for node in sorted({n for n in nodes if n is not None}):
                    alive = sum(
                        1 for n, st in zip(nodes, status.replica_states, strict=False) if n == node and st == "live"
                    )
                    by_node.add_metric([*label, node], alive)
        yield from (pending, limit, running, dead, depth, live, replicas, by_node, restarts, kills)


class _CacheSeries:
    """The ``/metrics`` series of one cache across requests (``prompt_cache``, ``result_cache``),
    fed from the output metrics ``<name>_hit`` (1 or 0), ``<name>_evictions``, ``<name>_bytes`` and
    ``<name>_entries`` of each request it looked up."""

    def __init__(self, name: str, what: str, model: list[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.requests = Counter(
            f"omni_stage_{name}_requests",
            f"Requests looked up in a stage's cache of {what}, by outcome: hit or miss.",
            [*model, "stage", "outcome"],
            registry=registry,
        )
        self.evictions = Counter(
            f"omni_stage_{name}_evictions",
            f"Entries of a stage's cache of {what} evicted for room (least recently used first).",
            [*model, "stage"],
            registry=registry,
        )
        self.bytes = Gauge(
            f"omni_stage_{name}_bytes",
            f"Bytes held by a stage replica's cache of {what}, as of its latest request.",
            [*model, "stage", "replica"],
            registry=registry,
        )
        self.entries = Gauge(
            f"omni_stage_{name}_entries",
            f"Entries of a stage replica's cache of {what}, as of its latest request.",
            [*model, "stage", "replica"],
            registry=registry,
        )

    def observe(self, metrics: ServerMetrics, model: str, stage: str, output: dict[str, Any]) -> None:
        hit = output.get(f"{self.name}_hit")
        if not isinstance(hit, int) or hit not in (0, 1):
            return
        metrics.series(self.requests, model, stage, "hit" if hit else "miss").inc()
        evicted = output.get(f"{self.name}_evictions")
        if isinstance(evicted, int) and evicted > 0:
            metrics.series(self.evictions, model, stage).inc(evicted)
        replica = str(output.get("replica_id", 0))
        size, entries = output.get(f"{self.name}_bytes"), output.get(f"{self.name}_entries")
        if isinstance(size, int) and isinstance(entries, int):
            metrics.series(self.bytes, model, stage, replica).set(size)
            metrics.series(self.entries, model, stage, replica).set(entries)


class ServerMetrics:
    """Every metric the server exports. ``health`` returns the running engine's health, or None
    (or each model's, by name). ``labelled``: the per-model series carry a ``model`` label,
    the name of the model each observation is made for (``observe_output(out, model)``)."""

    def __init__(
        self,
        health: Callable[[], EngineHealth | Mapping[str, EngineHealth | None] | None],
        *,
        labelled: bool = False,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._labelled = labelled
        m = ["model"] if labelled else []
        # The HTTP series carry the model a request named (resolved to a served one), "" for a
        # request on none (probes, /v1/models, a job by id, an unknown name).
        self.http_requests = Counter(
            "omni_http_requests",
            "HTTP requests by route and status code.",
            [*m, "route", "method", "status"],
            registry=r,
        )
        self.http_latency = Histogram(
            "omni_http_request_duration_seconds",
            "HTTP request latency, first byte in to last byte out.",
            [*m, "route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "omni_request_e2e_seconds",
            "Engine end-to-end latency of a finished request (output metrics e2e_ms).",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "omni_request_queue_wait_seconds",
            "Time a request waited in a stage's queue before its wave ran (output metrics queue_wait_ms).",
            [*m, "stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "omni_stage_batch_size",
            "Size of the fused wave each request ran in (output metrics batch_size).",
            [*m, "stage"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.aborted = Counter(
            "omni_requests_aborted", "Engine requests aborted by the server, by reason.", [*m, "reason"], registry=r
        )
        self.images = Counter("omni_images_generated", "Images returned to clients.", m, registry=r)
        self.jobs = Counter(
            "omni_runtime_jobs",
            "Jobs (/v1/generate) of this gateway reaching each status: queued, running, completed, failed, "
            "cancelled, requeued.",
            [*m, "status"],
            registry=r,
        )
        self.wave_seconds = Histogram(
            "omni_runtime_stage_wave_seconds",
            "Duration of each stage wave (fused forward, or a request's stay in a step batch), once per "
            "wave (output metrics execution_ms, by batch_id).",
            [*m, "stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        #: The latest engine end-to-end latencies and wave durations (seconds), per stage, for the
        #: quantiles of ``GET /v1/status`` (a histogram's buckets are too coarse for a p99).
        #: Per model (on a multi-model server, each model's own: one model's slow videos must not
        #: move another's quantiles), and per model and stage.
        self.recent_e2e: dict[str, deque[float]] = {}
        self.recent_waves: dict[tuple[str, int], deque[float]] = {}
        self.cache_blocks = Counter(
            "omni_stage_cache_blocks",
            "Denoiser transformer blocks called per stage, by outcome: run, or skipped by a step cache "
            "(output metrics cache_blocks_called / cache_blocks_run, once per wave; in step execution, "
            "each cached request's own request_cache_blocks_called / request_cache_blocks_run).",
            [*m, "stage", "outcome"],
            registry=r,
        )
        self.weight_bytes = Gauge(
            "omni_stage_weight_bytes",
            "Bytes of model weights resident in a stage replica (after quantization or casting).",
            [*m, "stage"],
            registry=r,
        )
        self.cost_fixed = Gauge(
            "omni_stage_batch_fixed_cost_seconds",
            "Learned fixed cost of a stage's forward (or step), whatever its batch size, per key "
            "(summarised, at most 16 per stage): what batching shares.",
            [*m, "stage", "key"],
            registry=r,
        )
        self.cost_per_item = Gauge(
            "omni_stage_batch_per_item_cost_seconds",
            "Learned cost of each request added to a stage's forward (or step), per key.",
            [*m, "stage", "key"],
            registry=r,
        )
        self._cost_keys: dict[str, set[str]] = {}
        #: The caches across requests (docs/configuration.md, "Caches across requests"), from each
        #: request's output metrics: its lookup's outcome, the entries storing it evicted, and the
        #: replica's cache size when it finished.
        self.caches = {
            name: _CacheSeries(name, what, m, r)
            for name, what in (
                ("prompt_cache", "the text encoder's outputs per prompt (step execution)"),
                ("result_cache", "exact results of seeded requests (engine_args.result_cache)"),
            )
        }
        #: (model, stage, replica, batch id) of waves already observed, so a wave of 8 counts once.
        self._waves: OrderedDict[tuple[Any, Any, Any, Any], None] = OrderedDict()
        r.register(_EngineCollector(health))

    def observe_output(self, out: OmniRequestOutput | None, model: str = "") -> None:
        """Record the engine metrics of one finished request (every final stage it went through)
        of ``model`` (the label of the per-model series, when labelled)."""
        if out is None:
            return
        e2e = out.metrics.get("e2e_ms")
        if isinstance(e2e, int | float):
            self.series(self.e2e, model).observe(e2e / 1000.0)
            self.recent_e2e.setdefault(model, deque(maxlen=RECENT)).append(e2e / 1000.0)
        for sid, result in out.outputs_by_stage.items():
            wait, size = result.metrics.get("queue_wait_ms"), result.metrics.get("batch_size")
            if isinstance(wait, int | float):
                self.series(self.queue_wait, model, str(sid)).observe(wait / 1000.0)
            if isinstance(size, int | float):
                self.series(self.batch_size, model, str(sid)).observe(size)
            self.observe_stage(sid, result.metrics, model)

    def observe_stage(self, sid: int, metrics: dict[str, Any], model: str = "") -> None:
        """The wave histogram and cost gauges, from one stage's output metrics (each wave counted
        once) of ``model``."""
        self._observe_cost(model, str(sid), metrics)
        for series in self.caches.values():
            series.observe(self, model, str(sid), metrics)
        # Step execution: each cached request's own blocks, counted per request (not per wave).
        called, ran = metrics.get("request_cache_blocks_called"), metrics.get("request_cache_blocks_run")
        if isinstance(called, int) and isinstance(ran, int) and called >= ran >= 0:
            self.series(self.cache_blocks, model, str(sid), "run").inc(ran)
            self.series(self.cache_blocks, model, str(sid), "skipped").inc(called - ran)
        execution, batch = metrics.get("execution_ms"), metrics.get("batch_id")
        if not isinstance(execution, int | float):
            return
        if batch is not None:
            key = (model, sid, metrics.get("replica_id"), batch)  # each model's engine numbers its own
            if key in self._waves:
                return
            self._waves[key] = None
            if len(self._waves) > 4096:
                self._waves.popitem(last=False)
        self.series(self.wave_seconds, model, str(sid)).observe(execution / 1000.0)
        self.recent_waves.setdefault((model, sid), deque(maxlen=RECENT)).append(execution / 1000.0)
        called, ran, weights = (metrics.get(k) for k in ("cache_blocks_called", "cache_blocks_run", "weight_bytes"))
        if isinstance(called, int) and isinstance(ran, int) and called >= ran >= 0:
            self.series(self.cache_blocks, model, str(sid), "run").inc(ran)
            self.series(self.cache_blocks, model, str(sid), "skipped").inc(called - ran)
        if isinstance(weights, int | float):
            self.series(self.weight_bytes, model, str(sid)).set(weights)

    def series(self, metric: _M, model: str, *labels: str) -> _M:
        """``metric``'s series for ``labels``, with ``model`` first when labelled by model."""
        values = (model, *labels) if self._labelled else labels
        return metric.labels(*values) if values else metric

    def job_counts(self) -> dict[str, int]:
        """How many jobs of this gateway reached each status (every model's), from the
        ``omni_runtime_jobs`` counter."""
        counts: dict[str, int] = {}
        for family in self.jobs.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    status = sample.labels["status"]
                    counts[status] = counts.get(status, 0) + int(sample.value)
        return counts

    def _observe_cost(self, model: str, stage: str, metrics: dict[str, Any]) -> None:
        key, fixed, per_item = metrics.get("cost_key"), metrics.get("cost_fixed_ms"), metrics.get("cost_per_item_ms")
        if not isinstance(key, str) or not isinstance(fixed, int | float) or not isinstance(per_item, int | float):
            return
        keys = self._cost_keys.setdefault(model + "/" + stage, set())
        if key not in keys:
            if len(keys) >= _COST_KEYS_PER_STAGE:
                return
            keys.add(key)
        self.series(self.cost_fixed, model, stage, key).set(fixed / 1000.0)
        self.series(self.cost_per_item, model, stage, key).set(per_item / 1000.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
