"""Chat and images on a two-stage text -> image pipeline (an echo text stage feeding tiny-sd):
text answers, SSE streaming, modalities, and image params landing in the diffusion stage's slot."""

from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest
from PIL import Image

from .server_process import start_server, stop_server, write_config

PIPELINE = {
    "model": "echo-sd",
    "stage_args": [
        {
            "stage_id": 0,
            "stage_type": "echo",
            "runtime": {"backend": "process", "torch_threads": 1},
            "final_output": True,
            "final_output_type": "text",
        },
        {
            "stage_id": 1,
            "stage_type": "diffusion",
            "model": "builtin:tiny-sd",
            "engine_input_source": [0],
            "engine_args": {"max_num_seqs": 4, "request_batch_max_wait_ms": 5},
            "final_output": True,
            "final_output_type": "image",
            "default_sampling_params": {"num_inference_steps": 2, "guidance_scale": 7.5, "height": 64, "width": 64},
        },
    ],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    srv = start_server(str(write_config(tmp / "echo-sd.yaml", PIPELINE)), log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_text_answer_from_the_text_stage(client):
    resp = client.chat.completions.create(
        model="echo-sd", messages=user("tell me about foxes"), modalities=["text"], temperature=0.2, max_tokens=16
    )
    assert resp.object == "chat.completion" and resp.model == "echo-sd"
    assert resp.choices[0].message.content == "tell me about foxes"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None


def test_the_last_user_message_is_the_prompt(client):
    messages = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": [{"type": "text", "text": "second"}, {"type": "text", "text": "question"}]},
    ]
    resp = client.chat.completions.create(model="echo-sd", messages=messages, modalities=["text"])
    assert resp.choices[0].message.content == "second\nquestion"


def test_streaming_sends_chunks_and_ends_with_done(server, client):
    chunks = list(
        client.chat.completions.create(
            model="echo-sd",
            messages=user("stream this"),
            modalities=["text"],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "stream this"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # the usage chunk
    # The raw stream: SSE events, `data: [DONE]` last.
    body = {"model": "echo-sd", "messages": user("raw"), "stream": True, "modalities": ["text"]}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_text_and_image_in_one_answer(client):
    resp = client.chat.completions.create(model="echo-sd", messages=user("a red boat"), modalities=["text", "image"])
    message = resp.choices[0].message
    assert message.content == "a red boat"
    [image] = message.model_extra["images"]
    assert image["type"] == "image_url"
    png = base64.b64decode(image["image_url"]["url"].removeprefix("data:image/png;base64,"))
    assert Image.open(io.BytesIO(png)).size == (64, 64)


def test_stream_with_text_then_image(client):
    chunks = list(
        client.chat.completions.create(
            model="echo-sd", messages=user("a green hill"), modalities=["text", "image"], stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    texts = [d.content for d in deltas if d.content]
    images = [i for d in deltas for i in (d.model_extra or {}).get("images") or []]
    assert texts == ["a green hill"]  # text first: it is ready before the image stage runs
    assert [i["type"] for i in images] == ["image_url"]
    assert deltas.index(next(d for d in deltas if (d.model_extra or {}).get("images"))) > deltas.index(
        next(d for d in deltas if d.content)
    )


def test_images_route_puts_params_in_the_diffusion_stage(client):
    resp = client.images.generate(prompt="a tower", n=2, size="32x48", extra_body={"num_inference_steps": 1, "seed": 9})
    sizes = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))).size for d in resp.data]
    assert sizes == [(32, 48), (32, 48)]
    assert [d.model_extra["seed"] for d in resp.data] == [9, 10]


def test_image_only_modality_skips_the_text_part(client):
    resp = client.chat.completions.create(model="echo-sd", messages=user("a cloud"), modalities=["image"])
    message = resp.choices[0].message
    assert message.content is None and [p["type"] for p in message.model_extra["images"]] == ["image_url"]
