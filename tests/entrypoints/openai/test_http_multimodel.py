"""One real server with two models (tiny-sd and an echo model from a models file, with an
admission limit of its own) and the real openai client: routing by ``model``, /v1/models with
states and kinds, per-model /health, /readyz and /metrics, jobs routed by their model, and one
model's overload (429) leaving the other answering."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from .server_process import ServerProcess, flaky_echo_config, start_server, stop_server, wait_for

pytestmark = pytest.mark.e2e

#: The echo model's own admission limit (the models file's ``max_pending``).
LIMIT = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("multimodel")
    flaky_echo_config(tmp / "flaky.yaml", delay_ms=20)
    (tmp / "models.yaml").write_text(f"echo: {{config: flaky.yaml, max_pending: {LIMIT}}}\n")
    srv = start_server("tiny-sd", "--models-file", str(tmp / "models.yaml"), log=tmp / "server.log")
    try:
        # /health answers 200 once one model serves; both are wanted here.
        loaded = lambda: {m["state"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]} == {"loaded"}  # noqa: E731
        assert wait_for(loaded, timeout=120), srv.log()[-3000:]
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def chat(prompt: str, model: str | None = "echo") -> dict:
    body: dict = {"messages": [{"role": "user", "content": prompt}]}
    return body if model is None else {**body, "model": model}


def test_models_lists_both_with_state_and_kinds(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny-sd", "echo"}
    assert [models["tiny-sd"].kinds, models["echo"].kinds] == [["image"], ["text"]]  # type: ignore[attr-defined]
    assert {m.state for m in models.values()} == {"loaded"}  # type: ignore[attr-defined]
    assert client.models.retrieve("echo").id == "echo"


def test_interleaved_requests_reach_their_model(server: ServerProcess) -> None:
    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:

            async def image(i: int) -> object:
                return await c.images.generate(
                    model="tiny-sd", prompt=f"a fox {i}", size="32x32", extra_body={"seed": i}
                )

            async def text(i: int) -> object:
                return await c.chat.completions.create(model="echo", messages=[{"role": "user", "content": f"hi {i}"}])

            return await asyncio.gather(*(image(i) if i % 2 else text(i) for i in range(6)))

    results = asyncio.run(run())
    for i, result in enumerate(results):
        if i % 2:
            png = base64.b64decode(result.data[0].b64_json)
            assert Image.open(io.BytesIO(png)).size == (32, 32)
        else:
            assert result.model == "echo" and result.choices[0].message.content == f"hi {i}"


def test_unknown_model_is_404_naming_both_and_a_missing_one_400(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "`nope`" in str(err.value) and "`tiny-sd`" in str(err.value) and "`echo`" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    missing = http.post("/v1/chat/completions", json=chat("x", model=None))
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    # The echo model makes no images: the image route says so for that model.
    no_image = http.post("/v1/images/generations", json={"model": "echo", "prompt": "x"})
    assert no_image.status_code == 400 and "`echo`" in no_image.json()["error"]["message"]


def test_jobs_route_by_model(http: httpx.Client) -> None:
    body = {"model": "tiny-sd", "task": "text2image", "inputs": {"prompt": "a job", "size": "32x32"}}
    job = http.post("/v1/generate", json={**body, "async_run": False}).json()
    assert job["status"] == "completed" and job["model"] == "tiny-sd", job
    wrong = http.post("/v1/generate", json={**body, "model": "echo"})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "no_image"


def test_health_readyz_and_metrics_per_model(http: httpx.Client) -> None:
    health = http.get("/health").json()
    assert health == {"status": "ok", "models": {"tiny-sd": {"status": "ok"}, "echo": {"status": "ok"}}}
    ready = http.get("/readyz").json()
    assert ready["ready"] and {n: m["state"] for n, m in ready["models"].items()} == {
        "tiny-sd": "loaded",
        "echo": "loaded",
    }
    assert ready["models"]["echo"]["max_pending"] == LIMIT
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    limits = {s.labels["model"]: s.value for s in families["omni_engine_max_pending"].samples}
    assert limits["echo"] == LIMIT and limits["tiny-sd"] > 1
    e2e = {s.labels["model"] for s in families["omni_request_e2e_seconds"].samples}
    assert e2e == {"tiny-sd", "echo"}


def test_one_models_overload_is_429_while_the_other_answers(server: ServerProcess, http: httpx.Client) -> None:
    def echo_pending() -> int:
        return http.get("/readyz").json()["models"]["echo"]["pending"]

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as a:
            # Hold echo's admission slots until their clients go away.
            holds = [a.post("/v1/chat/completions", json=chat(f"hang until aborted {i}")) for i in range(LIMIT)]
            hold = asyncio.gather(*holds)
            try:
                while await asyncio.to_thread(echo_pending) != LIMIT:
                    await asyncio.sleep(0.02)
                full = await a.post("/v1/chat/completions", json=chat("one more"))
                assert full.status_code == 429 and full.headers["Retry-After"], full.text
                image = await a.post(
                    "/v1/images/generations", json={"model": "tiny-sd", "prompt": "x", "size": "32x32"}
                )
                assert image.status_code == 200, image.text
            finally:
                hold.cancel()
                await asyncio.gather(hold, return_exceptions=True)

    asyncio.run(run())
    assert wait_for(lambda: echo_pending() == 0, timeout=10)
    assert http.post("/v1/chat/completions", json=chat("free again")).json()["choices"][0]["message"]["content"]


@settings(max_examples=25, deadline=None, database=None, derandomize=True)
@given(model=st.one_of(st.text(max_size=300), st.integers(), st.none(), st.lists(st.text(max_size=5), max_size=2)))
def test_any_model_value_is_routed_or_refused_by_name(http: httpx.Client, model: object) -> None:
    """Any ``model``: a served name is answered, anything else a 4xx that names the field."""
    response = http.post("/v1/chat/completions", json={**chat("x", model=None), "model": model})
    if model in ("echo", "tiny-sd"):  # served: answered by that model
        assert response.status_code in (200, 400), response.text
        return
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == "model"
    if response.status_code == 404:
        assert "`tiny-sd`" in error["message"] and "`echo`" in error["message"]
