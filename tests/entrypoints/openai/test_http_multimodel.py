"""One real server with four models (tiny-sd first, tiny-tts, an echo model from a models file
with an admission limit of its own, and tiny-wan loaded lazily on its first request) behind an
API key, its jobs in a real Redis, and the real openai client: routing by ``model``, /v1/models
with states and kinds, per-model /health, /readyz and /metrics, jobs routed by their model, and
one model's overload (429) leaving the others answering.

The combination matrix: every route and job task against the model that serves it (the right
kind of output; the video tasks on the lazy model, through the Redis job store), an unknown
model (404), no model (400), a model that cannot do it (400 naming ``model``), and no key (401);
every POST route refusing hostile JSON alike (400). The memory job store's side of the matrix is
test_http_lazymodels.py's server."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .server_process import ServerProcess, flaky_echo_config, start_server, stop_server, wait_for

pytestmark = pytest.mark.e2e

#: The echo model's own admission limit (the models file's ``max_pending``).
LIMIT = 3
KEY = "multimodel-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Loaded at start; tiny-wan (:data:`LAZY`) on its first request.
EAGER = {"tiny-sd", "tiny-tts", "echo"}
LAZY = "tiny-wan"
MODELS = EAGER | {LAZY}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_server) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("multimodel")
    flaky_echo_config(tmp / "flaky.yaml", delay_ms=20)
    (tmp / "models.yaml").write_text(f"echo: {{config: flaky.yaml, max_pending: {LIMIT}}}\n")
    redis_url = redis_server.url.rsplit("/", 1)[0] + "/3"  # a database of its own
    args = ("tiny-sd", "tiny-tts", f"{LAZY}@lazy", "--models-file", str(tmp / "models.yaml"), "--api-key", KEY,
            "--redis-url", redis_url)  # fmt: skip
    srv = start_server(*args, log=tmp / "server.log")
    try:
        # /health answers 200 once one model serves; all the eager ones are wanted here.
        def loaded() -> bool:
            models = httpx.get(f"{srv.url}/v1/models", headers=AUTH).json()["data"]
            return {m["id"]: m["state"] for m in models} == {**dict.fromkeys(EAGER, "loaded"), LAZY: "unloaded"}

        assert wait_for(loaded, timeout=120), srv.log()[-3000:]
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as c:
        yield c


def chat(prompt: str, model: str | None = "echo") -> dict:
    body: dict = {"messages": [{"role": "user", "content": prompt}]}
    return body if model is None else {**body, "model": model}


def test_models_lists_both_with_state_and_kinds(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == MODELS
    kinds = [models[name].kinds for name in ("tiny-sd", "tiny-tts", "echo")]  # type: ignore[attr-defined]
    assert kinds == [["image"], ["audio"], ["text"]]
    assert models["tiny-tts"].tasks == ["text2speech"]  # type: ignore[attr-defined]
    assert models["tiny-sd"].serves == ["text2image", "image_edit", "image_variation", "chat"]  # type: ignore[attr-defined]
    assert {models[name].state for name in EAGER} == {"loaded"}  # type: ignore[attr-defined]
    assert client.models.retrieve("echo").id == "echo"


def test_interleaved_requests_reach_their_model(server: ServerProcess) -> None:
    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as c:

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
    assert "`nope`" in str(err.value) and all(f"`{name}`" in str(err.value) for name in MODELS)
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
    assert health["status"] == "ok" and set(health["models"]) == MODELS, health
    assert all(health["models"][name] == {"status": "ok"} for name in EAGER), health
    ready = http.get("/readyz").json()
    states = {n: m["state"] for n, m in ready["models"].items()}
    assert ready["ready"] and {n: states[n] for n in EAGER} == dict.fromkeys(EAGER, "loaded"), ready
    assert states[LAZY] in ("unloaded", "loading", "loaded"), ready
    assert ready["models"]["echo"]["max_pending"] == LIMIT
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    limits = {s.labels["model"]: s.value for s in families["omni_engine_max_pending"].samples}
    assert limits["echo"] == LIMIT and limits["tiny-sd"] > 1
    e2e = {s.labels["model"] for s in families["omni_request_e2e_seconds"].samples}
    assert {"tiny-sd", "echo"} <= e2e <= MODELS


def test_one_models_overload_is_429_while_the_other_answers(server: ServerProcess, http: httpx.Client) -> None:
    def echo_pending() -> int:
        return http.get("/readyz").json()["models"]["echo"]["pending"]

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=AUTH) as a:
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
    if isinstance(model, str) and model in MODELS:  # served: answered by that model
        assert response.status_code in (200, 400), response.text
        return
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == "model"
    if response.status_code == 404:
        assert all(f"`{name}`" in error["message"] for name in MODELS)


# --------------------------------------------------------------------------- the combination matrix


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 80, 40)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


def send(http: httpx.Client, task: str, model: str | None, headers: dict[str, str] | None = None) -> httpx.Response:
    """One request for ``task`` (a route, or ``job:<task>`` for ``/v1/generate``) naming ``model``."""
    named = {} if model is None else {"model": model}
    if task == "text2image":
        return http.post("/v1/images/generations", json={"prompt": "x", "size": "32x32", **named}, headers=headers)
    if task in ("image_edit", "image_variation"):
        path, fields = ("edits", {"prompt": "x"}) if task == "image_edit" else ("variations", {})
        files = {"image": ("a.png", PNG, "image/png")}
        return http.post(f"/v1/images/{path}", data={**fields, **named}, files=files, headers=headers)
    if task == "text2speech":
        speech = {"input": "hello", "voice": "alloy", "response_format": "wav", **named}
        return http.post("/v1/audio/speech", json=speech, headers=headers)
    if task == "chat":
        return http.post("/v1/chat/completions", json={**chat("hi", None), **named}, headers=headers)
    if task == "text2video":
        return http.post("/v1/videos", json={"prompt": "x", **named}, headers=headers)
    job = task.removeprefix("job:")
    inputs = {"prompt": "x", **({"size": "32x32"} if job == "text2image" else {})}
    if job == "image2video":
        inputs["image"] = "data:image/png;base64," + base64.b64encode(PNG).decode()
    return http.post("/v1/generate", json={"task": job, "inputs": inputs, "async_run": False, **named}, headers=headers)


def _image(r: httpx.Response) -> None:
    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    assert Image.open(io.BytesIO(png)).format == "PNG"


def _job(kind: str):
    def check(r: httpx.Response) -> None:
        job = r.json()
        assert job["status"] == "completed" and job["result"][kind], job

    return check


def _speech(r: httpx.Response) -> None:
    assert r.headers["content-type"].startswith("audio/") and r.content[:4] == b"RIFF"


def _chat(r: httpx.Response) -> None:
    assert r.json()["choices"][0]["message"]["content"] == "hi"


def _video(r: httpx.Response) -> None:
    """A video object whose job (in Redis, on the lazy model) completes with an MP4."""
    video_id = r.json()["id"]
    with httpx.Client(base_url=str(r.request.url).removesuffix("/v1/videos"), headers=AUTH, timeout=60) as c:
        assert wait_for(lambda: c.get(f"/v1/videos/{video_id}").json()["status"] == "completed", timeout=180)
        content = c.get(f"/v1/videos/{video_id}/content")
    assert content.status_code == 200 and content.content[4:8] == b"ftyp", content.text[:300]


#: task -> (the model serving it, the check of its output)
SERVED = {
    "text2image": ("tiny-sd", _image),
    "image_edit": ("tiny-sd", _image),
    "image_variation": ("tiny-sd", _image),
    "text2speech": ("tiny-tts", _speech),
    "chat": ("echo", _chat),
    "job:text2image": ("tiny-sd", _job("images")),
    "job:text2speech": ("tiny-tts", _job("audios")),
    "text2video": (LAZY, _video),
    "job:text2video": (LAZY, _job("videos")),
    "job:image2video": (LAZY, _job("videos")),
}
#: (task, a model that cannot do it): the first model (tiny-sd) for speech is the issue's case.
REFUSED = [
    ("text2image", "tiny-tts"),
    ("image_edit", "echo"),
    ("image_variation", "tiny-tts"),
    ("text2speech", "tiny-sd"),
    ("text2speech", "echo"),
    ("text2video", "tiny-sd"),
    ("job:text2image", "echo"),
    ("job:text2speech", "tiny-sd"),
    ("job:text2video", "tiny-tts"),
    ("job:image2video", "tiny-sd"),
    ("job:text2audio", "tiny-tts"),
]
TASKS = list(SERVED)


@pytest.mark.parametrize("task", list(SERVED))
def test_the_model_named_serves_its_task(http: httpx.Client, task: str) -> None:
    model, check = SERVED[task]
    r = send(http, task, model)
    assert r.status_code == 200, r.text
    check(r)


@pytest.mark.parametrize(("task", "model"), REFUSED)
def test_a_model_that_cannot_do_the_task_is_400_naming_model(http: httpx.Client, task: str, model: str) -> None:
    r = send(http, task, model)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and f"`{model}`" in error["message"], error


@pytest.mark.parametrize("task", TASKS)
def test_an_unknown_or_missing_model_and_no_key(http: httpx.Client, task: str) -> None:
    unknown = send(http, task, "nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found", unknown.text
    missing = send(http, task, None)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model", missing.text
    no_key = send(http, task, SERVED.get(task, ("tiny-sd",))[0], headers={"Authorization": "Bearer wrong"})
    assert no_key.status_code == 401, no_key.text


def test_the_openai_clients_speech_reaches_the_speech_model(client: openai.OpenAI) -> None:
    """The issue's report: tiny-sd is served first, and speech went to it (400) every time."""
    audio = client.audio.speech.create(model="tiny-tts", voice="alloy", input="hello there", response_format="wav")
    assert audio.content[:4] == b"RIFF"


