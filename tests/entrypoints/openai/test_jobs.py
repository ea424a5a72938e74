"""Async jobs on a real ``omni-runtime serve`` (tiny-sd, step execution, one request per step
batch, an API key, the in-memory job store): submit -> events -> result, the synchronous form,
SSE resume, cancel mid-denoise (and the replica serving the next job), the WebSocket, errors,
priority, metrics, and the openai client beside it all."""

from __future__ import annotations

import base64
import json
import time

import httpx
import openai
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .jobs_client import first_step, job_body, read_sse, submit, wait_status
from .server_process import one_thread_config, start_server, stop_server, wait_for

KEY = "job-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PNG = b"\x89PNG\r\n\x1a\n"
#: A job that denoises for minutes unless cancelled.
LONG_STEPS = 400


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jobs")
    sd = one_thread_config(tmp / "tiny-sd.yaml")
    srv = start_server(
        sd, "--step-execution", "--max-num-seqs", "1", "--api-key", KEY, "--job-ttl", "600", log=tmp / "server.log"
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        yield c


def _types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_submit_then_events_then_result(server, http):
    job = submit(http, job_body(steps=3))
    events = read_sse(http, job["job_id"])
    types = _types(events)
    assert types[0] == "queued" and types[-1] == "completed"
    assert types.index("started") < types.index("stage_done") < types.index("completed")
    ids = [int(e["id"]) for e in events]
    assert ids == sorted(set(ids)), "event ids grow within a job"
    started = events[types.index("started")]["data"]
    done = events[types.index("stage_done")]["data"]
    assert done["stage_id"] == 0 and done["batch_size"] == 1 and done["batch_id"] is not None
    assert "batch_id" in started and "batch_size" in started
    for step in (e["data"] for e in events if e["type"] == "step"):
        assert step["stage_id"] == 0 and 1 <= step["step"] <= step["steps"] == 3

    final = http.get(f"/v1/jobs/{job['job_id']}").json()
    assert final["status"] == "completed" and final["error"] is None
    assert final["finished_at"] >= final["started_at"] >= final["created_at"]
    assert final["timings"]["stages"]["0"]["batch_size"] == 1
    (image,) = final["result"]["images"]
    assert final["result"]["size"] == "64x64" and isinstance(image["seed"], int)
    png = http.get(image["url"])
    assert png.status_code == 200 and png.content.startswith(PNG)

    trace = http.get(f"/v1/jobs/{job['job_id']}/trace").json()
    names = [s["name"] for s in trace["spans"]]
    assert names[:2] == ["job", "admission"] and {"stage 0 queue", "stage 0 wave", "encode"} <= set(names)
    wave = trace["spans"][names.index("stage 0 wave")]
    assert wave["attributes"]["batch_size"] == 1 and wave["attributes"]["batch_id"] == done["batch_id"]
    # The VAE decode ends the wave; from there to the gateway is the transfer.
    decode = trace["spans"][names.index("stage 0 decode")]
    transfer = trace["spans"][names.index("stage 0 transfer")]
    assert wave["start"] < decode["start"] <= decode["end"] == wave["end"] == transfer["start"] <= transfer["end"]
    root = trace["spans"][0]
    for s in trace["spans"][1:]:
        assert root["start"] <= s["start"] <= s["end"] <= root["end"] + 1e-3, s


def test_the_synchronous_form_answers_the_same_shape_with_base64(server, http):
    r = http.post("/v1/generate", json=job_body(steps=2, async_run=False, response_format="b64_json"))
    assert r.status_code == 200, r.text[:300]
    job = r.json()
    assert job["status"] == "completed" and job["job_id"] == r.headers["x-request-id"]
    assert set(job) >= {"job_id", "status", "progress", "result", "error", "timings", "created_at"}
    assert base64.b64decode(job["result"]["images"][0]["b64_json"]).startswith(PNG)
    again = http.get(f"/v1/jobs/{job['job_id']}").json()
    assert again == job


def test_sse_resumes_after_last_event_id_without_gap_or_duplicate(server, http):
    job = submit(http, job_body(steps=4))
    head = read_sse(http, job["job_id"], limit=2)  # then the client goes away
    rest = read_sse(http, job["job_id"], last_event_id=head[-1]["id"])
    whole = read_sse(http, job["job_id"])  # the full replay, after the end
    assert head + rest == whole
    assert _types(whole)[-1] == "completed"
    # Reconnecting after the end gets nothing more, at once.
    start = time.monotonic()
    assert read_sse(http, job["job_id"], last_event_id=whole[-1]["id"]) == []
    assert time.monotonic() - start < 5


def test_cancel_mid_denoise_frees_the_replica_for_the_next_job(server, http):
    long = submit(http, job_body("a very long job", steps=LONG_STEPS))
    first_step(http, long["job_id"])
    nxt = submit(http, job_body("the next job", steps=2))  # waits: one request per step batch
    time.sleep(0.3)
    assert http.get(f"/v1/jobs/{nxt['job_id']}").json()["status"] == "queued"
    start = time.monotonic()
    r = http.delete(f"/v1/jobs/{long['job_id']}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    done = wait_status(http, nxt["job_id"], {"completed", "failed", "cancelled"}, timeout=60)
    assert done["status"] == "completed"
    assert time.monotonic() - start < 30
    events = read_sse(http, long["job_id"])
    assert _types(events)[-1] == "cancelled"
    steps = [e["data"]["step"] for e in events if e["type"] == "step"]
    assert steps and max(steps) < LONG_STEPS
    # Cancelling a finished job again changes nothing and is no error.
    for job_id, status in ((long["job_id"], "cancelled"), (nxt["job_id"], "completed")):
        again = http.delete(f"/v1/jobs/{job_id}")
        assert again.status_code == 200 and again.json()["status"] == status


def test_the_websocket_streams_events_and_takes_a_cancel(server, http):
    job = submit(http, job_body("over a websocket", steps=LONG_STEPS))
    url = server.url.replace("http://", "ws://") + f"/v1/jobs/{job['job_id']}/stream"
    seen: list[dict] = []
    with connect(url, additional_headers=AUTH, open_timeout=10) as ws:
        while not any(e["type"] == "step" for e in seen):
            seen.append(json.loads(ws.recv(timeout=60)))
        ws.send("not a command")
        assert json.loads(ws.recv(timeout=10))["type"] in ("error", "step")
        ws.send(json.dumps({"type": "cancel"}))
        while seen[-1]["type"] not in ("cancelled", "completed", "failed"):
            message = json.loads(ws.recv(timeout=30))
            if message["type"] != "error":
                seen.append(message)
    assert seen[0]["type"] == "queued" and seen[-1]["type"] == "cancelled"
    assert [int(e["id"]) for e in seen] == sorted({int(e["id"]) for e in seen})
    assert http.get(f"/v1/jobs/{job['job_id']}").json()["status"] == "cancelled"


def test_job_routes_need_the_api_key(server):
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        assert anonymous.post("/v1/generate", json=job_body()).status_code == 401
        assert anonymous.get("/v1/jobs/job-x").status_code == 401
        assert anonymous.get("/v1/jobs/job-x/events").status_code == 401
        assert anonymous.delete("/v1/jobs/job-x").status_code == 401
        assert anonymous.get("/v1/jobs/job-x/trace").status_code == 401
    url = server.url.replace("http://", "ws://") + "/v1/jobs/job-x/stream"
    with connect(url, open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 4401


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"task": "image2audio", "inputs": {"prompt": "x"}}, 400, "task"),
        ({"task": "image2video", "inputs": {"prompt": "x"}}, 400, "model"),  # an image model: no_video
        ({"task": "text2image", "inputs": {"prompt": "x", "image": "data:image/png;base64,AA=="}}, 400, "inputs.image"),
        ({"task": "text2image", "inputs": {}}, 400, "inputs.prompt"),
        (
            {"task": "text2image", "inputs": {"prompt": "x", "num_inference_steps": 0}},
            400,
            "inputs.num_inference_steps",
        ),
        ({"task": "text2image", "inputs": {"prompt": "x", "size": "7x7"}}, 400, "inputs.size"),
        ({"task": "text2image", "inputs": {"prompt": "x", "width": 64}}, 400, "inputs"),
        ({"task": "text2image", "inputs": {"prompt": "x"}, "config": {"steps": 3}}, 400, "config.steps"),
        ({"task": "text2image", "inputs": {"prompt": "x"}, "priority": 2**40}, 400, "priority"),
        ({"task": "text2image", "inputs": {"prompt": "x"}, "priority": "high"}, 400, "priority"),
        ({"task": "text2image", "inputs": {"prompt": "x"}, "model": "nope"}, 404, "model"),
        ({"task": "text2video", "inputs": {"prompt": "x"}}, 400, "model"),  # an image model: no_video
        ({"task": "text2image", "inputs": {"prompt": "x", "num_frames": 9}}, 400, "inputs.num_frames"),
    ],
)
def test_bad_jobs_are_typed_errors_naming_the_field(server, http, body, status, param):
    r = http.post("/v1/generate", json=body)
    assert r.status_code == status, r.text[:300]
    assert r.json()["error"]["param"] == param


