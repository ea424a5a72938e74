"""Two models in one app, one failed to load and one loading then serving: what /health, /readyz,
/v1/models and the routes answer for each. In process, without the app's lifespan: a stand-in
engine answers ``health()``."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from omni_runtime.entrypoints.multi_omni import ModelSpec
from omni_runtime.entrypoints.openai.server import create_app

from omni_runtime.engine.status import EngineHealth, StageStatus

pytestmark = pytest.mark.unit

KEY = "multi-health-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class FakeEngine:
    def health(self) -> EngineHealth:
        stage = StageStatus(
            stage_id=0,
            stage_type="echo",
            replicas=1,
            live_replicas=1,
            replica_states=["live"],
            replica_nodes=[None],
            restarts=0,
            unresponsive_kills=0,
            inflight=0,
            per_replica_inflight=[0],
        )
        return EngineHealth(status="ok", reason=None, pending=0, max_pending=7, stages=[stage], dead_stages=[])


def test_each_model_reports_its_own_state() -> None:
    app = create_app([ModelSpec(source="echo"), ModelSpec(source="tiny-sd", name="sd")], api_key=KEY)
    state = app.state.omni
    sd, echo = state.multi.models["sd"], state.multi.models["echo"]
    sd.state, sd.error = "failed", RuntimeError("no weights in ./sd")
    http = TestClient(app)  # not entered: no lifespan, no engine

    # echo still loading, sd failed: nothing serves yet.
    health = http.get("/health")
    assert health.status_code == 503 and health.headers["Retry-After"] == "1"
    assert health.json() == {
        "status": "loading",
        "models": {"echo": {"status": "loading"}, "sd": {"status": "failed", "reason": "no weights in ./sd"}},
    }
    assert http.get("/readyz").json() == {"ready": False, "draining": False}
    loading = http.post(
        "/v1/chat/completions", headers=AUTH, json={"model": "echo", "messages": [{"role": "user", "content": "x"}]}
    )
    assert loading.status_code == 503 and loading.json()["error"]["code"] == "loading"
    failed = http.post("/v1/images/generations", headers=AUTH, json={"model": "sd", "prompt": "x"})
    assert failed.status_code == 503
    assert failed.json()["error"]["code"] == "model_unavailable"
    assert failed.json()["error"]["message"] == "the model `sd` failed to load: no weights in ./sd"

    # echo loaded: the server serves (degraded), and is ready; sd's requests still fail alone.
    echo.engine, echo.state = FakeEngine(), "loaded"
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert http.get("/readyz").json() == {"ready": True, "draining": False}
    ready = http.get("/readyz", headers=AUTH).json()
    assert {name: (m["ready"], m["state"]) for name, m in ready["models"].items()} == {
        "echo": (True, "loaded"),
        "sd": (False, "failed"),
    }
    assert ready["models"]["echo"]["max_pending"] == 7 and ready["models"]["sd"]["error"] == "no weights in ./sd"
    models = http.get("/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["state"], m["kinds"]) for m in models] == [
        ("echo", "loaded", ["text"]),
        ("sd", "failed", ["image"]),
    ]
    assert http.get("/v1/models/sd", headers=AUTH).json()["state"] == "failed"
    assert http.post("/v1/images/generations", headers=AUTH, json={"model": "sd", "prompt": "x"}).status_code == 503
    metrics = http.get("/metrics").text
    assert 'omni_engine_max_pending{model="echo"} 7.0' in metrics
    # The failed model has no engine series; the per-model ones (state, loads...) name it.
    assert not [line for line in metrics.splitlines() if line.startswith("omni_engine") and 'model="sd"' in line]
    assert 'omni_model_state{model="sd",state="failed"} 1.0' in metrics
