"""Jobs across gateways on one real redis-server: two ``serve --redis-url`` processes share jobs
(read, stream, resume and cancel from the other), a SIGKILLed gateway's jobs are re-queued once
by the next gateway and fail with ``gateway_lost`` when lost again, and gateway A exports each
job's trace over OTLP/HTTP to a real local receiver that decodes the protobuf."""

from __future__ import annotations

import http.server
import io
import json
import signal
import threading
import time
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from PIL import Image
from websockets.sync.client import connect

from .jobs_client import first_step, job_body, read_sse, submit, wait_status
from .server_process import (
    ServerProcess,
    assert_gone,
    free_port,
    one_thread_config,
    start_server,
    start_servers,
    stop_server,
    stop_servers,
    wait_for,
)

LONG_STEPS = 400
#: Gateway B's --public-url (nothing listens there: its files are fetched by path).
PUBLIC_URL = "https://images.example:8443/api"


class _Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP traces endpoint: every span it is sent, decoded."""

    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    receiver.paths.append(self.path)
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture(scope="module")
def receiver():
    r = _Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def gateways(tmp_path_factory, redis_server, receiver):
    tmp = tmp_path_factory.mktemp("gateways")
    # A lease of 2 s: a gateway stopped cleanly has its jobs taken over by these within seconds.
    sd = one_thread_config(tmp / "tiny-sd.yaml")
    common = (sd, "--step-execution", "--max-num-seqs", "1", "--redis-url", redis_server.url, "--job-lease", "2")
    a, b = start_servers(
        ((*common, "--otlp-endpoint", receiver.url), tmp / "a.log"),
        ((*common, "--public-url", PUBLIC_URL), tmp / "b.log"),
    )
    yield a, b
    stop_servers(a, b)


@pytest.fixture(scope="module")
def clients(gateways):
    a, b = gateways
    with httpx.Client(base_url=a.url, timeout=120) as ca, httpx.Client(base_url=b.url, timeout=120) as cb:
        yield ca, cb


def test_a_job_submitted_on_a_is_read_streamed_and_resumed_on_b(clients):
    a, b = clients
    job = submit(a, job_body(steps=3))
    assert b.get(f"/v1/jobs/{job['job_id']}").json()["status"] in ("queued", "running", "completed")
    head = read_sse(a, job["job_id"], limit=2)
    rest = read_sse(b, job["job_id"], last_event_id=head[-1]["id"])  # resumed on the other gateway
    assert [e["type"] for e in rest][-1] == "completed"
    assert head + rest == read_sse(b, job["job_id"]) == read_sse(a, job["job_id"])
    assert a.get(f"/v1/jobs/{job['job_id']}").json() == b.get(f"/v1/jobs/{job['job_id']}").json()
    ready = b.get("/readyz").json()
    assert ready["job_store"]["backend"] == "redis" and ready["job_store"]["ok"] is True


def test_b_cancels_a_job_running_on_a(clients):
    a, b = clients
    job = submit(a, job_body("long, on a", steps=LONG_STEPS))
    first_step(b, job["job_id"])  # streamed from b while a runs it
    r = b.delete(f"/v1/jobs/{job['job_id']}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert [e["type"] for e in read_sse(a, job["job_id"])][-1] == "cancelled"
    # a's replica is free again: its next job completes.
    nxt = submit(a, job_body("next, on a", steps=2))
    assert wait_status(b, nxt["job_id"], {"completed", "failed"}, timeout=60)["status"] == "completed"
    assert b.delete(f"/v1/jobs/{job['job_id']}").json()["status"] == "cancelled"  # idempotent


def test_gateway_a_exports_the_job_trace_over_otlp(clients, receiver):
    a, _ = clients
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = a.post(
        "/v1/generate",
        json=job_body(steps=2, async_run=False),
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    job = r.json()
    assert job["status"] == "completed" and job["trace_id"] == trace_id

    def spans_of_trace() -> list:
        with receiver.lock:
            return [s for s in receiver.spans if s.trace_id.hex() == trace_id]

    assert wait_for(lambda: any(s.name == "job" for s in spans_of_trace()), timeout=20), receiver.paths
    assert all(p == "/v1/traces" for p in receiver.paths)
    spans = {s.name: s for s in spans_of_trace()}
    assert {"job", "admission", "stage 0 queue", "stage 0 wave", "encode"} <= set(spans)
    root = spans["job"]
    assert root.parent_span_id.hex() == parent_id  # joined the caller's trace
    for name, s in spans.items():
        if name != "job":
            assert s.parent_span_id == root.span_id, name
            assert root.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano
    attributes = {kv.key: kv.value for kv in spans["stage 0 wave"].attributes}
    assert attributes["batch_size"].int_value == 1


# --------------------------------------------------------------------------- url results


def _file_path(url: str) -> str:
    return "/v1/files/" + url.rsplit("/", 1)[1]


def _png(r: httpx.Response) -> tuple[int, int]:
    assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text[:300]
    return Image.open(io.BytesIO(r.content)).size


def test_url_results_are_served_by_every_gateway(gateways, clients):
    a, b = clients
    job = wait_status(b, submit(a, job_body("a url result", steps=1))["job_id"], {"completed"}, timeout=60)
    url = job["result"]["images"][0]["url"]
    assert url.startswith(f"{gateways[0].url}/v1/files/file-"), url
    assert _png(b.get(_file_path(url))) == _png(a.get(_file_path(url)))  # stored in Redis, not in a
    small = {"prompt": "x", "response_format": "url", "num_inference_steps": 1, "size": "32x32"}
    made = a.post("/v1/images/generations", json=small).json()["data"][0]["url"]
    assert _png(b.get(_file_path(made))) == (32, 32)
    # Result URLs: B's --public-url whatever the Host header says; A (none set) follows the Host.
    host = {"Host": "elsewhere.example"}
    assert (
        b.post("/v1/images/generations", json=small, headers=host)
        .json()["data"][0]["url"]
        .startswith(f"{PUBLIC_URL}/v1/files/file-")
    )
    job = submit(b, job_body("a public url", steps=1))
    job = wait_status(a, job["job_id"], {"completed"}, timeout=60)
    assert job["result"]["images"][0]["url"].startswith(f"{PUBLIC_URL}/v1/files/file-")
    assert (
        a.post("/v1/images/generations", json=small, headers=host)
        .json()["data"][0]["url"]
        .startswith("http://elsewhere.example/v1/files/file-")
    )


def test_a_file_404_does_not_echo_a_long_id(clients):
    _, b = clients
    for file_id in ("x" * 12_000, "file-" + "a" * 24 + ":x", "file-short"):
        r = b.get(f"/v1/files/{file_id}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text[:300]
        assert len(r.content) < 500


# --------------------------------------------------------------------------- hostile ids

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def finished_job(clients):
    a, _ = clients
    job = submit(a, job_body("finished", steps=1))
    return wait_status(a, job["job_id"], {"completed"}, timeout=60)


def _job_routes(http: httpx.Client, job_id: str) -> list[httpx.Response]:
    path = "/v1/jobs/" + quote(job_id, safe="")
    return [http.get(path), http.delete(path), http.get(f"{path}/events"), http.get(f"{path}/trace")]


def test_other_keys_of_a_job_are_not_jobs(gateways, clients, finished_job):
    a, b = clients
    job_id = finished_job["job_id"]
    for other in (f"{job_id}:events", f"{job_id}:x", job_id[:-1], f"{job_id}A"):
        for r in _job_routes(b, other):
            assert r.status_code == 404, (other, r.request.method, r.request.url, r.text[:300])
            assert r.json()["error"]["code"] == "not_found"
        url = gateways[1].url.replace("http://", "ws://") + f"/v1/jobs/{quote(other, safe='')}/stream"
        with connect(url, open_timeout=10) as ws:
            assert json.loads(ws.recv(timeout=10))["error"]["code"] == "not_found"
        assert ws.close_code == 4404
    assert a.get(f"/v1/jobs/{job_id}").json()["status"] == "completed"  # still served


id_chars = st.text(st.sampled_from("abcXYZ019_-:.~"), max_size=30)


@PROPERTY
@given(prefix=st.sampled_from(["", "job-", "{id}", "{id}:", "{id}:events"]), tail=id_chars)
def test_any_id_but_a_jobs_own_is_a_404(clients, finished_job, prefix, tail):
    _, b = clients
    job_id = finished_job["job_id"]
    candidate = prefix.replace("{id}", job_id) + tail
    # "." and ".." are dot-segments: the client removes them from the path (RFC 3986), so they
    # address other routes (GET /v1/jobs is a 405), never a job id.
    assume(candidate not in (".", ".."))
    for r in _job_routes(b, candidate):
        if candidate == job_id:
            assert r.status_code == 200, r.text[:300]
        else:
            assert r.status_code == 404, (candidate, r.request.method, r.text[:300])


def test_a_last_event_id_past_64_bits_is_a_400(clients, finished_job):
    a, b = clients
    job_id = finished_job["job_id"]
    for bad in ("99999999999999999999-0", "0-18446744073709551616", "1-0-0", "+1-0"):
        r = b.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID", (bad, r.text[:300])
    # The largest ids Redis takes: nothing after them (the very last one has nothing after it at all).
    assert read_sse(a, job_id, last_event_id="18446744073709551615-18446744073709551614") == []
    r = b.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "18446744073709551615-18446744073709551615"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"


@PROPERTY
@given(
    event_id=st.one_of(
        st.builds("{}-{}".format, st.integers(0, 2**70), st.integers(0, 2**70)),
        st.builds("{}-{}".format, st.integers(2**64 - 2, 2**64), st.integers(2**64 - 2, 2**64)),
        st.builds(str, st.integers(-(2**70), 2**70)),
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=45),
    )
)
def test_any_last_event_id_is_a_400_or_a_whole_stream(clients, finished_job, event_id):
    _, b = clients
    job_id = finished_job["job_id"]
    event_id = event_id.strip()  # HTTP cannot carry a header value's outer spaces
    with b.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": event_id}) as r:
        body = r.read()  # the whole body: a stream cut by the server raises here
    if r.status_code == 400:
        assert json.loads(body)["error"]["param"] == "Last-Event-ID"
        return
    assert r.status_code == 200, body[:300]
    if not event_id:
        return  # an empty header is no Last-Event-ID: the whole stream
    a_part, _, b_part = event_id.partition("-")
    assert int(a_part) < 2**64 and int(b_part) < 2**64  # only a real stream id is taken


# --------------------------------------------------------------------------- durability


def _denoising(http: httpx.Client, job_id: str, attempt: int = 2) -> bool:
    job = http.get(f"/v1/jobs/{job_id}").json()
    return job["attempts"] == attempt and job["status"] == "running" and job["progress"] is not None


def _kill(server) -> None:
    children = server.children()
    server.signal(signal.SIGKILL)
    server.wait(30)
    assert_gone(children, timeout=20)  # its stage processes follow it


def test_a_killed_gateways_jobs_are_requeued_once_then_lost(tmp_path, redis_server):
    # Database 1: the module's gateways (database 0) must not be the ones that recover these.
    url = redis_server.url.rsplit("/", 1)[0] + "/1"
    sd = one_thread_config(tmp_path / "tiny-sd.yaml")
    common = (sd, "--step-execution", "--redis-url", url, "--job-lease", "1")
    # d runs beside c from the start (their loads overlap): it owns nothing until c's lease runs out.
    c, d = start_servers(
        ((*common, "--max-num-seqs", "1"), tmp_path / "c.log"),
        ((*common, "--max-num-seqs", "2"), tmp_path / "d.log"),
    )
    try:
        with httpx.Client(base_url=c.url, timeout=60) as http:
            running = submit(http, job_body("running when killed", steps=LONG_STEPS))
            first_step(http, running["job_id"])
            queued = submit(http, job_body("queued when killed", steps=2))
            assert http.get(f"/v1/jobs/{queued['job_id']}").json()["status"] == "queued"
        _kill(c)
    except BaseException:
        stop_servers(c, d)
        raise

    # The live gateway recovers both once c's lease ran out (its lease check runs every lease).
    try:
        with httpx.Client(base_url=d.url, timeout=60) as http:
            done = wait_status(http, queued["job_id"], {"completed", "failed"}, timeout=90)
            assert done["status"] == "completed" and done["attempts"] == 2
            # Its url result points at d, which took it over and serves it (c is gone).
            result_url = done["result"]["images"][0]["url"]
            assert result_url.startswith(f"{d.url}/v1/files/file-"), result_url
            assert _png(http.get(result_url)) == (64, 64)
            types = [e["type"] for e in read_sse(http, queued["job_id"])]
            assert types[0] == "queued" and "requeued" in types and types[-1] == "completed"
            assert types.index("requeued") < len(types) - 1 - types[::-1].index("queued")
            # The long job denoises again (its progress was reset when it was re-queued).
            assert wait_for(lambda: _denoising(http, running["job_id"]), timeout=90, interval=0.1)
            assert http.get(f"/v1/jobs/{running['job_id']}").json()["attempts"] == 2
    except BaseException:
        stop_server(d)
        raise
    _kill(d)

    # Lost a second time: the next gateway (its lease check at start) fails it with gateway_lost
    # instead of running it again.
    e = start_server(*common, log=tmp_path / "e.log")
    try:
        with httpx.Client(base_url=e.url, timeout=60) as http:
            lost = wait_status(http, running["job_id"], {"completed", "failed", "cancelled"}, timeout=90)
            assert lost["status"] == "failed" and lost["error"]["code"] == "gateway_lost"
            assert [ev["type"] for ev in read_sse(http, running["job_id"])][-1] == "failed"
            assert _png(http.get(_file_path(result_url))) == (64, 64)  # d's file outlives d
            assert time.time() - lost["finished_at"] < 120
    finally:
        stop_server(e)


def test_an_unreachable_redis_stops_the_server_at_start_saying_so(tmp_path):
    dead_port = free_port()  # nothing listens there
    server = ServerProcess("tiny-sd", "--redis-url", f"redis://127.0.0.1:{dead_port}/0", log=tmp_path / "s.log")
    try:
        assert server.wait(60) != 0
    finally:
        server.stop()
    assert "job store (redis) cannot be reached" in server.log()


def test_a_gateway_stopped_cleanly_hands_its_unfinished_jobs_over(tmp_path, redis_server, clients):
    # On the module's database: its two (idle) gateways are the next ones, and one takes the job over.
    sd = one_thread_config(tmp_path / "tiny-sd.yaml")
    common = (sd, "--step-execution", "--redis-url", redis_server.url, "--job-lease", "1")
    f = start_server(*common, log=tmp_path / "f.log")
    with httpx.Client(base_url=f.url, timeout=60) as http:
        job = submit(http, job_body("running at SIGTERM", steps=LONG_STEPS))
        first_step(http, job["job_id"])
    stop_server(f)  # SIGTERM: exit 0, no stage process left; the job is left to the next gateway
    a, b = clients
    # Left as it was (running, attempt 1), then re-queued and denoising again on a or b.
    assert wait_for(lambda: _denoising(b, job["job_id"], attempt=2), timeout=90, interval=0.1)
    assert a.delete(f"/v1/jobs/{job['job_id']}").json()["status"] == "cancelled"
