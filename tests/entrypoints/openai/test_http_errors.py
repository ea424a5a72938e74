"""Engine errors through HTTP on a slow echo stage: 429 with Retry-After, 504, 500, and client
disconnects aborting their requests. A dead engine (503, then a non-zero exit) is in
test_http_hardening.py."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .server_process import flaky_echo_config, start_server, stop_server, wait_for

DELAY_S = 0.6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("errors")
    config = flaky_echo_config(tmp / "flaky.yaml", delay_ms=DELAY_S * 1000)
    srv = start_server(str(config), "--max-pending", "2", log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def chat(prompt: str, **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], **extra}


def pending(http: httpx.Client) -> int:
    return http.get("/readyz").json()["pending"]


def stage_stats(http: httpx.Client) -> dict:
    (result,) = http.post("/v1/omni/collective_rpc", json={"method": "get_stats", "timeout": 5}).json()
    return result["result"]


def counter(http: httpx.Client, name: str, **labels: str) -> float:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return sum(s.value for f in families for s in f.samples if s.name == name and labels.items() <= s.labels.items())


def test_full_admission_is_429_with_retry_after(server, client, http):
    results: list[int] = []

    def slow() -> None:
        results.append(httpx.post(f"{server.url}/v1/chat/completions", json=chat("slow"), timeout=30).status_code)

    threads = [threading.Thread(target=slow) for _ in range(2)]
    for t in threads:
        t.start()
    assert wait_for(lambda: pending(http) == 2)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="flaky-echo", messages=[{"role": "user", "content": "one more"}])
    assert int(err.value.response.headers["Retry-After"]) >= 1
    assert err.value.body["code"] == "queue_full"
    refused = http.post("/v1/chat/completions", json=chat("and another"))
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    for t in threads:
        t.join()
    assert results == [200, 200]
    assert pending(http) == 0


def test_request_timeout_is_504_and_frees_the_stage(http):
    start = time.monotonic()
    r = http.post("/v1/chat/completions", json=chat("hang here", timeout=0.3))
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 5
    # The hung forward was aborted in the stage, not only answered.
    assert wait_for(lambda: stage_stats(http)["running"] == 0, timeout=5)


def test_model_error_is_500_with_its_message(http):
    r = http.post("/v1/chat/completions", json=chat("poison pill"))
    assert r.status_code == 500
    error = r.json()["error"]
    assert "poisoned" in error["message"] and error["type"] == "server_error"


def test_disconnecting_client_aborts_its_request(server, http):
    aborted = counter(http, "omni_requests_aborted_total", reason="client_disconnect")
    # A request that only ends when aborted: the client gives up after 0.5 s and closes.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=chat("hang forever"), timeout=0.5)
    assert wait_for(lambda: pending(http) == 0, timeout=5)
    assert wait_for(lambda: stage_stats(http)["running"] == 0, timeout=5)
    assert counter(http, "omni_requests_aborted_total", reason="client_disconnect") == aborted + 1
    assert counter(http, "omni_http_requests_total", route="/v1/chat/completions", status="499") >= 1


def test_disconnect_during_a_stream_aborts_too(server, http):
    body = chat("hang while streaming", stream=True)
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=0.5) as r,
    ):
        r.read()
    assert wait_for(lambda: pending(http) == 0, timeout=5)
    assert wait_for(lambda: stage_stats(http)["running"] == 0, timeout=5)


def test_speech_on_a_model_without_a_speech_stage_is_a_400_naming_model(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="flaky-echo", voice="alloy", input="hello")
    assert e.value.status_code == 400 and e.value.body["param"] == "model" and "speech" in e.value.body["message"]
