"""Property-based fuzzing of the HTTP API of a real ``omni-runtime serve``: whatever the body
(wrong types, huge or non-finite numbers, integers past 64 bits, text UTF-8 cannot encode, unknown
fields, absurd sizes, ``n`` out of range, megabyte prompts, not JSON at all), on every route, the
control route included, the answer is never a 5xx, every error has the OpenAI error shape, and
afterwards the server is healthy and serves normally with the same stage processes.

The one 5xx a valid body may earn is 504, when it sets its own (positive) ``timeout``.
"""

from __future__ import annotations

import json
import math
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.entrypoints.openai.server_process import start_server, write_config
from tests.reliability.support import http_config
from tests.strategies import ANY_TEXT, EDGE_INTS

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    derandomize=True,  # the same bodies every run: a failure here is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --------------------------------------------------------------------------- strategies

huge_ints = st.integers(min_value=-(2**70), max_value=2**70) | EDGE_INTS
any_floats = st.floats(allow_nan=True, allow_infinity=True)
json_scalars = st.none() | st.booleans() | huge_ints | any_floats | st.text(max_size=40) | ANY_TEXT
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | ANY_TEXT, inner, max_size=4),
    max_leaves=10,
)


def field(sensible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the right kind, sometimes anything JSON at all."""
    return st.one_of(sensible, sensible, json_values)


prompts = st.one_of(
    st.text(max_size=120),
    ANY_TEXT,
    st.sampled_from(["", " ", "\x00", "a cat", "🐈" * 50, "x" * 100_001, "y" * 1_000_000, "x\udfffy", "\ud800"]),
)
sizes = st.one_of(
    st.sampled_from(["64x64", "auto", "AUTO", "0x0", "100000x100000", "4096x4096", "8x8", "12x12", "64x-64", "x", ""]),
    st.sampled_from(["1024X1024", " 64x64 ", "64x64x64", "64*64", "4096x4097"]),
    st.just("\uff11\uff12\uff18x\uff11\uff12\uff18"),  # full-width digits
    st.builds("{}x{}".format, st.integers(-10, 10**6), st.integers(-10, 10**6)),
)
positive_timeouts = st.floats(min_value=1e-9, max_value=5.0)
extra_fields = st.dictionaries(
    st.sampled_from(["tools", "logprobs", "foo", "__proto__", "", "N", "prompt ", "response_format"])
    | st.text(max_size=12),
    json_values,
    max_size=3,
)


def with_extras(body: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(body, st.one_of(st.just({}), extra_fields)).map(lambda t: {**t[1], **t[0]})


def bodies(valid: st.SearchStrategy, fuzzed: st.SearchStrategy, keys: list[str]) -> st.SearchStrategy:
    """A third valid bodies (they reach the engine), a third valid ones with one field made
    hostile, a third fuzzed everywhere (with unknown fields sometimes)."""
    mutated = st.tuples(valid, st.sampled_from(keys), json_values | prompts | sizes).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, mutated, with_extras(fuzzed))


text = st.text(min_size=1, max_size=80).filter(str.strip)
valid_images = st.fixed_dictionaries(
    {"prompt": text},
    optional={
        "n": st.integers(1, 4),
        "size": st.sampled_from(["64x64", "auto", "8x8", "128x64", "2048x2048"]),
        "response_format": st.sampled_from(["b64_json", "url"]),
        "output_format": st.sampled_from(["png", "jpeg", "webp"]),
        "output_compression": st.integers(0, 100),
        "negative_prompt": st.text(max_size=40),
        "num_inference_steps": st.integers(1, 50),
        "guidance_scale": st.floats(0, 20),
        "seed": st.integers(0, 2**63 - 1),
        "timeout": st.floats(1.0, 60.0),
        "model": st.just("reliability"),
        "user": st.text(max_size=20),
    },
)
fuzzed_images = st.fixed_dictionaries(
    {"prompt": field(prompts)},
    optional={
        "n": field(st.integers(-3, 15) | huge_ints),
        "size": field(sizes),
        "response_format": field(st.sampled_from(["b64_json", "url", "URL", "png"])),
        "output_format": field(st.sampled_from(["png", "jpeg", "webp", "gif"])),
        "output_compression": field(st.integers(-5, 150)),
        "negative_prompt": field(prompts),
        "num_inference_steps": field(st.integers(-1, 2000) | huge_ints),
        "guidance_scale": field(st.floats(-10, 200) | any_floats),
        "seed": field(st.integers(-5, 2**64)),
        "timeout": field(positive_timeouts | st.floats(-1, 1e6)),
        "model": field(st.sampled_from(["reliability", "gpt-image-1", "", "x\udfffy"]) | ANY_TEXT),
        "stream": field(st.booleans()),
        "user": field(st.text(max_size=300) | ANY_TEXT),
        "quality": field(st.sampled_from(["high", "standard", "x" * 40])),
    },
)
image_bodies = bodies(
    valid_images,
    fuzzed_images,
    ["prompt", "n", "size", "response_format", "output_format", "seed", "timeout", "guidance_scale", "stream", "x"],
)

content_parts = st.lists(
    st.fixed_dictionaries(
        {"type": field(st.sampled_from(["text", "image_url", "input_audio"]))},
        optional={"text": field(prompts), "image_url": field(st.fixed_dictionaries({"url": st.text(max_size=40)}))},
    ),
    max_size=3,
)
fuzzed_messages = st.lists(
    st.fixed_dictionaries(
        {"role": field(st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"]))},
        optional={"content": field(prompts | content_parts), "name": field(st.text(max_size=20) | ANY_TEXT)},
    ),
    max_size=4,
)
valid_messages = st.tuples(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "assistant"]), "content": text}), max_size=2),
    st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2)),
).map(lambda t: [*t[0], {"role": "user", "content": t[1]}])
valid_chats = st.fixed_dictionaries(
    {"messages": valid_messages},
    optional={
        "model": st.just("reliability"),
        "modalities": st.sampled_from([["text"], ["image"], ["text", "image"]]),
        "stream": st.booleans(),
        "max_tokens": st.integers(1, 100),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4),
        "timeout": st.floats(1.0, 60.0),
    },
)
fuzzed_chats = st.fixed_dictionaries(
    {"messages": field(fuzzed_messages)},
    optional={
        "model": field(st.sampled_from(["reliability", "gpt-4o", ""]) | ANY_TEXT),
        "modalities": field(st.lists(st.sampled_from(["text", "image", "audio"]), max_size=3)),
        "stream": field(st.booleans()),
        "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
        "max_tokens": field(st.integers(-1, 10_000) | huge_ints),
        "max_completion_tokens": field(st.integers(-1, 10_000)),
        "temperature": field(st.floats(-1, 5) | any_floats),
        "top_p": field(st.floats(-1, 2)),
        "seed": field(st.integers(-5, 2**64)),
        "stop": field(st.text(max_size=300) | st.lists(st.text(max_size=10), max_size=6)),
        "n": field(st.integers(-1, 5)),
        "timeout": field(positive_timeouts | st.floats(-1, 1e6)),
        "metadata": field(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)),
    },
)
chat_bodies = bodies(
    valid_chats,
    fuzzed_chats,
    ["messages", "modalities", "stream", "max_tokens", "temperature", "stop", "n", "timeout", "seed", "x"],
)
rpc_kwargs = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "max_num_seqs": st.integers(-2, 10) | huge_ints | any_floats | ANY_TEXT,
            "request_batch_max_wait_ms": st.floats(-1, 100) | any_floats | huge_ints,
        },
    ),
    st.dictionaries(ANY_TEXT, json_values, max_size=3),
)
valid_rpcs = st.fixed_dictionaries(
    {"method": st.sampled_from(["ping", "get_stats", "set_batching"])},
    optional={
        "stage_ids": st.sampled_from([[0], [1], [0, 1]]),
        "timeout": st.floats(0.5, 10),
        "kwargs": st.fixed_dictionaries(
            {}, optional={"max_num_seqs": st.integers(1, 8), "request_batch_max_wait_ms": st.floats(0, 20)}
        ),
    },
)
fuzzed_rpcs = st.fixed_dictionaries(
    {"method": field(st.sampled_from(["ping", "get_stats", "set_batching", "no_such", "", "__init__"]) | ANY_TEXT)},
    optional={
        "args": field(st.lists(json_values, max_size=4)),
        "kwargs": field(rpc_kwargs),
        "stage_ids": field(st.lists(st.integers(-2, 3) | huge_ints, max_size=3)),
        "timeout": field(positive_timeouts | st.floats(-1, 1e6) | any_floats | huge_ints),
    },
)
rpc_bodies = bodies(valid_rpcs, fuzzed_rpcs, ["method", "args", "kwargs", "stage_ids", "timeout", "x"])
raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"prompt": "a", "n": 1e999}', b'{"prompt": "\\ud800"}', b"\xff\xfe"]),
    json_values.map(lambda v: json.dumps(v, allow_nan=True).encode()),
)

# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("http-fuzz")
    server = start_server(str(write_config(workdir / "server.yaml", http_config())), log=workdir / "server.log")
    try:
        stages = server.children()
        yield server
    finally:
        rc = server.stop()
    assert rc == 0, server.log()[-3000:]
    assert not [p for p in stages if p.is_running()]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _has_own_deadline(body: object) -> bool:
    timeout = body.get("timeout") if isinstance(body, dict) else None
    return isinstance(timeout, int | float) and not isinstance(timeout, bool) and math.isfinite(timeout) and timeout > 0


def post(http: httpx.Client, path: str, content: bytes, body: object = None) -> httpx.Response:
    resp = http.post(path, content=content, headers={"Content-Type": "application/json"})
    status = resp.status_code
    event(f"status {status}")  # see --hypothesis-show-statistics
    allowed = status < 500 or (status == 504 and _has_own_deadline(body))
    assert allowed, f"{path} -> {status} for {content[:300]!r}: {resp.text[:500]}"
    if status != 200:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"], resp.text[:500]
    elif b'"stream": true' in content or b'"stream":true' in content:
        assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-300:]
    else:
        assert resp.json() is not None
    return resp


def encode(body: object) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN and Infinity go out as they are


@FUZZ
@given(body=image_bodies)
def test_fuzzed_image_requests_never_get_a_5xx(http, body):
    resp = post(http, "/v1/images/generations", encode(body), body)
    if resp.status_code == 200:
        n = body.get("n", 1)
        assert len(resp.json()["data"]) == n


@FUZZ
@given(body=chat_bodies)
def test_fuzzed_chat_requests_never_get_a_5xx(http, body):
    post(http, "/v1/chat/completions", encode(body), body)


@FUZZ
@given(content=raw_bodies, path=st.sampled_from(["/v1/images/generations", "/v1/chat/completions"]))
def test_bodies_that_are_not_requests_get_a_4xx(http, content, path):
    resp = post(http, path, content)
    assert resp.status_code in (400, 413, 422), resp.text[:300]


@FUZZ
@given(body=rpc_bodies)
def test_fuzzed_control_calls_never_get_a_5xx_nor_hang(http, body):
    """The defect: an integer past 64 bits in kwargs killed the call's task; the call hung and
    SIGTERM could not stop the server any more."""
    resp = post(http, "/v1/omni/collective_rpc", encode(body), body)
    if resp.status_code == 200:
        results = resp.json()
        assert isinstance(results, list) and all({"stage_id", "replica_id", "ok"} <= r.keys() for r in results)


@settings(FUZZ, max_examples=150)
@given(name=ANY_TEXT | st.text(max_size=300), route=st.sampled_from(["/v1/models/", "/v1/files/"]))
@example(name="0/", route="/v1/files/")  # a trailing slash was an empty 307 redirect
def test_fuzzed_path_parameters_never_get_a_5xx(http, name, route):
    resp = http.get(route + quote(name.encode("utf-8", "surrogatepass"), safe=""))
    assert resp.status_code < 500, resp.text[:300]
    if resp.status_code != 200:
        assert resp.json()["error"]["message"]


def test_the_server_is_healthy_after_the_fuzzing(server, http):
    assert http.get("/health").json() == {"status": "ok"}
    stages = http.get("/readyz").json()["stages"]
    assert [(s["live_replicas"], s["restarts"], s["inflight"]) for s in stages] == [(1, 0, 0), (1, 0, 0)]
    resp = http.post("/v1/images/generations", json={"prompt": "after", "n": 2, "size": "64x64"})
    assert resp.status_code == 200 and len(resp.json()["data"]) == 2
    resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "after"}]})
    assert resp.status_code == 200 and "after" in json.dumps(resp.json()["choices"][0]["message"]["content"])
    log = server.log()
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]