def test_a_realtime_session_runs_on_the_model_named_and_refuses_alike(server: ServerProcess) -> None:
    """``WS /v1/realtime`` in the matrix: the speech model answers a text turn (its transcript is the
    prompt, then its audio); an image model, an unknown one, none named and no key are refused with
    the route's codes (close code 4000 + the HTTP status)."""
    base = server.url.replace("http://", "ws://") + "/v1/realtime"
    with connect(f"{base}?model=tiny-tts", additional_headers=AUTH, open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=30))["session"]["modalities"] == ["audio"]
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]}
        ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        ws.send(json.dumps({"type": "response.create"}))
        events = [json.loads(ws.recv(timeout=30))]
        while events[-1]["type"] != "response.done":
            events.append(json.loads(ws.recv(timeout=30)))
    kinds = [e["type"] for e in events]
    assert kinds.index("response.audio_transcript.delta") < kinds.index("response.audio.delta")
    assert events[kinds.index("response.audio_transcript.delta")]["delta"] == "hello there"
    assert events[-1]["response"]["status"] == "completed"
    for query, headers, code, param, close in (
        ("?model=tiny-sd", AUTH, "no_speech", "model", 4400),
        ("?model=nope", AUTH, "model_not_found", "model", 4404),
        ("", AUTH, None, "model", 4400),
        ("?model=tiny-tts", {"Authorization": "Bearer wrong"}, "invalid_api_key", None, 4401),
    ):
        with connect(base + query, additional_headers=headers, open_timeout=10) as ws:
            error = json.loads(ws.recv(timeout=10))["error"]
            assert (code is None or error["code"] == code) and error["param"] == param, (query, error)
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
            assert ws.close_code == close, query


