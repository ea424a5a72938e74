"""The ``lora`` extension field over HTTP, on a real server with operator-registered adapters and the
official client: images and chat with an adapter, paths refused, unknown names and hostile values as
400s naming the field, the server serving on, and the LoRA control calls on the control route."""

from __future__ import annotations

import base64
import io
import json
import math

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from omni_runtime.models.tiny_lora import build_tiny_sd_lora
from tests.strategies import ANY_FLOAT, ANY_TEXT, JSON_VALUES

from .server_process import start_server, stop_server, write_config


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {"ink": str(build_tiny_sd_lora(root / "ink", seed=1))}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, str]):
    tmp = tmp_path_factory.mktemp("srv")
    config = {
        "model": "tiny-sd-lora",
        "stage_args": [
            {
                "stage_id": 0,
                "stage_type": "diffusion",
                "model": "builtin:tiny-sd",
                "runtime": {"backend": "process", "torch_threads": 1},
                "engine_args": {"max_num_seqs": 4, "loras": adapters, "max_loras": 2},
                "final_output": True,
                "final_output_type": "image",
                "default_sampling_params": {"num_inference_steps": 2, "height": 32, "width": 32},
            }
        ],
    }
    srv = start_server(str(write_config(tmp / "tiny-sd-lora.yaml", config)), log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def image(client: openai.OpenAI, **extra: object) -> np.ndarray:
    return decode(client.images.generate(prompt="a red fox", extra_body={"seed": 7, **extra}).data[0].b64_json)


def test_images_with_a_registered_adapter(client: openai.OpenAI) -> None:
    plain = image(client)
    ink = image(client, lora={"name": "ink"})
    assert np.abs(ink - plain).mean() > 1.0
    assert np.array_equal(image(client, lora={"name": "ink", "scale": 0.0}), plain)
    assert np.array_equal(image(client, lora={"name": "ink", "scale": 1.0}), ink)


def test_chat_takes_the_adapter_too(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny-sd-lora",
        messages=[{"role": "user", "content": "a red fox"}],
        seed=7,
        extra_body={"lora": {"name": "ink", "scale": 0.5}},
    )
    url = chat.choices[0].message.model_extra["images"][0]["image_url"]["url"]
    assert np.array_equal(decode(url.split(",", 1)[1]), image(client, lora={"name": "ink", "scale": 0.5}))


def test_paths_and_unknown_names_are_400s_naming_the_field(client: openai.OpenAI, adapters: dict[str, str]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="x", extra_body={"lora": {"name": "ink", "path": adapters["ink"]}})
    error = info.value.body
    assert error["param"] == "lora.path" and "not accepted over HTTP" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="x", extra_body={"lora": {"name": "watercolor"}})
    assert info.value.body["param"] == "lora.name" and "ink" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-sd-lora", messages=[{"role": "user", "content": "x"}], extra_body={"lora": {"path": "/etc"}}
        )
    assert info.value.body["param"].startswith("lora")


HOSTILE_LORA = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.one_of(ANY_TEXT, JSON_VALUES),
            "path": st.one_of(ANY_TEXT, JSON_VALUES),
            "scale": st.one_of(ANY_FLOAT, JSON_VALUES),
            "weight": JSON_VALUES,
        },
    ),
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(lora=HOSTILE_LORA, route=st.sampled_from(["images", "chat"]))
@example(lora=math.inf, route="images")
@example(lora={"name": "ink", "scale": math.nan}, route="chat")
@example(lora={"name": "ink\udfff"}, route="images")
def test_hostile_lora_values_are_400s_and_the_server_serves_on(http: httpx.Client, lora: object, route: str) -> None:
    if route == "images":
        path, body = "/v1/images/generations", {"prompt": "x", "lora": lora, "seed": 1}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "lora": lora, "seed": 1}
    # NaN and infinities as Python's json writes them (httpx refuses to), surrogates escaped.
    content = json.dumps(body, allow_nan=True)
    resp = http.post(path, content=content, headers={"Content-Type": "application/json"})
    registered = isinstance(lora, dict) and lora.get("name") == "ink" and lora.get("path") is None
    if lora is None or (registered and "weight" not in lora):
        assert resp.status_code in (200, 400)  # a well-formed request for the registered adapter
        return
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith("lora"), resp.text


def test_the_server_serves_after_the_hostile_values(client: openai.OpenAI) -> None:
    assert image(client).shape == (32, 32, 3)


def test_lora_control_calls_on_the_control_route(http: httpx.Client, adapters: dict[str, str]) -> None:
    [listed] = http.post("/v1/omni/collective_rpc", json={"method": "list_loras"}).json()
    assert listed["ok"] and listed["result"]["registered"] == adapters
    add = {"method": "add_lora", "kwargs": {"name": "ink2", "path": adapters["ink"]}}
    [added] = http.post("/v1/omni/collective_rpc", json=add).json()
    assert added["ok"] and added["result"]["name"] == "ink2"
    body = {"prompt": "a red fox", "seed": 7, "lora": {"name": "ink2"}}
    resp = http.post("/v1/images/generations", json=body)
    assert resp.status_code == 200
    remove = {"method": "remove_lora", "kwargs": {"name": "ink2"}}
    [removed] = http.post("/v1/omni/collective_rpc", json=remove).json()
    assert removed["ok"] and removed["result"]["removed"]
    bad_add = {"method": "add_lora", "kwargs": {"name": "x", "path": "a/b"}}
    [bad] = http.post("/v1/omni/collective_rpc", json=bad_add).json()
    assert not bad["ok"] and "absolute" in bad["error"]
