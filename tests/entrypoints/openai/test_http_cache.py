"""The ``cache`` extension field over HTTP, on a real tiny-flux server in step execution and the
official client: a cached image differs a little from the plain one and repeats exactly, the
stage counts skipped blocks, ``/v1/generate`` takes it too, and hostile values are 400s naming
``cache`` while the server serves on."""

from __future__ import annotations

import base64
import io
import json
import math

import httpx
import msgspec
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime.acceleration import cache_type, parse_cache
from tests.strategies import ANY_FLOAT, JSON_VALUES

from .server_process import start_server, stop_server, write_config

pytestmark = pytest.mark.integration

#: Surely skips on random weights (first-block residuals change by far more than 0.05 a step).
SKIPPING = {"type": "first_block", "threshold": 1.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("srv")
    config = {
        "model": "tiny-flux-steps",
        "stage_args": [
            {
                "stage_id": 0,
                "stage_type": "diffusion",
                "model": "builtin:tiny-flux",
                "runtime": {"backend": "process", "torch_threads": 1},
                "engine_args": {"max_num_seqs": 4, "step_execution": True},
                "final_output": True,
                "final_output_type": "image",
                "default_sampling_params": {"num_inference_steps": 4, "height": 32, "width": 32},
            }
        ],
    }
    srv = start_server(str(write_config(tmp / "tiny-flux-steps.yaml", config)), log=tmp / "server.log")
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
    out = client.images.generate(prompt="a red fox", extra_body={"seed": 7, **extra}).data[0].b64_json
    assert out is not None
    return decode(out)


def skipped(http: httpx.Client) -> int:
    [replica] = http.post("/v1/omni/collective_rpc", json={"method": "get_stats"}).json()
    cache = replica["result"]["cache"]
    return int(cache["blocks_skipped"])


def test_a_request_cache_over_http(client: openai.OpenAI, http: httpx.Client) -> None:
    plain = image(client)
    before = skipped(http)
    cached = image(client, cache=SKIPPING)
    assert skipped(http) > before  # the stage ran fewer blocks for it
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    outcomes = {s.labels["outcome"]: s.value for s in families["omni_stage_cache_blocks"].samples}
    assert outcomes["skipped"] > 0 and outcomes["run"] > 0
    # 8-bit pixels: within 0.05 of the [0, 1] range, as the in-process tests bound it.
    assert 0 < np.abs(cached - plain).max() <= 13
    assert np.array_equal(image(client, cache=SKIPPING), cached)
    assert np.array_equal(image(client, cache="off"), plain)
    inputs = {"prompt": "a red fox", "seed": 7, "cache": SKIPPING}
    job = http.post("/v1/generate", json={"task": "text2image", "inputs": inputs, "async_run": False}).json()
    assert job["status"] == "completed", job
    # A type that cannot run step by step: refused by the stage, a 400 naming the field.
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="x", extra_body={"cache": {"type": "taylorseer"}})
    assert info.value.body["param"] == "cache" and "first_block" in info.value.body["message"]


HOSTILE_CACHE = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(["first_block", "taylorseer", "mag", "pab", "faster"]), JSON_VALUES)},
        optional={
            "threshold": st.one_of(ANY_FLOAT, JSON_VALUES),
            "cache_interval": JSON_VALUES,
            "max_skip_steps": JSON_VALUES,
            "mag_ratios": JSON_VALUES,
            "spatial_attention_timestep_skip_range": JSON_VALUES,
            "radius": JSON_VALUES,
        },
    ),
)


def _valid(value: object) -> bool:
    """Whether the server may serve it: off, or a well-formed cache of a type a step-execution
    stage runs (the Python param's own parser says what is well-formed)."""
    if value is None or value == "off":
        return True
    try:
        parsed = parse_cache(value)
    except (msgspec.ValidationError, TypeError):
        return False
    return parsed is not None and parsed != "off" and cache_type(parsed) in ("first_block", "mag")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(cache=HOSTILE_CACHE, route=st.sampled_from(["images", "generate"]))
@example(cache={"type": "first_block", "threshold": math.nan}, route="images")
@example(cache={"type": "first_block", "threshold": -math.inf}, route="generate")
@example(cache="on", route="images")
@example(cache={"type": "faster"}, route="images")
@example(cache="\ud800", route="generate")  # parse_cache raised UnicodeEncodeError in _valid
def test_hostile_cache_values_are_400s_naming_the_field(http: httpx.Client, cache: object, route: str) -> None:
    if route == "images":
        path, body = "/v1/images/generations", {"prompt": "x", "cache": cache, "seed": 1}
    else:
        path, body = "/v1/generate", {"task": "text2image", "inputs": {"prompt": "x", "cache": cache}}
    # NaN and infinities as Python's json writes them (httpx refuses to), surrogates escaped.
    resp = http.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})
    if _valid(cache):
        assert resp.status_code in (200, 202), resp.text
        return
    assert resp.status_code == 400, resp.text
    # The field, or the part of it that no message can carry (``cache.type``, ``cache[0]``).
    param = resp.json()["error"]["param"]
    assert param.removeprefix("inputs.").startswith("cache"), resp.text


@pytest.mark.parametrize(
    "cache",
    [
        {"type": "mag", "mag_ratios": [math.nan]},
        {"type": "mag", "mag_ratios": [1e308]},
        {"type": "first_block", "threshold": "0.1"},
    ],
)
def test_nan_huge_ratios_and_numbers_as_strings_are_400s(http: httpx.Client, cache: object) -> None:
    body = {"prompt": "x", "cache": cache, "seed": 1}
    resp = http.post(
        "/v1/images/generations", content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith("cache"), resp.text


def test_the_server_serves_after_the_hostile_values(client: openai.OpenAI) -> None:
    assert image(client, cache=SKIPPING).shape == (32, 32, 3)
