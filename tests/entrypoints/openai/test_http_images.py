"""The server on the bundled tiny-sd config and an API key: images, image-only chat, models, auth,
validation errors, metrics and the control route, through the official client. The config sends
progress at every step (``progress_interval_s: 0``), so a stream's first progress comment is step 1
without waiting for the throttle; test_http_image_inputs.py serves with no model argument."""

from __future__ import annotations

import base64
import io
import re
import warnings

import httpx
import numpy as np
import openai
import pytest
import yaml
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from .server_process import REPO, RUNTIME_LINE, start_server, stop_server, write_config

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("srv")
    config = yaml.safe_load((REPO / "stage_configs" / "tiny-sd.yaml").read_text())
    config["stage_args"][0]["engine_args"]["progress_interval_s"] = 0
    config["stage_args"][0]["runtime"]["torch_threads"] = 1  # see one_thread_config
    path = write_config(tmp / "tiny-sd.yaml", config)
    srv = start_server(str(path), "--api-key", KEY, "--max-num-seqs", "4", log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float32)


def test_models_list_names_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-sd"]
    assert client.models.retrieve("tiny-sd").id == "tiny-sd"


def test_images_b64_one_request_per_image_with_consecutive_seeds(client):
    first = client.images.generate(prompt="a red fox", n=2, extra_body={"seed": 5})
    second = client.images.generate(prompt="a red fox", n=1, extra_body={"seed": 6})
    assert len(first.data) == 2 and len(second.data) == 1
    a, b = decode(first.data[0].b64_json), decode(first.data[1].b64_json)
    assert a.shape == (64, 64, 3)
    assert np.abs(a - b).mean() > 1.0  # two seeds, two different images
    # Image 1 of seed 5 is seed 6: the same picture whatever it was batched with.
    assert np.abs(b - decode(second.data[0].b64_json)).max() <= 2.0
    assert [d.model_extra.get("seed") for d in first.data] == [5, 6]


def test_images_url_are_served_by_the_server(client, http, server):
    resp = client.images.generate(
        prompt="a boat", response_format="url", size="32x32", extra_body={"output_format": "jpeg"}
    )
    url = resp.data[0].url
    assert url.startswith(f"{server.url}/v1/files/")
    got = http.get(url)
    assert got.status_code == 200 and got.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(got.content)).size == (32, 32)
    assert httpx.get(url).status_code == 401  # files are behind the key too
    missing = http.get("/v1/files/file-doesnotexist")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "file_id"


