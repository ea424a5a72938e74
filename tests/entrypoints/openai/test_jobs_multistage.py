"""A job through a three-stage pipeline (tiny-sd-split: text encoder -> denoiser -> VAE decoder) on
request-level batching: step events come from the denoiser's step callback, every stage (the inner
ones included) has its ``stage_done`` event and its queue and wave spans, in pipeline order."""

from __future__ import annotations

import itertools

import httpx
import pytest

from .jobs_client import job_body, read_sse, submit
from .server_process import start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jobs-split")
    srv = start_server("tiny-sd-split", log=tmp / "server.log")
    yield srv
    stop_server(srv)


def test_every_stage_reports_done_and_the_denoiser_its_steps(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        job = submit(http, job_body(steps=6))
        events = read_sse(http, job["job_id"])
        types = [e["type"] for e in events]
        assert types[0] == "queued" and types[-1] == "completed", types
        done = [e["data"]["stage_id"] for e in events if e["type"] == "stage_done"]
        assert done == [0, 1, 2]
        steps = [e for e in events if e["type"] == "step"]
        assert all(e["data"]["stage_id"] == 1 and e["data"]["steps"] == 6 for e in steps)
        if steps:  # progress is throttled: a fast forward may report none
            assert types.index("stage_done") < types.index("step") < len(types) - 2
        assert types.index("started") < types.index("stage_done")

        spans = http.get(f"/v1/jobs/{job['job_id']}/trace").json()["spans"]
        waves = [s for s in spans if s["name"].endswith(" wave")]
        assert [s["name"] for s in waves] == ["stage 0 wave", "stage 1 wave", "stage 2 wave"]
        for earlier, later in itertools.pairwise(waves):
            # Each stage's wave starts after the one before it finished (stage clocks, not arrival).
            assert earlier["end"] <= later["start"] + 1e-3
        names = [s["name"] for s in spans]
        assert {"stage 0 transfer", "stage 1 transfer", "stage 2 transfer"} <= set(names)
        assert all(s["attributes"]["batch_size"] >= 1 for s in waves)
        final = http.get(f"/v1/jobs/{job['job_id']}").json()
        assert final["status"] == "completed" and final["result"]["images"][0]["url"]
