"""Chat over the bundled tiny-omni pipeline (a tiny LM that streams tokens, then tiny-sd): real
text deltas arrive as separate SSE chunks, and the chat params reach the text stage."""

from __future__ import annotations

import httpx
import pytest

from .server_process import start_server, stop_server


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai

    srv = start_server("tiny-omni", log=tmp_path_factory.mktemp("omni") / "server.log")
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    stop_server(srv)


def ask(client, stream: bool, **kw):
    return client.chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": "a fox"}], stream=stream, **kw
    )


def test_text_streams_token_by_token_and_matches_the_whole_answer(client):
    params = {"modalities": ["text"], "seed": 11, "max_tokens": 8, "temperature": 0.8}
    whole = ask(client, False, **params)
    chunks = list(ask(client, True, stream_options={"include_usage": True}, **params))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 2  # several deltas, not one final blob
    assert "".join(pieces) == whole.choices[0].message.content  # same seed, same text
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens <= 8 and usage.prompt_tokens > 0
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert (whole.choices[0].finish_reason == "length") == (whole.usage.completion_tokens == 8)


def test_text_then_image_from_both_stages(client):
    resp = ask(client, False, seed=2, max_tokens=4)
    message = resp.choices[0].message
    assert isinstance(message.content, str) and message.content
    [image] = message.model_extra["images"]
    assert image["image_url"]["url"].startswith("data:image/png;base64,")


def test_a_text_that_cannot_fit_the_models_context_is_a_400_naming_the_field_before_it_is_queued(client):
    """tiny-lm's context is 16,384 tokens, and its longest token 4 bytes: 40,000 characters are at
    least 10,000 tokens, 70,000 at least 17,500. The caller's count says "at least" (the stage's
    own check, after the queue, counts the tokens it made)."""
    import openai

    for extra, chars, field in (
        ({"max_tokens": 8000}, 40_000, "max_tokens"),
        ({"max_completion_tokens": 8000}, 40_000, "max_completion_tokens"),
        ({}, 70_000, "messages[0].content"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="tiny-omni", messages=[{"role": "user", "content": "a" * chars}], modalities=["text"], **extra
            )
        error = info.value.body
        assert error["param"] == field and "at least" in error["message"], error
    # The same bound on /v1/generate, whose text2image task runs the text stage first.
    job = {"task": "text2image", "model": "tiny-omni", "inputs": {"prompt": "a" * 70_000}, "async_run": False}
    resp = httpx.post(f"{client.base_url}generate", json=job, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "inputs.prompt", resp.text