def test_chat_on_an_image_only_pipeline_answers_with_an_image_part(client):
    resp = client.chat.completions.create(model="tiny-sd", messages=[{"role": "user", "content": "a lighthouse"}])
    message = resp.choices[0].message
    assert message.content is None  # a string or None, as OpenAI clients type it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resp.model_dump_json()  # a list in `content` made pydantic warn here
    assert not caught, [str(w.message) for w in caught]
    [image] = message.model_extra["images"]
    url = image["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert decode(url.split(",", 1)[1]).shape == (64, 64, 3)


def test_chat_stream_on_an_image_only_pipeline(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny-sd", messages=[{"role": "user", "content": "a kite"}], stream=True, seed=3
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    images = [c for c in chunks if c.choices and (c.choices[0].delta.model_extra or {}).get("images")]
    assert len(images) == 1 and images[0].choices[0].delta.model_extra["images"][0]["type"] == "image_url"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stream_sends_progress_comments_while_the_image_is_drawn(http):
    body = {
        "messages": [{"role": "user", "content": "a slow kite"}],
        "stream": True,
        "priority": 3,  # an extension field, like seed
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    comments = [line for line in lines if line.startswith(": progress")]
    assert comments and comments[0].startswith(": progress stage=0 step=1/")
    first_image = next(i for i, line in enumerate(lines) if '"images"' in line)
    assert lines.index(comments[0]) < first_image and lines[-1] == "data: [DONE]"


def test_images_take_priority_and_slo_ms_extension_fields(client):
    # slo_ms is a target for learned batching; this stage batches by the window, so it is only carried.
    extra = {"priority": -5, "seed": 1, "slo_ms": 60_000}
    resp = client.images.generate(prompt="x", size="64x64", extra_body=extra)
    assert len(resp.data) == 1 and resp.data[0].b64_json


def test_every_v1_route_needs_the_key(server):
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/images/generations", {"prompt": "x"}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/v1/omni/collective_rpc", {"method": "ping"}),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open
    # /readyz stays open for orchestrators, but says only whether the server is ready without the key.
    assert httpx.get(f"{server.url}/readyz").json() == {"ready": True, "draining": False}
    full = httpx.get(f"{server.url}/readyz", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert full["ready"] is True and full["stages"] and full["model"] == "tiny-sd"
    # The schema and the docs pages are not served with a key, with or without it.
    for path in ("/docs", "/redoc", "/openapi.json"):
        for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
            assert httpx.get(f"{server.url}{path}", headers=headers).status_code == 404, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.images.generate(prompt="x", model="dall-e-3")
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "size": "100000x100000"}, "size"),
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "size": "60x60"}, "size"),  # not a multiple of the VAE factor (engine check)
        ({"prompt": "x", "size": "1024x1024"}, "size"),  # 256 x the area of this 64 px model
        ({"prompt": "x", "n": 1000}, "n"),
        ({"prompt": "x" * 1_000_000}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "x", "num_inference_steps": 1000}, "num_inference_steps"),  # past tiny-sd's DDIM: was a 500
        ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
        ({"prompt": "x", "response_format": "gif"}, "response_format"),
        ({"prompt": "x", "style_preset": "anime"}, "style_preset"),
        ({"prompt": "x", "priority": 10**7}, "priority"),
        ({"prompt": "x", "priority": "urgent"}, "priority"),
        ({"prompt": "x", "slo_ms": 0}, "slo_ms"),
        ({"prompt": "x", "slo_ms": 3_600_001}, "slo_ms"),
        ({}, "prompt"),
    ],
)
def test_bad_image_requests_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/images/generations", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_bad_chat_and_bodies_are_400(http, client):
    huge = {"messages": [{"role": "user", "content": "y" * 1_000_000}]}
    assert http.post("/v1/chat/completions", json=huge).json()["error"]["param"] == "messages[0].content"
    no_user = {"messages": [{"role": "system", "content": "be nice"}]}
    assert http.post("/v1/chat/completions", json=no_user).json()["error"]["param"] == "messages"
    tools = {"messages": [{"role": "user", "content": "x"}], "tools": []}
    assert http.post("/v1/chat/completions", json=tools).json()["error"]["param"] == "tools"
    bad = http.post("/v1/images/generations", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-sd", messages=[{"role": "user", "content": "x"}], modalities=["audio"]
        )
    assert err.value.body["param"].startswith("modalities")


