"""tiny-omni-speech-chunked: the tiny LM's answer spoken sentence by sentence by a chunked VITS
stage, as it streams. One app (real stage processes, in-process HTTP through the real ``openai``
client) serves every case: audio deltas in chunk order that add up to the answer's audio and equal
each chunk synthesised alone; chat and /v1/audio/speech streaming per chunk; streaming input
updates and their typed errors; an abort and a deadline in the middle of the chain leave nothing
running in any stage; a speech stage killed mid-chain is a typed error to the caller (last: the
replica restarts after it)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import time
from typing import Any

import msgspec
import numpy as np
import openai
import pytest
from omni_runtime.entrypoints.async_omni import AsyncOmni
from omni_runtime.entrypoints.openai.server import create_app
from starlette.testclient import TestClient

from omni_runtime.config import load_config
from omni_runtime.engine.chunking import Chunker
from omni_runtime.exceptions import (
    InvalidRequestError,
    RequestAbortedError,
    RequestTimeoutError,
    StageDeadError,
    StreamClosedError,
    UnknownRequestError,
)
from omni_runtime.input_funcs import speak_text

pytestmark = pytest.mark.integration

MODEL = "tiny-omni-speech-chunked"
PROMPT = "say something about the sea"
SEED = 11
#: A seed whose answer to PROMPT runs to 256 tokens (the random LM often ends early): a request
#: that is still running when the test stops it.
LONG = {"seed": 2, "max_tokens": 256}
#: Chunks of one request may share a wave (``max_buffered: 2``) in one run and not in another:
#: the speech runner's audio is the same up to float round-off, which VITS's flow and vocoder
#: grow to about 1e-4 of full scale (the tiny random model's audio is near full scale). Tolerances
#: 10x that: a different chunk or seed differs by a large fraction of full scale.
ROUND_OFF = 2e-3
PCM_ROUND_OFF = 64  # in 16-bit steps, the same 2e-3 of full scale


@pytest.fixture(scope="module")
def served():
    config = load_config(MODEL)
    # The bundled config, its speech stage's runner given one control call more (speak_alone).
    speech = msgspec.structs.replace(
        config.stage(1), stage_type=f"{__package__}.speech_reference:ReferenceSpeechRunner"
    )
    app = create_app(msgspec.structs.replace(config, stage_args=[config.stage(0), speech]))
    with TestClient(app) as client:
        for _ in range(1200):  # the stages load in the background: until /readyz says so
            if client.get("/readyz").status_code == 200:
                break
            time.sleep(0.1)
        yield client, app.state.omni.multi.engine(None)


def call(served, make: Any) -> Any:
    """Run ``make()`` (a coroutine) on the app's event loop, where the engine's channel lives."""
    client, _ = served

    async def run() -> Any:
        return await make()

    return client.portal.call(run)


async def stream(omni: AsyncOmni, **shared: Any) -> tuple[list[str], list[np.ndarray], Any]:
    """One request's text deltas, audio deltas (in order) and final output."""
    texts, clips, out = [], [], None
    async for out in omni.generate(PROMPT, omni.sampling_params(shared={"seed": SEED} | shared)):
        if out.stage_id == 0 and out.text_delta:
            texts.append(out.text_delta)
        clips += [m.samples for m in out.media_delta]
    return texts, clips, out


async def settled(omni: AsyncOmni) -> list[tuple[int, int]]:
    """Once nothing runs: each stage's (running, queued) from its worker, after the pools agree."""
    for _ in range(200):
        stats = [r.result for r in await omni.collective_rpc("get_stats")]
        busy = [(s["running"], s["queue_len"]) for s in stats]
        pools = [s.inflight for s in omni.health().stages]
        if not any(pools) and all(b == (0, 0) for b in busy):
            break
        await asyncio.sleep(0.05)
    assert not omni.engine._orchestrator.chunks.in_flight  # no chunk of any request left to route
    return busy


def test_audio_deltas_come_in_chunk_order_and_equal_each_chunk_synthesised_alone(served):
    _, omni = served
    texts, clips, out = call(served, lambda: stream(omni, max_tokens=40))
    speech = out.outputs_by_stage[1]
    whole = speech.audios[0].samples
    # 1) the deltas are the whole, in order, one per chunk
    assert len(clips) == speech.metrics["chunks"] >= 2
    np.testing.assert_array_equal(np.concatenate(clips, axis=1), whole)
    # 2) the chunks are the policy's cuts of the streamed text, each spoken alone
    stage = load_config(MODEL).stage(1)
    assert stage.input_chunking is not None
    chunker = Chunker(stage.input_chunking)
    chunks = [c for t in texts for c in chunker.feed(t)] + chunker.finish()
    assert "".join(texts) == out.outputs_by_stage[0].text
    prompts = [speak_text(PROMPT, {0: {"text": c.text}})["prompt"] for c in chunks]
    params = omni.validate(PROMPT, omni.sampling_params(shared={"seed": SEED})).params[1]
    alone = call(served, lambda: omni.collective_rpc("speak_alone", [prompts, params], stage_ids=[1]))[0]
    assert alone.error is None
    reference = np.concatenate([np.asarray(c, dtype=np.float32) for c in alone.result])[None, :]
    np.testing.assert_allclose(whole, reference, atol=ROUND_OFF)


