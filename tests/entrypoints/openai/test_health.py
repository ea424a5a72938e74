"""The bodies of /health and /readyz, built from the engine's EngineHealth and StageStatus structs:
the JSON (keys, order, nulls and absent keys) is the one these probes have always answered with.

In process, without the app's lifespan: a stand-in engine answers ``health()``."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from omni_runtime.entrypoints.openai.server import create_app

from omni_runtime.engine.status import EngineHealth, StageStatus

pytestmark = pytest.mark.unit

KEY = "health-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

STAGE = StageStatus(
    stage_id=0,
    stage_type="diffusion",
    replicas=2,
    live_replicas=1,
    replica_states=["live", "restarting"],
    replica_nodes=["elsewhere", None],
    restarts=1,
    unresponsive_kills=0,
    inflight=3,
    per_replica_inflight=[3, 0],
)


class FakeEngine:
    def __init__(self, health: EngineHealth) -> None:
        self.snapshot = health

    def health(self) -> EngineHealth:
        return self.snapshot


def engine_health(status: str = "ok", reason: str | None = None, dead_stages: list[int] | None = None) -> EngineHealth:
    return EngineHealth(
        status=status,  # type: ignore[arg-type]
        reason=reason,
        pending=3,
        max_pending=64,
        stages=[STAGE],
        dead_stages=dead_stages or [],
    )


@pytest.fixture
def served():
    app = create_app("tiny-sd", api_key=KEY)
    model = app.state.omni.multi.models["tiny-sd"]

    def serve(health: EngineHealth | None, failed: BaseException | None = None) -> TestClient:
        model.engine = None if health is None else FakeEngine(health)
        model.state = "failed" if failed is not None else "loading" if health is None else "loaded"
        model.error = failed
        return TestClient(app)  # not entered: no lifespan, no engine

    return serve


def body(response) -> list[tuple[str, object]]:
    """The JSON object's items in order (the order is part of what stays the same)."""
    return list(json.loads(response.text, object_pairs_hook=lambda pairs: pairs))


def test_health_bodies(served):
    loading = served(None).get("/health")
    assert (loading.status_code, loading.json(), loading.headers["Retry-After"]) == (503, {"status": "loading"}, "1")
    failed = served(None, failed=RuntimeError("no such model")).get("/health")
    assert (failed.status_code, body(failed)) == (503, [("status", "failed"), ("reason", "no such model")])
    ok = served(engine_health()).get("/health")
    assert (ok.status_code, ok.json()) == (200, {"status": "ok"})
    dead = served(engine_health("dead", "stage 0 is gone")).get("/health")
    assert (dead.status_code, body(dead)) == (503, [("status", "dead"), ("reason", "stage 0 is gone")])
    sick = served(engine_health("unhealthy", "no live replica", [0])).get("/health")
    assert (sick.status_code, body(sick)) == (503, [("status", "unhealthy"), ("dead_stages", [0])])


def test_readyz_without_the_key_is_the_verdict_only(served):
    r = served(engine_health()).get("/readyz")
    assert (r.status_code, body(r)) == (200, [("ready", True), ("draining", False)])
    r = served(engine_health("unhealthy", "no live replica", [0])).get("/readyz")
    assert (r.status_code, r.json()) == (503, {"ready": False, "draining": False})


def test_readyz_with_the_key(served):
    r = served(engine_health("dead", "stage 0 is gone", [0])).get("/readyz", headers=AUTH)
    assert r.status_code == 503
    stage = [
        ("stage_id", 0),
        ("stage_type", "diffusion"),
        ("replicas", 2),
        ("live_replicas", 1),
        ("replica_states", ["live", "restarting"]),
        ("replica_nodes", ["elsewhere", None]),
        ("restarts", 1),
        ("unresponsive_kills", 0),
        ("inflight", 3),
        ("queue_depth", 3),
        ("per_replica_inflight", [3, 0]),
    ]
    assert body(r) == [
        ("ready", False),
        ("dead", "stage 0 is gone"),
        ("draining", False),
        ("model", "tiny-sd"),
        ("pending", 3),
        ("max_pending", 64),
        ("stages", [stage]),
        ("remote_replicas", 1),  # the live replica on another node
        ("job_store", [("backend", None), ("ok", False)]),  # no jobs layer: no count, no gateway
    ]
