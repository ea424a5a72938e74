"""Hostile input to the job routes of a real ``omni-runtime serve``: fuzzed ``/v1/generate``
bodies, job ids, ``Last-Event-ID`` values and WebSocket messages. The answer is never a 5xx, every
error is the OpenAI error shape naming what is wrong, and afterwards the server still runs jobs
with the same stage process."""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from tests.strategies import ANY_TEXT, EDGE_INTS, JSON_VALUES

from .jobs_client import job_body, read_sse, submit, wait_status
from .server_process import one_thread_config, start_server, stop_server, wait_for

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jobs-hostile")
    sd = one_thread_config(tmp / "tiny-sd.yaml")
    srv = start_server(sd, "--max-pending", "8", "--max-jobs", "64", "--job-ttl", "30", log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def stage_pid(server):
    (stage,) = server.stage_processes()
    return stage.pid


# Valid bodies are cheap (one 32x32 step) so that the engine keeps up with the fuzzer.
valid_inputs = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=40)},
    optional={
        "seed": st.integers(0, 2**63 - 1) | EDGE_INTS,
        "negative_prompt": st.text(max_size=20),
        "guidance_scale": st.floats(0, 20),
    },
).map(lambda d: {**d, "num_inference_steps": 1, "size": "32x32"})
valid_bodies = st.fixed_dictionaries(
    {"task": st.just("text2image"), "inputs": valid_inputs},
    optional={
        "async_run": st.booleans(),
        "priority": st.integers(-5, 5) | EDGE_INTS,
        "response_format": st.sampled_from(["url", "b64_json", "URL", ""]),
        "config": st.fixed_dictionaries(
            {},
            optional={
                "output_format": st.sampled_from(["png", "jpeg", "gif"]),
                "timeout": JSON_VALUES,
                "slo_ms": JSON_VALUES,
            },
        ),
        "model": st.sampled_from(["tiny-sd", "other", ""]),
    },
)
hostile_values = JSON_VALUES | ANY_TEXT | st.sampled_from(["x" * 100_001, "0x0", "100000x100000", "\udfff"])
mutated = st.tuples(
    valid_bodies, st.sampled_from(["task", "inputs", "config", "priority", "async_run", "model", "x"]), hostile_values
).map(lambda t: {**t[0], t[1]: t[2]})
mutated_inputs = st.tuples(
    valid_bodies,
    st.sampled_from(["prompt", "size", "width", "height", "seed", "num_inference_steps", "guidance_scale", "y"]),
    hostile_values,
).map(lambda t: {**t[0], "inputs": {**t[0]["inputs"], t[1]: t[2]}})
generate_bodies = st.one_of(valid_bodies, mutated, mutated_inputs, JSON_VALUES)


def _check(resp: httpx.Response, what: str) -> None:
    assert resp.status_code < 500, f"{what} -> {resp.status_code}: {resp.text[:500]}"
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["message"] and error["type"], resp.text[:300]


@FUZZ
@given(body=generate_bodies)
def test_fuzzed_generate_bodies_never_get_a_5xx(http, body):
    content = json.dumps(body, allow_nan=True).encode()
    resp = http.post("/v1/generate", content=content, headers={"Content-Type": "application/json"})
    _check(resp, f"POST /v1/generate {content[:200]!r}")
    if resp.status_code in (200, 202):
        assert resp.json()["job_id"].startswith("job-")
    elif resp.status_code == 400 and isinstance(body, dict):
        assert resp.json()["error"]["param"] is not None, resp.text[:300]  # it names the field


latin1 = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40)


@FUZZ
@given(
    job_id=ANY_TEXT | latin1 | st.sampled_from(["job-", "..", "%00", "job-" + "a" * 500]),
    method=st.sampled_from(["GET", "DELETE", "POST", "PUT"]),
    suffix=st.sampled_from(["", "/events", "/trace", "/stream", "/x"]),
    last_event_id=st.none() | latin1 | st.sampled_from(["0", "-1", "99999999999999999999", "1-0", " 1"]),
)
def test_fuzzed_job_routes_never_get_a_5xx(http, job_id, method, suffix, last_event_id):
    path = "/v1/jobs/" + quote(job_id.encode("utf-8", "surrogatepass"), safe="") + suffix
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id.encode("latin-1")}
    try:
        resp = http.request(method, path, headers=headers)
    except httpx.LocalProtocolError:
        assume(False)  # a header value HTTP itself cannot carry (h11 refuses to send it)
        return
    _check(resp, f"{method} {path}")


def _idle(http: httpx.Client) -> None:
    """Wait until the fuzzed jobs have left the engine (they are admitted up to max_pending)."""
    assert wait_for(lambda: http.get("/readyz").json()["pending"] == 0, timeout=120, interval=0.1)


def test_last_event_ids_of_a_real_job_never_break_its_stream(http):
    _idle(http)
    job = submit(http, job_body(steps=1))
    wait_status(http, job["job_id"], {"completed"})
    for bad in ["abc", "-1", "1-0", "9" * 19, "", "1 1"]:
        resp = http.get(f"/v1/jobs/{job['job_id']}/events", headers={"Last-Event-ID": bad})
        assert resp.status_code in (200, 400), resp.text
    assert read_sse(http, job["job_id"], last_event_id="999999") == []


@settings(max_examples=25, deadline=None, database=None, derandomize=True)
@given(message=st.one_of(ANY_TEXT, latin1, JSON_VALUES.map(json.dumps), st.binary(max_size=64)))
def test_fuzzed_websocket_messages_get_an_error_and_the_stream_goes_on(server, http, message):
    _idle(http)
    job = submit(http, job_body(steps=1))
    url = server.url.replace("http://", "ws://") + f"/v1/jobs/{job['job_id']}/stream"
    if isinstance(message, str):
        message = message.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    with connect(url, open_timeout=10) as ws:
        ws.send(message)
        seen = []
        while not seen or seen[-1].get("type") not in ("completed", "failed", "cancelled"):
            seen.append(json.loads(ws.recv(timeout=60)))
    assert seen[-1]["type"] in ("completed", "cancelled")  # a hostile message may be a cancel


def test_after_all_that_the_server_still_runs_jobs(server, http, stage_pid):
    assert http.get("/health").status_code == 200
    _idle(http)
    r = http.post("/v1/generate", json=job_body(steps=2, async_run=False))
    assert r.status_code == 200 and r.json()["status"] == "completed", r.text[:300]
    assert [p.pid for p in server.stage_processes()] == [stage_pid]
    # Well over --max-jobs were submitted: the in-memory store kept to its bound.
    store = http.get("/readyz").json()["job_store"]
    assert store["backend"] == "memory" and 0 < store["jobs"] <= 64