#: Every POST route with a JSON body.
JSON_ROUTES = [
    "/v1/images/generations",
    "/v1/chat/completions",
    "/v1/audio/speech",
    "/v1/videos",
    "/v1/generate",
    "/v1/omni/collective_rpc",
]
HOSTILE = {
    "deep": b"[" * 5000 + b"]" * 5000,
    "deep_in_a_field": b'{"model": "tiny-sd", "prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "huge_int": b'{"model": "tiny-sd", "prompt": "x", "seed": ' + b"9" * 5000 + b"}",
    "huge_float": b'{"model": "tiny-sd", "prompt": "x", "seed": 1.' + b"5" * 5000 + b"}",
}


@pytest.mark.parametrize("route", JSON_ROUTES)
def test_every_post_route_refuses_hostile_json_alike(http: httpx.Client, route: str) -> None:
    for name, raw in HOSTILE.items():
        r = http.post(route, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", (name, r.text)
    assert http.get("/health").status_code == 200
    assert _chat(send(http, "chat", "echo")) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("size", "32X32"), ("size", " 32x32"), ("size", "\uff13\uff12x32"), ("seconds", "\u0661"),
     ("seconds", "1_0"), ("num_frames", True), ("fps", True), ("slo_ms", True)],
)  # fmt: skip
def test_video_fields_are_strict(http: httpx.Client, field: str, value: object) -> None:
    r = http.post("/v1/videos", json={"model": "tiny-sd", "prompt": "x", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