def test_videos_on_an_image_model_are_a_400_naming_the_model(server, http):
    r = http.post("/v1/videos", json={"prompt": "a boat"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_video", r.text
    assert r.json()["error"]["param"] == "model"
    # A job that is no video is not one under /v1/videos.
    job = submit(http, job_body(steps=1))
    assert http.get(f"/v1/videos/{job['job_id']}").status_code == 404
    wait_status(http, job["job_id"], {"completed"})


def test_unknown_jobs_bad_event_ids_and_post_jobs(server, http):
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/trace"), ("GET", "/events")):
        r = http.request(method, f"/v1/jobs/job-doesnotexist{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    job = submit(http, job_body(steps=1))
    r = http.get(f"/v1/jobs/{job['job_id']}/events", headers={"Last-Event-ID": "1-0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
    r = http.post("/v1/jobs", json=job_body())
    assert r.status_code == 405 and "/v1/generate" in r.json()["error"]["message"]
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = http.post("/v1/generate", content=b"task=text2image", headers=form)
    assert r.status_code == 415
    wait_status(http, job["job_id"], {"completed"})


def _stage_depth(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('omni_stage_queue_depth{stage="0"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_high_priority_job_overtakes_low_ones_under_load(server, http):
    hog = submit(http, job_body("hog", steps=LONG_STEPS))  # holds the one replica until cancelled
    first_step(http, hog["job_id"])
    low = [submit(http, job_body(f"low {i}", steps=2, priority=0)) for i in range(2)]
    high = submit(http, job_body("high", steps=2, priority=10))
    # All three wait in the stage behind the hog; then the replica is freed for them.
    assert wait_for(lambda: _stage_depth(http) == 4, timeout=60)
    assert http.delete(f"/v1/jobs/{hog['job_id']}").json()["status"] == "cancelled"
    ends = {}
    for job in (*low, high):
        # A bound for a hang, not a speed check.
        done = wait_status(http, job["job_id"], {"completed"}, timeout=300)
        ends[job["job_id"]] = done["finished_at"]
    assert ends[high["job_id"]] < min(ends[j["job_id"]] for j in low)


def test_metrics_and_readyz_show_jobs(server, http):
    submit_done = http.post("/v1/generate", json=job_body(steps=1, async_run=False)).json()
    assert submit_done["status"] == "completed"
    text = http.get("/metrics").text
    assert 'omni_runtime_jobs_total{status="completed"}' in text
    assert 'omni_runtime_jobs_total{status="cancelled"}' in text or "cancelled" not in text
    assert 'omni_runtime_stage_wave_seconds_count{stage="0"}' in text
    assert 'omni_stage_queue_depth{stage="0"}' in text
    ready = http.get("/readyz").json()
    assert ready["job_store"]["backend"] == "memory" and ready["job_store"]["ok"] is True
    assert ready["remote_replicas"] == 0


def test_the_openai_client_works_unchanged_beside_jobs(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    result = client.images.generate(prompt="a red fox", size="64x64", response_format="b64_json")
    assert base64.b64decode(result.data[0].b64_json).startswith(PNG)
    assert [m.id for m in client.models.list().data] == ["tiny-sd"]
