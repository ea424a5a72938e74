"""One real server under a budget of one loaded model: tiny-sd (put to sleep when evicted) and a
lazy echo model. /v1/models shows which is loaded and which asleep or unloaded; a job for the
evicted model shows a ``loading`` event in its event stream, then completes; /v1/status and
control calls answer per model; /metrics counts the loads, wakes and evictions by model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .server_process import ServerProcess, start_server, stop_server, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    tmp = tmp_path_factory.mktemp("lazymodels")
    (tmp / "models.yaml").write_text("echo: {config: echo, lazy: true}\n")
    args = ("sd=tiny-sd", "--models-file", str(tmp / "models.yaml"), "--max-loaded-models", "1")
    srv: ServerProcess = start_server(*args, log=tmp / "server.log")
    try:
        loaded = lambda: httpx.get(f"{srv.url}/v1/models").json()["data"][0]["state"] == "loaded"  # noqa: E731
        assert wait_for(loaded, timeout=120), srv.log()[-3000:]
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c
    finally:
        stop_server(srv)


def states(http: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["state"] for m in http.get("/v1/models").json()["data"]}


def test_eviction_then_a_job_for_the_evicted_model_shows_loading(http: httpx.Client) -> None:
    assert states(http) == {"sd": "loaded", "echo": "unloaded"}
    chat = {"model": "echo", "messages": [{"role": "user", "content": "wake echo"}]}
    answer = http.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "wake echo"
    assert states(http) == {"sd": "asleep", "echo": "loaded"}

    body = {"model": "sd", "task": "text2image", "inputs": {"prompt": "a fox", "size": "32x32"}}
    job = http.post("/v1/generate", json={**body, "async_run": True}).json()
    with http.stream("GET", f"/v1/jobs/{job['job_id']}/events") as events:
        kinds = [line.removeprefix("event: ") for line in events.iter_lines() if line.startswith("event: ")]
    assert kinds[:2] == ["queued", "loading"] and kinds[-1] == "completed", kinds
    assert states(http) == {"sd": "loaded", "echo": "asleep"}

    status = http.get("/v1/status").json()["models"]
    by_name = {s["model"]: s for s in status}
    assert by_name["sd"]["state"] == "loaded" and by_name["sd"]["wakes"] == 1 and by_name["sd"]["stages"]
    assert by_name["echo"]["state"] == "asleep" and by_name["echo"]["evictions"] == 1
    one = http.get("/v1/status", params={"model": "echo"}).json()
    assert one["model"] == "echo" and one["loads"] == 1
    assert http.get("/v1/status", params={"model": "nope"}).status_code == 404

    # A control call without a model goes to every loaded one, each result naming it.
    results = http.post("/v1/omni/collective_rpc", json={"method": "ping"}).json()
    assert {r["model"] for r in results} == {"sd"} and all(r["ok"] for r in results)
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    evictions = {s.labels["model"]: s.value for s in families["omni_model_evictions"].samples}
    assert evictions == {"sd": 1.0, "echo": 1.0}