def test_collective_rpc_returns_one_result_per_replica(http, client):
    def served() -> int:
        r = http.post("/v1/omni/collective_rpc", json={"method": "get_stats", "stage_ids": [0], "timeout": 10})
        assert r.status_code == 200
        (result,) = r.json()
        assert result["ok"] and result["stage_id"] == 0 and result["replica_id"] == 0
        return result["result"]["requests_served"]

    before = served()
    client.images.generate(prompt="a tree", n=2)
    assert served() == before + 2  # n=2 is two engine requests
    unknown = http.post("/v1/omni/collective_rpc", json={"method": "no_such_method"}).json()
    assert not unknown[0]["ok"] and "no_such_method" in unknown[0]["error"]
    bad = http.post("/v1/omni/collective_rpc", json={"method": "ping", "stage_ids": [7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stage_ids"
    # The deploy YAML's bounds hold for a control call too: 400 naming the kwarg and its bound.
    huge = {"method": "set_batching", "kwargs": {"request_batch_max_wait_ms": 1e300}}
    error = http.post("/v1/omni/collective_rpc", json=huge).json()["error"]
    assert error["param"] == "kwargs.request_batch_max_wait_ms" and "<= 60000" in error["message"]


def test_readyz_reports_stages_and_queues(http):
    body = http.get("/readyz").json()
    assert body["ready"] and body["model"] == "tiny-sd" and body["pending"] == 0 and body["dead"] is None
    stage = body["stages"][0]
    assert stage["live_replicas"] == 1 and stage["queue_depth"] == 0
    assert stage["replica_states"] == ["live"] and stage["unresponsive_kills"] == 0


def test_metrics_count_requests_and_engine_histograms(http, server):
    def samples() -> dict[str, list]:
        text = http.get("/metrics").text
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    def value(family: list, name: str, **labels: str) -> float:
        return sum(s.value for s in family if s.name == name and labels.items() <= s.labels.items())

    before = samples()
    assert value(before["omni_engine_dead"], "omni_engine_dead") == 0
    assert value(before["omni_stage_unresponsive_kills"], "omni_stage_unresponsive_kills_total", stage="0") == 0
    assert http.post("/v1/images/generations", json={"prompt": "a hill", "n": 3}).status_code == 200
    assert http.post("/v1/images/generations", json={"prompt": "x", "n": 0}).status_code == 400
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    after = samples()

    def grew(family: str, name: str, by: float, **labels: str) -> None:
        delta = value(after[family], name, **labels) - value(before.get(family, []), name, **labels)
        assert delta == by, (name, labels, delta)

    requests = "omni_http_requests_total"
    grew("omni_http_requests", requests, 1, route="/v1/images/generations", method="POST", status="200")
    grew("omni_http_requests", requests, 1, route="/v1/images/generations", status="400")
    grew("omni_http_requests", requests, 1, route="/v1/models", status="401")
    grew("omni_http_request_duration_seconds", "omni_http_request_duration_seconds_count", 1, route="/v1/models")
    grew("omni_request_e2e_seconds", "omni_request_e2e_seconds_count", 3)
    grew("omni_request_queue_wait_seconds", "omni_request_queue_wait_seconds_count", 3, stage="0")
    grew("omni_stage_batch_size", "omni_stage_batch_size_count", 3, stage="0")
    grew("omni_images_generated", "omni_images_generated_total", 3)
    # Three compatible requests arriving together share waves (max_num_seqs 4).
    assert (
        value(after["omni_stage_batch_size"], "omni_stage_batch_size_sum", stage="0")
        > value(before["omni_stage_batch_size"], "omni_stage_batch_size_sum", stage="0") + 3
    )
    assert value(after["omni_stage_queue_depth"], "omni_stage_queue_depth", stage="0") == 0
    assert value(after["omni_stage_live_replicas"], "omni_stage_live_replicas", stage="0") == 1
    assert value(after["omni_stage_restarts"], "omni_stage_restarts_total", stage="0") == 0
    assert value(after["omni_engine_max_pending"], "omni_engine_max_pending") == 1024


#: What uvicorn prints as it starts (``INFO:     Started server process [12]``).
UVICORN_LINE = re.compile(r"^(INFO|WARNING|ERROR): +\S")


def test_serve_prints_only_its_own_and_uvicorns_lines_until_ready(server):
    """A quiet start (issue: torchao, triton and torch's deprecations printed by every stage): at
    the default level, until the model is ready, nothing but the runtime's lines and uvicorn's."""
    log = server.log()
    assert "tiny-sd is ready" in log, log[-3000:]
    start = log[: log.index("tiny-sd is ready")].splitlines()
    others = [line for line in start if line.strip() and not (RUNTIME_LINE.match(line) or UVICORN_LINE.match(line))]
    assert not others, "\n".join(others)


def test_a_long_prompt_is_not_logged_whole(client, server):
    # The text encoder keeps 77 tokens and its pipeline logs the cut part of the prompt: at the
    # default level that library warning is held back (omni_runtime/logs.py configure_logging), and
    # at any level every line is bounded (the same module; tests/omni_runtime/test_logs.py).
    words = " ".join(f"w{i:05d}" for i in range(3000))
    client.images.generate(prompt=words, size="64x64", extra_body={"num_inference_steps": 1})
    log = server.log()
    assert "w01500" not in log
    assert max(len(line) for line in log.splitlines()) < 2500
