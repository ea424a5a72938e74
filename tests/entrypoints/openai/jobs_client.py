"""Client helpers of the job tests: submit, read SSE events, wait for a job's end."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

GENERATE = {"task": "text2image", "inputs": {"prompt": "a lighthouse at dusk"}}


def job_body(prompt: str = "a lighthouse at dusk", steps: int | None = None, **top: Any) -> dict[str, Any]:
    inputs: dict[str, Any] = {"prompt": prompt}
    if steps is not None:
        inputs["num_inference_steps"] = steps
    return {"task": "text2image", "inputs": inputs, **top}


def submit(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/v1/generate", json=body)
    assert r.status_code == 202, r.text[:500]
    job = r.json()
    assert job["status"] == "queued" and job["job_id"].startswith("job-")
    return job


def read_sse(
    http: httpx.Client, job_id: str, *, last_event_id: str | None = None, limit: int | None = None, timeout: float = 120
) -> list[dict[str, Any]]:
    """Events of ``GET /v1/jobs/{id}/events`` as ``{"id", "type", "data"}``: until the stream
    ends, or ``limit`` events (then the connection is closed)."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()[:500]
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith(":"):
                continue
            if not line:
                if current:
                    events.append(current)
                    current = {}
                    if limit is not None and len(events) >= limit:
                        break
                continue
            field, _, value = line.partition(": ")
            if field == "id":
                current["id"] = value
            elif field == "event":
                current["type"] = value
            elif field == "data":
                current["data"] = json.loads(value)
    return events


def wait_status(http: httpx.Client, job_id: str, statuses: set[str], timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} is {job['status']} after {timeout} s, not in {statuses}")
        time.sleep(0.05)


def first_step(http: httpx.Client, job_id: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Read the job's events until its first ``step`` (it is denoising now). An ``error`` frame
    (the store did not answer) is skipped: the next read resumes after the last real event."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while not any(e["type"] == "step" for e in events):
        assert time.monotonic() < deadline, f"no step event within {timeout} s: {events}"
        last = events[-1]["id"] if events else None
        events += [e for e in read_sse(http, job_id, last_event_id=last, limit=1, timeout=timeout) if "id" in e]
        if not events:
            continue
        assert events[-1]["type"] not in ("completed", "failed", "cancelled"), events
    return events
