"""The engine gauges of /metrics, from a health snapshot: replicas per node, kills, a dead engine."""

from __future__ import annotations

from omni_runtime.entrypoints.async_omni import EngineHealth
from omni_runtime.entrypoints.openai.metrics import ServerMetrics
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime.engine.status import StageStatus


def samples(health: EngineHealth) -> dict[tuple[str, tuple], float]:
    text = ServerMetrics(lambda: health).render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_replicas_are_counted_per_node_and_the_dead_engine_shows():
    stage = StageStatus(
        stage_id=0,
        stage_type="echo",
        replicas=3,
        live_replicas=2,
        replica_states=["live", "restarting", "live"],
        replica_nodes=["node-a", "node-b", "node-b"],
        restarts=1,
        unresponsive_kills=1,
        inflight=4,
        per_replica_inflight=[2, 0, 2],
    )
    got = samples(EngineHealth(status="ok", reason=None, pending=4, max_pending=16, stages=[stage], dead_stages=[]))
    assert got[("omni_stage_replicas_by_node", (("node", "node-a"), ("stage", "0")))] == 1
    assert got[("omni_stage_replicas_by_node", (("node", "node-b"), ("stage", "0")))] == 1  # one restarting
    assert got[("omni_stage_unresponsive_kills_total", (("stage", "0"),))] == 1
    assert got[("omni_engine_dead", ())] == 0 and got[("omni_engine_running", ())] == 1
    dead = samples(
        EngineHealth(
            status="dead",
            reason="stage 0 has no live replica",
            pending=0,
            max_pending=16,
            stages=[stage],
            dead_stages=[0],
        )
    )
    assert dead[("omni_engine_dead", ())] == 1 and dead[("omni_engine_running", ())] == 0


def test_cache_blocks_and_weight_bytes_per_stage_once_per_wave():
    metrics = ServerMetrics(lambda: None)
    wave = {"execution_ms": 5.0, "batch_id": 1, "replica_id": 0, "weight_bytes": 1234}
    for _ in range(2):  # a wave of two requests: both outputs carry the wave's counts
        metrics.observe_stage(0, {**wave, "cache_blocks_called": 36, "cache_blocks_run": 14})
    metrics.observe_stage(0, {**wave, "batch_id": 2, "cache_blocks_called": 36, "cache_blocks_run": 36})
    # Step execution: two cached requests that joined at one step (one batch id) each count their own.
    step = {"execution_ms": 5.0, "batch_id": 3, "replica_id": 0}
    metrics.observe_stage(0, {**step, "request_cache_blocks_called": 12, "request_cache_blocks_run": 5})
    metrics.observe_stage(0, {**step, "request_cache_blocks_called": 12, "request_cache_blocks_run": 7})
    text = metrics.render().decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert got[("omni_stage_cache_blocks_total", (("outcome", "run"), ("stage", "0")))] == 50 + 12
    assert got[("omni_stage_cache_blocks_total", (("outcome", "skipped"), ("stage", "0")))] == 22 + 12
    assert got[("omni_stage_weight_bytes", (("stage", "0"),))] == 1234


def test_learned_batch_costs_are_gauges_per_stage_and_key_bounded() -> None:
    metrics = ServerMetrics(lambda: None)
    for i in range(40):  # more keys than exported: the first 16 of the stage keep their gauges
        metrics.observe_stage(0, {"cost_key": f"64x64x{i}", "cost_fixed_ms": 200.0, "cost_per_item_ms": 20.0})
    metrics.observe_stage(0, {"cost_key": "64x64x0", "cost_fixed_ms": 100.0, "cost_per_item_ms": 10.0})
    metrics.observe_stage(1, {"cost_key": 7, "cost_fixed_ms": "bad"})  # not a fit: ignored
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name.startswith("omni_stage_batch_")
    }
    fixed = {k: v for k, v in found.items() if k[0] == "omni_stage_batch_fixed_cost_seconds"}
    assert len(fixed) == 16
    assert fixed[("omni_stage_batch_fixed_cost_seconds", (("key", "64x64x0"), ("stage", "0")))] == 0.1
    assert found[("omni_stage_batch_per_item_cost_seconds", (("key", "64x64x0"), ("stage", "0")))] == 0.01


def test_each_models_waves_and_latencies_are_its_own_on_a_multi_model_server():
    """Two models' engines number their waves alike (stage 0, replica 0, batch 1): the second's wave
    was taken for the first's and dropped, and /v1/status mixed both models' quantiles."""
    metrics = ServerMetrics(lambda: None, labelled=True)
    metrics.observe_stage(0, {"execution_ms": 10.0, "batch_id": 1, "replica_id": 0}, "sd")
    metrics.observe_stage(0, {"execution_ms": 900.0, "batch_id": 1, "replica_id": 0}, "wan")
    assert list(metrics.recent_waves[("sd", 0)]) == [0.01] and list(metrics.recent_waves[("wan", 0)]) == [0.9]
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    for model in ("sd", "wan"):
        assert got[("omni_runtime_stage_wave_seconds_count", (("model", model), ("stage", "0")))] == 1
