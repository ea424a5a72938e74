"""The dashboard's rolling window (entrypoints/openai/status_history.py), pure: its bound, the
rates and quantiles a sample makes of two readings, and what it reads of a server's metrics and
health (a fake server state: metrics, and models with their health)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omni_runtime.entrypoints.multi_omni import ModelSpec
from omni_runtime.entrypoints.openai.metrics import ServerMetrics
from omni_runtime.entrypoints.openai.server import create_app
from omni_runtime.entrypoints.openai.status_history import (
    Reading,
    StageReading,
    StatusHistory,
    Window,
    bucket_change,
    histogram_quantile,
    rate,
    read_server,
)

from omni_runtime.engine.status import EngineHealth, StageStatus

pytestmark = pytest.mark.unit

INF = math.inf


def test_the_window_keeps_its_size_and_drops_the_oldest() -> None:
    window = Window(size=5)
    for t in range(12):
        window.add(Reading(time=1000.0 + 2 * t, state="loaded"))
    assert len(window.samples) == 5
    assert [s.time for s in window.samples] == [1014.0, 1016.0, 1018.0, 1020.0, 1022.0]
    assert [s.time for s in window.since(1018.0)] == [1020.0, 1022.0]
    assert len(window.since(None)) == 5


def test_a_rate_is_the_counters_change_per_second_and_a_reset_counts_from_zero() -> None:
    assert rate(None, 5.0, 2.0) is None  # no earlier reading
    assert rate(10.0, 16.0, 2.0) == 3.0
    assert rate(10.0, 10.0, 2.0) == 0.0
    assert rate(10.0, 4.0, 2.0) == 2.0  # reset: 4 since zero
    assert rate(1.0, 2.0, 0.0) is None


def test_quantiles_interpolate_within_their_bucket_as_prometheus_does() -> None:
    buckets = {1.0: 10.0, 2.0: 30.0, INF: 30.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(1.25)  # rank 15: a quarter into (1, 2]
    assert histogram_quantile(0.99, buckets) == pytest.approx(1.985)
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.15)  # the first bucket starts at 0
    assert histogram_quantile(0.5, {0.1: 0.0, 0.25: 0.0, 0.5: 4.0, INF: 4.0}) == pytest.approx(0.375)
    # In the +Inf bucket: the largest finite bound.
    assert histogram_quantile(0.5, {1.0: 0.0, INF: 5.0}) == 1.0
    assert histogram_quantile(0.5, {1.0: 0.0, INF: 0.0}) is None
    assert histogram_quantile(0.5, {}) is None


def test_bucket_change_is_the_interval_only_and_a_reset_starts_over() -> None:
    before = {1.0: 3.0, 2.0: 5.0, INF: 6.0}
    assert bucket_change(before, {1.0: 3.0, 2.0: 9.0, INF: 10.0}) == {1.0: 0.0, 2.0: 4.0, INF: 4.0}
    assert bucket_change(before, {1.0: 1.0, 2.0: 1.0, INF: 1.0}) == {1.0: 1.0, 2.0: 1.0, INF: 1.0}
    assert bucket_change(None, before) == before


def _stage(**kw: float | int | tuple[int, ...]) -> StageReading:
    return StageReading(stage_id=0, **kw)  # type: ignore[arg-type]


def test_a_sample_says_what_happened_since_the_previous_one() -> None:
    window = Window()
    # Ten slow requests before the first sample: not part of the second sample's latency.
    first = window.add(
        Reading(time=100.0, state="loaded", e2e={0.5: 0.0, 5.0: 10.0, INF: 10.0}, e2e_sum=30.0,
                stages=(_stage(queue_depth=(1, 0), live_replicas=2, waves=4, batch_count=10, batch_sum=10),))
    )  # fmt: skip
    assert first.requests_per_s is None and first.e2e_p50_ms is None
    assert first.stages[0].waves_per_s is None and first.stages[0].batch_size is None
    assert first.stages[0].queue_depth == [1, 0]
    second = window.add(
        Reading(time=102.0, state="loaded", pending=3, resident_bytes=1 << 20,
                e2e={0.5: 4.0, 5.0: 14.0, INF: 14.0}, e2e_sum=31.2,
                stages=(_stage(queue_depth=(2, 1), live_replicas=2, restarts=1, waves=6, batch_count=14,
                               batch_sum=18, cache_hits=3),))
    )  # fmt: skip
    assert second.requests_per_s == 2.0  # 4 requests in 2 s
    # The 4 fast ones only: their exact mean, and quantiles within their bucket (0, 0.5].
    assert second.e2e_mean_ms == 300.0 and second.e2e_p50_ms == 250.0 and second.e2e_p99_ms == 495.0
    (stage,) = second.stages
    assert stage.waves_per_s == 1.0 and stage.cache_hits_per_s == 1.5
    assert stage.batch_size == 2.0  # 4 requests in waves of 2
    assert stage.queue_depth == [2, 1] and stage.restarts == 1 and stage.live_replicas == 2
    assert (second.pending, second.resident_bytes, second.state) == (3, 1 << 20, "loaded")
    # Nothing finished: a rate of 0 and no latency; a stage new since then has no rate yet.
    third = window.add(
        Reading(time=104.0, state="loaded", e2e={0.5: 4.0, 5.0: 14.0, INF: 14.0}, e2e_sum=31.2,
                stages=(_stage(waves=6, batch_count=14, batch_sum=18, cache_hits=3),
                        StageReading(stage_id=1, waves=50)))
    )  # fmt: skip
    assert third.requests_per_s == 0.0 and third.e2e_p50_ms is None and third.e2e_mean_ms is None
    assert third.stages[0].waves_per_s == 0.0 and third.stages[0].batch_size is None
    assert third.stages[1].waves_per_s is None


@dataclass
class FakeModel:
    """What the sampler reads of a served model."""

    name: str
    state: str = "loaded"
    resident_bytes: int | None = None
    stages: list[StageStatus] = field(default_factory=list)

    def health(self) -> EngineHealth | None:
        if self.state != "loaded":
            return None
        return EngineHealth(status="ok", reason=None, pending=1, max_pending=8, stages=self.stages, dead_stages=[])

    def status(self) -> str:
        return self.state


def _stage_status(inflight: list[int], restarts: int = 0) -> StageStatus:
    return StageStatus(
        stage_id=0, stage_type="diffusion", replicas=len(inflight), live_replicas=len(inflight),
        replica_states=["live"] * len(inflight), replica_nodes=[None] * len(inflight), restarts=restarts,
        unresponsive_kills=0, inflight=sum(inflight), per_replica_inflight=inflight,
    )  # fmt: skip


def _state(models: list[FakeModel], labelled: bool) -> SimpleNamespace:
    return SimpleNamespace(
        metrics=ServerMetrics(lambda: None, labelled=labelled),
        several=labelled,
        only=models[0],
        multi=SimpleNamespace(models={m.name: m for m in models}),
    )


def test_it_reads_each_models_series_from_the_metrics_and_its_health() -> None:
    sd = FakeModel("sd", resident_bytes=4096, stages=[_stage_status([2, 1], restarts=1)])
    wan = FakeModel("wan", state="asleep", resident_bytes=9999)
    state = _state([sd, wan], labelled=True)
    history = StatusHistory(state, size=10)  # type: ignore[arg-type]
    history.sample(now=10.0)
    m = state.metrics
    for seconds in (0.2, 0.3):
        m.e2e.labels("sd").observe(seconds)
    m.e2e.labels("wan").observe(20.0)  # another model's request: not sd's
    m.wave_seconds.labels("sd", "0").observe(0.1)
    m.batch_size.labels("sd", "0").observe(2)
    m.batch_size.labels("sd", "0").observe(2)
    m.caches["result_cache"].requests.labels("sd", "0", "hit").inc()
    m.caches["prompt_cache"].requests.labels("sd", "0", "hit").inc()
    m.caches["prompt_cache"].requests.labels("sd", "0", "miss").inc()
    history.sample(now=12.0)
    sample = history.report("sd").samples[-1]
    assert sample.requests_per_s == 1.0 and sample.e2e_mean_ms == 250.0
    assert 200 <= sample.e2e_p50_ms <= 250  # type: ignore[operator]
    assert sample.resident_bytes == 4096 and sample.pending == 1
    (stage,) = sample.stages
    assert stage.queue_depth == [2, 1] and stage.restarts == 1
    assert stage.waves_per_s == 0.5 and stage.batch_size == 2.0 and stage.cache_hits_per_s == 1.0
    asleep = history.report("wan").samples[-1]
    assert asleep.state == "asleep" and asleep.stages == [] and asleep.resident_bytes == 0
    assert history.report("wan").span_s == 10 * history.period_s


def test_one_model_served_has_unlabelled_series() -> None:
    sd = FakeModel("sd", stages=[_stage_status([0])])
    state = _state([sd], labelled=False)
    history = StatusHistory(state)  # type: ignore[arg-type]
    history.sample(now=0.0)
    state.metrics.e2e.observe(1.0)
    state.metrics.wave_seconds.labels("0").observe(1.0)
    history.sample(now=2.0)
    (reading,) = read_server(state, 4.0)  # type: ignore[arg-type]
    assert reading[0] == "sd" and reading[1].stages[0].waves == 1.0
    sample = history.report("sd").samples[-1]
    assert sample.requests_per_s == 0.5 and sample.stages[0].waves_per_s == 0.5


# --------------------------------------------------------------------------- the route, hostile


@pytest.fixture(scope="module")
def apps() -> dict[str, TestClient]:
    """A one-model and a two-model app (no lifespan: no engine), each with a few samples taken."""
    clients = {}
    for kind, specs in (
        ("one", [ModelSpec(source="echo")]),
        ("two", [ModelSpec(source="echo"), ModelSpec(source="echo", name="e2")]),
    ):
        app = create_app(specs)
        for i, model in enumerate(app.state.omni.multi.models.values()):
            model.engine = FakeModel(model.name, stages=[_stage_status([i])])
            model.state = "loaded"
        for now in (1000.0, 1002.0, 1004.0):
            app.state.history.sample(now=now)
        clients[kind] = TestClient(app)
    return clients


#: What a client may put in a query value: numbers of every spelling, words, any text.
QUERY_VALUES = st.one_of(
    st.sampled_from(["nan", "-nan", "inf", "-inf", "1e308", "1e400", "-0", "0x10", "1_000", "true", "", "1e-400"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.text(max_size=40),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["one", "two"]), since=st.none() | QUERY_VALUES, model=st.none() | QUERY_VALUES)
def test_hostile_query_values_are_answered_and_the_route_serves_after(
    apps: dict[str, TestClient], kind: str, since: str | None, model: str | None
) -> None:
    """``since`` and ``model`` as any text (huge, negative, NaN, unicode, lone surrogates escaped):
    a 200 with samples, a 400 naming the field or a 404 naming the model, never a 500; and the
    route still answers the plain request."""
    http = apps[kind]
    query = "&".join(
        f"{name}={quote(value, errors='surrogatepass')}"
        for name, value in (("since", since), ("model", model))
        if value is not None
    )
    resp = http.get(f"/v1/status/history?{query}")
    assert resp.status_code in (200, 400, 404), resp.text
    body = resp.json()
    if resp.status_code == 200:
        reports = body.get("models", [body])
        assert all(isinstance(r["samples"], list) for r in reports)
    else:
        assert body["error"]["param"] in ("model", "query.since"), body
    if since is not None and since.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        assert resp.status_code == 400 and body["error"]["param"] == "query.since"  # was a 200, empty
    plain = http.get("/v1/status/history" + ("?model=echo" if kind == "two" else "")).json()
    assert len(plain["samples"]) == 3
