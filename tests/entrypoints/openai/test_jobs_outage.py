"""Jobs under faults, on real processes: a gateway on its own redis-server (append-only file, so a
SIGKILL loses nothing) with a small event-stream budget. More SSE streams and synchronous jobs
than the budget get 503 + Retry-After, never a 500 or a hang; a Redis killed and restarted, or
stopped and continued, with jobs in flight: every job still ends with exactly one terminal event,
seen from a second gateway, and cancel across gateways works again after the restart;
calls during the outage are 503 within seconds and /readyz says not ready. Two gateways on one
Redis, one SIGSTOPped past its lease mid-job: the job ends once, and its status never goes back
from a terminal state. A full in-memory store is a 429."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.redis_server import RedisServer

from .jobs_client import first_step, job_body, read_sse, submit, wait_status
from .server_process import one_thread_config, start_server, start_servers, stop_server, stop_servers, wait_for

BUDGET = 8
TERMINAL = {"completed", "failed", "cancelled"}


@pytest.fixture(scope="module")
def redis_aof():
    server = RedisServer(appendonly=True)
    yield server
    server.stop()


def every_step_sd(tmp) -> str:
    """tiny-sd with progress after every step: the tests wait for a job's first step before the
    fault, and a short job must not end before the progress throttle lets one through."""
    return one_thread_config(tmp / "tiny-sd.yaml", progress_interval_s=0)


@pytest.fixture(scope="module")
def gateways(tmp_path_factory, redis_aof):
    """The gateway under test and a second one on the same store (what every gateway sees, and
    cancel across gateways), started together."""
    tmp = tmp_path_factory.mktemp("outage")
    sd = every_step_sd(tmp)
    servers = start_servers(
        ((sd, "--step-execution", "--max-num-seqs", "4", "--redis-url", redis_aof.url,
          "--job-streams", str(BUDGET), "--redis-connections", "4", "--redis-timeout", "1", "--job-lease", "2"),
         tmp / "gw.log"),
        ((sd, "--step-execution", "--redis-url", redis_aof.url, "--redis-timeout", "1", "--job-lease", "2"),
         tmp / "gw-b.log"),
    )  # fmt: skip
    yield servers
    stop_servers(*servers)


@pytest.fixture(scope="module")
def gateway(gateways):
    return gateways[0]


@pytest.fixture(scope="module")
def gateway_b(gateways):
    return gateways[1]


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        yield client


def _terminal_events(http: httpx.Client, job_id: str) -> list[str]:
    return [e["type"] for e in read_sse(http, job_id, timeout=60) if e["type"] in TERMINAL]


def _ends_once(http: httpx.Client, job_ids: list[str], timeout: float = 90) -> None:
    for job_id in job_ids:
        job = wait_status(http, job_id, TERMINAL, timeout=timeout)
        assert _terminal_events(http, job_id) == [job["status"]], job_id


def _sync_job(url: str, i: int | str, steps: int = 2) -> tuple[int, str | None, dict]:
    with httpx.Client(base_url=url, timeout=180) as c:
        r = c.post("/v1/generate", json=job_body(f"sync {i}", steps=steps, async_run=False))
        return r.status_code, r.headers.get("retry-after"), r.json()


def test_more_streams_and_synchronous_jobs_than_the_budget_get_503_never_500(gateway, http):
    long_job = submit(http, job_body("held open by many streams", steps=400))
    answers: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def stream() -> list[str]:
        url = f"{gateway.url}/v1/jobs/{long_job['job_id']}/events"
        with httpx.Client(timeout=180) as c, c.stream("GET", url) as r:
            with lock:
                answers.append((r.status_code, r.headers.get("retry-after")))
            return [line for line in r.iter_lines() if line.startswith("event: ")]

    with ThreadPoolExecutor(32) as pool:
        # 1) 20 streams on one job: BUDGET of them are served, the others refused at once.
        streams = [pool.submit(stream) for _ in range(20)]
        assert wait_for(lambda: len(answers) == 20, timeout=60), answers
        assert sorted(code for code, _ in answers) == [200] * BUDGET + [503] * (20 - BUDGET)
        assert all(ra is not None and int(ra) >= 1 for code, ra in answers if code == 503)
        # 2) the budget is spent: a synchronous job is refused before it exists; reads and
        #    writes of the store go on at once.
        code, retry_after, body = _sync_job(gateway.url, -1)
        assert code == 503 and retry_after and body["error"]["code"] == "stream_budget"
        started = time.monotonic()
        assert http.get(f"/v1/jobs/{long_job['job_id']}").json()["status"] in ("queued", "running")
        assert time.monotonic() - started < 2
        # 3) the job ends (cancelled: no slot needed): every open stream ends with it.
        assert http.delete(f"/v1/jobs/{long_job['job_id']}").json()["status"] == "cancelled"
        ended = [f.result(timeout=60) for f in streams]
        assert sum(1 for lines in ended if lines and lines[-1] == "event: cancelled") == BUDGET
        # 4) 12 synchronous jobs at once against a budget of 8: 200 or 503, each job ends.
        syncs = [f.result(timeout=180) for f in [pool.submit(_sync_job, gateway.url, i) for i in range(12)]]
    assert {code for code, _, _ in syncs} <= {200, 503}, [s[:2] for s in syncs]
    done = [job for code, _, job in syncs if code == 200]
    assert len(done) >= BUDGET and all(job["status"] == "completed" for job in done)
    _ends_once(http, [long_job["job_id"], *(job["job_id"] for job in done)])


def _jobs_queued(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('omni_runtime_jobs_total{status="queued"}'):
            return float(line.split()[-1])
    return 0.0


def test_redis_killed_and_restarted_mid_job_every_job_ends_once(gateway, gateway_b, http, redis_aof):
    # Redis SIGKILLed (append-only file) with jobs running on gateway A, one ending during the
    # outage and a synchronous request waiting; restarted once A holds that job's end.
    short = submit(http, job_body("ends during the outage", steps=6))
    running = [submit(http, job_body(f"running at the kill {i}", steps=14)) for i in range(2)]
    queued = _jobs_queued(http)
    with ThreadPoolExecutor(1) as pool:
        sync = pool.submit(_sync_job, gateway.url, "waiting at the kill", 14)
        assert wait_for(lambda: _jobs_queued(http) == queued + 1, timeout=30)  # its job exists
        first_step(http, short["job_id"])
        redis_aof.kill()
        try:
            # Its image (a url result) waits for the file store, which is Redis too; then its end.
            held = f"job {short['job_id']}: its result waits for the file store"
            assert wait_for(lambda: held in gateway.log(), timeout=90), gateway.log()[-3000:]
            # The synchronous request gets a 503 that names its job, which goes on.
            code, retry_after, body = sync.result(timeout=30)
        finally:
            redis_aof.restart()
    restarted = time.monotonic()
    assert code == 503 and retry_after and body["error"]["code"] == "job_store_unavailable", body
    ids = [short["job_id"], *(j["job_id"] for j in running), body["error"]["job_id"]]
    with httpx.Client(base_url=gateway_b.url, timeout=60) as other:
        # The result and end A held are written within the backoff (at most 5 s) of the restart,
        # and its image is served by the other gateway.
        done = wait_status(other, short["job_id"], TERMINAL, timeout=20)
        assert done["status"] == "completed" and time.monotonic() - restarted < 20, done
        url = done["result"]["images"][0]["url"]
        image = other.get(f"/v1/files/{url.rsplit('/', 1)[-1]}")
        assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
        for job_id in ids:  # every job: one terminal event, seen from both gateways, run once
            job = wait_status(other, job_id, TERMINAL, timeout=90)
            assert job["status"] == "completed" and job["attempts"] == 1, job
            r = http.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 200 and r.json()["status"] == "completed", r.text[:300]
            assert _terminal_events(other, job_id) == ["completed"], job_id
        # Cancel across gateways works again: A's cancel channel subscribed anew.
        assert wait_for(lambda: "job cancel channel: subscribed again" in gateway.log(), timeout=30)
        long_job = submit(http, job_body("cancelled through the other gateway", steps=200))
        first_step(http, long_job["job_id"])
        assert other.delete(f"/v1/jobs/{long_job['job_id']}").json()["status"] == "cancelled"
        assert _terminal_events(http, long_job["job_id"]) == ["cancelled"]


def test_redis_stopped_calls_are_503_within_seconds_and_jobs_end_once_after(http, redis_aof):
    running = [submit(http, job_body(f"running at the stop {i}", steps=25)) for i in range(3)]
    first_step(http, running[0]["job_id"])
    redis_aof.pause()
    try:
        for method, path in (
            ("GET", f"/v1/jobs/{running[0]['job_id']}"),
            ("DELETE", f"/v1/jobs/{running[1]['job_id']}"),
            ("GET", f"/v1/jobs/{running[0]['job_id']}/events"),
            ("GET", f"/v1/jobs/{running[0]['job_id']}/trace"),
            ("GET", "/v1/files/file-" + "a" * 24),  # result files live in the same Redis
        ):
            started = time.monotonic()
            r = http.request(method, path)
            assert r.status_code == 503 and r.headers.get("retry-after"), (path, r.status_code, r.text[:300])
            assert time.monotonic() - started < 6, path
        r = http.post("/v1/generate", json=job_body("while redis is stopped", steps=2))
        assert r.status_code == 503 and r.headers.get("retry-after")
        ready = http.get("/readyz")
        assert ready.status_code == 503 and ready.json()["job_store"]["ok"] is False
        time.sleep(3)  # the outage outlasts the lease and every job's end (the fault, not a wait)
    finally:
        redis_aof.resume()
    _ends_once(http, [j["job_id"] for j in running])
    assert wait_for(lambda: http.get("/readyz").status_code == 200, timeout=30)


def test_a_paused_gateway_past_its_lease_does_not_end_a_job_twice(gateway, gateway_b, http):
    a, b = gateway, gateway_b  # the module's two gateways on one Redis, idle here
    with httpx.Client(base_url=b.url, timeout=60) as cb:
        job = submit(http, job_body("paused mid-job", steps=20))  # run twice: by a, then by b
        first_step(http, job["job_id"])
        logged = len(a.log())
        a.signal(signal.SIGSTOP)
        try:  # b claims the job once a's lease ran out, and runs it again
            assert wait_for(lambda: cb.get(f"/v1/jobs/{job['job_id']}").json()["attempts"] == 2, timeout=30)
        finally:
            a.signal(signal.SIGCONT)
        seen: list[str] = []
        end = time.monotonic() + 120
        while time.monotonic() < end:
            seen.append(cb.get(f"/v1/jobs/{job['job_id']}").json()["status"])
            if seen[-1] in TERMINAL and len(seen) > 1:
                break
            time.sleep(0.05)
        assert seen[-1] == "completed", seen
        first_end = next(i for i, s in enumerate(seen) if s in TERMINAL)
        assert set(seen[first_end:]) == {"completed"}
        assert _terminal_events(cb, job["job_id"]) == ["completed"]
        # a was not blamed on its stage: it serves its next job.
        nxt = submit(http, job_body("a serves on", steps=2))
        assert wait_status(http, nxt["job_id"], TERMINAL, timeout=60)["status"] == "completed"
        assert "answered no heartbeat" not in a.log()[logged:]


def test_a_full_memory_store_is_a_429(tmp_path):
    sd = one_thread_config(tmp_path / "tiny-sd.yaml")
    server = start_server(sd, "--step-execution", "--max-jobs", "1", log=tmp_path / "m.log")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            held = submit(c, job_body("holds the one place", steps=200))
            r = c.post("/v1/generate", json=job_body("no place", steps=2))
            assert r.status_code == 429 and r.headers.get("retry-after"), r.text[:300]
            r = c.post("/v1/generate", json=job_body("no place, synchronous", steps=2, async_run=False))
            assert r.status_code == 429, r.text[:300]
            assert c.delete(f"/v1/jobs/{held['job_id']}").json()["status"] == "cancelled"
    finally:
        stop_server(server)