def test_chat_streams_audio_per_chunk_and_the_whole_answer_is_unchanged(served):
    client, _ = served
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    kwargs: Any = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "pcm16"},
        "seed": SEED,
        "max_tokens": 40,
    }
    pieces, transcript, order = [], None, []
    for event in oai.chat.completions.create(stream=True, **kwargs):
        delta = event.choices[0].delta if event.choices else None
        audio = getattr(delta, "audio", None) if delta is not None else None
        if delta is not None and delta.content:
            order.append("text")
        if audio:
            if audio.data:
                pieces.append(base64.b64decode(audio.data))
                order.append("audio")
            transcript = audio.transcript or transcript
    whole = oai.chat.completions.create(**kwargs)
    streamed = np.frombuffer(b"".join(pieces), dtype="<i2")
    answered = np.frombuffer(base64.b64decode(whole.choices[0].message.audio.data), dtype="<i2")
    assert streamed.shape == answered.shape and np.abs(streamed.astype(int) - answered).max() <= PCM_ROUND_OFF
    assert transcript == whole.choices[0].message.audio.transcript
    assert order.count("audio") >= 2 and order[-1] == "audio"


def test_the_speech_route_streams_each_chunk_as_sse_and_raw_pcm(served):
    client, _ = served
    body = {"model": MODEL, "input": PROMPT, "voice": "alloy", "seed": SEED, "response_format": "pcm"}
    events = []
    with client.stream("POST", "/v1/audio/speech", json={**body, "stream_format": "sse"}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done" and events[-1]["usage"]["input_tokens"] > 0
    sse = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    raw = client.post("/v1/audio/speech", json=body)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("audio/")
    a, b = np.frombuffer(sse, dtype="<i2"), np.frombuffer(raw.content, dtype="<i2")
    assert a.shape == b.shape and np.abs(a.astype(int) - b).max() <= PCM_ROUND_OFF


def test_streaming_updates_feed_the_chain_and_refuse_what_they_cannot_take(served):
    _, omni = served

    async def run() -> Any:
        params = omni.sampling_params(shared={"seed": SEED, "max_tokens": 8})
        agen = omni.open_streaming("tell me. ", params, request_id="upd")
        omni.add_streaming_update("upd", "about the sea. ")
        with pytest.raises(InvalidRequestError):
            omni.add_streaming_update("upd", inputs={"x": object()})
        with pytest.raises(UnknownRequestError):
            omni.add_streaming_update("nobody", "more")
        omni.add_streaming_update("upd", "and the sky", final=True)
        with pytest.raises(StreamClosedError):
            omni.add_streaming_update("upd", "too late")
        async for out in agen:
            pass
        with pytest.raises(UnknownRequestError):  # finished
            omni.add_streaming_update("upd", "after the end")
        return out

    out = call(served, run)
    text = out.outputs_by_stage[0]
    assert out.finished and text.metrics["chunks"] == 3  # one text-stage run per sentence of input
    assert out.outputs_by_stage[1].audios[0].num_samples > 0
    assert call(served, lambda: settled(omni)) == [(0, 0), (0, 0)]


def test_abort_and_deadline_mid_chain_leave_nothing_running_in_any_stage(served):
    _, omni = served

    async def abort_after_first_audio() -> None:
        rid = "to-abort"
        async for out in omni.generate(PROMPT, omni.sampling_params(shared=LONG), request_id=rid):
            if out.media_delta:
                omni.abort(rid)

    with pytest.raises(RequestAbortedError):
        call(served, abort_after_first_audio)
    assert call(served, lambda: settled(omni)) == [(0, 0), (0, 0)]
    with pytest.raises(RequestTimeoutError):
        call(served, lambda: stream(omni, **LONG, timeout=0.2))
    assert call(served, lambda: settled(omni)) == [(0, 0), (0, 0)]


def test_a_speech_stage_killed_mid_chain_is_a_typed_error_for_the_caller(served):
    _, omni = served
    pid = call(served, lambda: omni.collective_rpc("get_stats", stage_ids=[1]))[0].result["pid"]
    killed: list[float] = []

    async def kill_after_first_audio() -> None:
        async for out in omni.generate(PROMPT, omni.sampling_params(shared=LONG)):
            if out.media_delta and not killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(time.monotonic())

    with pytest.raises(StageDeadError):
        call(served, kill_after_first_audio)
    print(f"typed error {time.monotonic() - killed[0]:.2f} s after the kill")
    assert omni.health().stages[0].inflight == 0
    assert not omni.engine._orchestrator.chunks.in_flight
