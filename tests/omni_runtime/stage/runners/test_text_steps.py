"""Token-level continuous batching of the text stage: one in-process worker with the tiny LM and
``step_execution`` (requests join and leave between tokens, abort frees the slot at the next token,
batched texts equal solo ones, stop / max_tokens / EOS, bad requests), and the group bookkeeping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from omni_runtime.config import StageConfig
from omni_runtime.messages import StageAbort, StageOutput, StageOutputs, StageRequest
from omni_runtime.params import TextSamplingParams, resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.runners.text import TextRunner
from omni_runtime.stage.runners.text_steps import _is_subsequence, plain_cache_reason
from omni_runtime.stage.worker import StageWorker

pytestmark = pytest.mark.integration


# --------------------------------------------------------------------------- pure logic


def test_subsequence_is_a_group_with_members_left_out_in_order() -> None:
    assert _is_subsequence(["a", "c"], ["a", "b", "c"])
    assert _is_subsequence([], ["a"])
    assert not _is_subsequence(["c", "a"], ["a", "b", "c"])  # order changed: rebuilt
    assert not _is_subsequence(["a", "d"], ["a", "b", "c"])  # someone joined: rebuilt


def test_only_a_cache_of_full_attention_layers_is_padded_per_token() -> None:
    kv = torch.zeros(1, 2, 3, 4)
    assert plain_cache_reason(DynamicCache([(kv, kv)])) is None
    sliding = DynamicCache()
    sliding.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4)]
    assert "DynamicSlidingWindowLayer" in (plain_cache_reason(sliding) or "")
    assert "not a DynamicCache" in (plain_cache_reason(object()) or "")


# --------------------------------------------------------------------------- one worker, the tiny LM


class Outbox(list):
    def add(self, msg: Any) -> None:
        self.extend(msg.outputs if isinstance(msg, StageOutputs) else [msg])

    async def wait_for(self, predicate: Callable[[StageOutput], bool], timeout: float = 60.0) -> StageOutput:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in self:
                if predicate(msg):
                    return msg
            await asyncio.sleep(0.002)
        raise TimeoutError("no such output")

    def final(self, rid: str) -> StageOutput | None:
        return next((m for m in self if m.request_id == rid and m.finished), None)

    def deltas(self, rid: str) -> list[str]:
        return [m.payload.text for m in self if m.request_id == rid and not m.finished and m.payload.text]


@pytest.fixture(scope="module")
async def worker(model_cache: Path) -> AsyncIterator[tuple[StageWorker, Outbox]]:
    config = msgspec.convert(
        {
            "stage_id": 0,
            "stage_type": "text",
            "model": "builtin:tiny-lm",
            "engine_args": {"step_execution": True, "max_num_seqs": 4},
        },
        StageConfig,
    )
    outbox = Outbox()
    w = StageWorker(config, 0, send=outbox.add)
    await w.start()
    yield w, outbox
    await w.close()


def send(w: StageWorker, rid: str, prompt: Any, **params: Any) -> None:
    w.handle(StageRequest(request_id=rid, prompt=prompt, params=typed(params)))


def finished(rid: str) -> Callable[[StageOutput], bool]:
    return lambda m: m.request_id == rid and m.finished


def typed(params: dict[str, Any]) -> TextSamplingParams:
    """``params`` as a validated request carries them (fallbacks filled in)."""
    return resolve_params(TextSamplingParams, {}, params)


def solo(w: StageWorker, prompt: str, params: dict[str, Any]) -> str | None:
    """The request-level decode of one request alone (the worker is idle)."""
    (out,) = w.runner.execute([RunnerRequest("solo", prompt, typed(params))], ExecuteContext(lambda rid: False))
    return out.text


async def test_a_request_joins_between_tokens_and_texts_equal_solo_runs(worker: tuple[StageWorker, Outbox]) -> None:
    w, outbox = worker
    assert w.stats()["step_execution"] is True  # the tiny LM's cache can be padded per token
    long = {"max_tokens": 64, "temperature": 1.0, "seed": 3}
    short = {"max_tokens": 4, "temperature": 0.7, "top_k": 20, "seed": 9}
    send(w, "long", "the cat sat on", **long)
    await outbox.wait_for(lambda m: m.request_id == "long" and not m.finished)  # it is decoding
    send(w, "short", "a much longer prompt, about the weather", **short)
    await outbox.wait_for(finished("long"))
    a, b = outbox.final("long"), outbox.final("short")
    assert a is not None and b is not None and a.error is None and b.error is None
    # short joined the running decode and left it first; long went on without waiting for a wave.
    assert [m.request_id for m in outbox if m.finished] == ["short", "long"]
    assert b.payload.metrics.batch_size == 2 and b.payload.metrics.steps_run == b.payload.metrics.completion_tokens
    assert a.payload.metrics.batch_size == 2
    assert a.payload.metrics.completion_tokens == a.payload.metrics.steps_run > b.payload.metrics.steps_run
    assert "".join(outbox.deltas("long")) == a.payload.text and "".join(outbox.deltas("short")) == b.payload.text
    # The text does not depend on the batch: equal to each one's request-level decode alone
    # (float round-off of other shapes, ~1e-5 in the logits, would change a pick only on a near-tie).
    assert a.payload.text == solo(w, "the cat sat on", long)
    assert b.payload.text == solo(w, "a much longer prompt, about the weather", short)
    assert w.stats()["running"] == 0


async def test_abort_frees_the_slot_at_the_next_token(worker: tuple[StageWorker, Outbox]) -> None:
    w, outbox = worker
    w.scheduler.set_config(max_num_seqs=1)
    try:
        send(w, "hog", "x", max_tokens=200, temperature=1.0, seed=1)
        send(w, "next", "y", max_tokens=3, temperature=0)
        await outbox.wait_for(lambda m: m.request_id == "hog" and not m.finished)
        assert outbox.final("next") is None and w.stats()["queue_len"] == 1  # it waits for the one slot
        w.handle(StageAbort(request_ids=["hog"]))
        done = await outbox.wait_for(finished("next"))
        assert done.error is None and done.payload.metrics.completion_tokens <= 3
        await asyncio.sleep(0.05)
        assert outbox.final("hog") is None  # its caller was answered upstream
        assert len(outbox.deltas("hog")) < 100  # it left long before its 200 tokens
        stats = w.stats()
        assert stats["running"] == 0 and stats["queue_len"] == 0
        assert w.runner.steps.states == {}  # its cache was freed
    finally:
        w.scheduler.set_config(max_num_seqs=4)


async def test_stop_strings_max_tokens_and_eos_end_a_request(worker: tuple[StageWorker, Outbox]) -> None:
    w, outbox = worker
    greedy = {"max_tokens": 24, "temperature": 0}
    full = solo(w, "the weather", greedy)
    assert full and len(full) > 6
    stop = full[3:6]
    cut = full[: full.find(stop)]
    send(w, "stop", "the weather", **greedy, stop=[stop])
    send(w, "three", "the weather", max_tokens=3, temperature=0)
    # EOS: sampled requests of many seeds, each equal to its solo decode whether it ends on EOS or max_tokens.
    sampled = {f"s{seed}": {"max_tokens": 12, "temperature": 1.5, "seed": seed} for seed in range(6)}
    for rid, params in sampled.items():
        send(w, rid, "", **params)
    for rid in ("stop", "three", *sampled):
        await outbox.wait_for(finished(rid))
    stopped, three = outbox.final("stop"), outbox.final("three")
    assert stopped is not None and stopped.payload.text == cut and "".join(outbox.deltas("stop")) == cut
    assert three is not None and three.payload.metrics.completion_tokens == 3 and full.startswith(three.payload.text)
    for rid, params in sampled.items():
        out = outbox.final(rid)
        assert out is not None and out.payload.text == solo(w, "", params)
        assert 1 <= out.payload.metrics.completion_tokens <= 12
    assert w.stats()["running"] == 0


async def test_a_bad_request_fails_alone_with_a_typed_error(worker: tuple[StageWorker, Outbox]) -> None:
    w, outbox = worker
    send(w, "not-text", 123, max_tokens=2)
    too_long = typed({})
    msgspec.structs.force_setattr(too_long, "max_tokens", 10**6)  # past the caller's bound
    w.handle(StageRequest(request_id="too-long", prompt="hello", params=too_long))
    send(w, "fine", "hello", max_tokens=2, temperature=0)
    for rid in ("not-text", "too-long", "fine"):
        await outbox.wait_for(finished(rid))
    for rid, param in (("not-text", "prompt"), ("too-long", "max_tokens")):
        out = outbox.final(rid)
        assert out is not None and out.error is not None
        assert (out.error.type, out.error.param) == ("InvalidRequestError", param)
    fine = outbox.final("fine")
    assert fine is not None and fine.error is None
    assert fine.payload.text == solo(w, "hello", {"max_tokens": 2, "temperature": 0})


async def test_sleep_frees_every_cache(worker: tuple[StageWorker, Outbox]) -> None:
    runner = worker[0].runner
    assert isinstance(runner, TextRunner)
    runner.steps.admit([RunnerRequest("held", "some prompt", typed({"max_tokens": 4}))])
    assert "held" in runner.steps.states
    runner.sleep()
    assert runner.steps.states == {} and runner.steps.group is None
    runner.wake_up()


async def test_a_paused_request_keeps_its_cache_and_resumes_unchanged(worker: tuple[StageWorker, Outbox]) -> None:
    # The runner driven directly (the worker is idle): b pauses while a decodes alone (the group
    # shrinks, b takes its cache back), c joins, b resumes (the group is rebuilt), a leaves.
    steps = worker[0].runner.steps
    specs = {
        "a": ("the cat sat on", {"max_tokens": 10, "temperature": 1.0, "seed": 1}),
        "b": ("a much longer prompt, about the weather", {"max_tokens": 12, "temperature": 0.8, "seed": 2}),
        "c": ("", {"max_tokens": 6, "temperature": 0}),
    }
    ctx = ExecuteContext(lambda rid: False)
    texts: dict[str, str | None] = {}

    def step(ids: list[str]) -> None:
        for rid, result in steps.step(ids, ctx).items():
            if result.output is not None:
                texts[rid] = result.output.text

    steps.admit([RunnerRequest(rid, specs[rid][0], typed(specs[rid][1])) for rid in ("a", "b")])
    for ids in (["a", "b"], ["a", "b"], ["a"], ["a"]):
        step(ids)
    steps.admit([RunnerRequest("c", specs["c"][0], typed(specs["c"][1]))])
    step(["a", "c"])
    while steps.states:
        step([rid for rid in ("b", "a", "c") if rid in steps.states])
    for rid, (prompt, params) in specs.items():
        assert texts[rid] == solo(worker[0], prompt, params), rid
