"""Resolved params travel to the runner as they are: the struct ``resolve_params`` made, with its
fallbacks filled in, crosses the wire unchanged (its arrays as raw buffers or shared memory, its
LoRA and cache as structs), so no runner merges a default of its own. Milliseconds, no model."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from omni_runtime import shm
from omni_runtime.acceleration import FirstBlockCache
from omni_runtime.config import StageConfig
from omni_runtime.messages import StageRequest
from omni_runtime.params import (
    Code2WavSamplingParams,
    DiffusionSamplingParams,
    EchoSamplingParams,
    GenericSamplingParams,
    LoraRequest,
    SpeechSamplingParams,
    StageParams,
    TalkerSamplingParams,
    TextSamplingParams,
    in_force,
    params_to_dict,
    resolve_params,
)
from omni_runtime.serialization import Encoder, inbound_decoder
from omni_runtime.stage.runners.base import RunnerRequest
from omni_runtime.stage.runners.echo import EchoRunner

pytestmark = pytest.mark.unit

IMAGE = np.arange(32 * 48 * 3, dtype=np.uint8).reshape(32, 48, 3)
MASK = np.full((32, 48), 255, np.uint8)


def image_request() -> DiffusionSamplingParams:
    given = {
        "image": IMAGE,
        "mask_image": MASK,
        "strength": 0.6,
        "seed": 7,
        "lora": {"name": "ink", "scale": 0.8},
        "cache": {"type": "first_block", "threshold": 0.2},
        "num_inference_steps": 4,
    }
    return resolve_params(DiffusionSamplingParams, {"guidance_scale": 7.5, "negative_prompt": "blurry"}, given)


def same(a: msgspec.Struct, b: msgspec.Struct) -> None:
    """Equal field by field (arrays by value, dtype and shape), and of one class."""
    assert type(a) is type(b)
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y), name
        else:
            assert x == y, name


def over_the_wire(params: Any, decoder: Any, encoder: Encoder | None = None) -> Any:
    frames = (encoder or Encoder()).encode(StageRequest(request_id="r", prompt="a fox", params=params))
    msg = decoder.decode([bytes(f) for f in frames])  # as separate buffers, as from a socket
    assert isinstance(msg, StageRequest)
    return msg.params


def test_a_resolved_params_struct_crosses_the_wire_unchanged() -> None:
    sent = image_request()
    assert isinstance(sent.lora, LoraRequest) and isinstance(sent.cache, FirstBlockCache)
    # Decoded as the stage's own params class (what a stage process does), and as the tagged union
    # of every builtin class (the tag says which).
    for decoder in (inbound_decoder(params_cls=DiffusionSamplingParams), inbound_decoder(params_cls=StageParams)):
        got = over_the_wire(sent, decoder)
        same(got, sent)
        assert got.output_type == "pil"  # the fallback in force travelled as set
    # Every builtin class, through the union.
    for params_cls, given in (
        (TextSamplingParams, {"seed": 1, "stop": ["\n"]}),
        (SpeechSamplingParams, {"voice": "echo"}),
        (TalkerSamplingParams, {"max_codes": 8}),
        (Code2WavSamplingParams, {"speed": 1.5}),
        (EchoSamplingParams, {"timeout": 3}),
        (GenericSamplingParams, {"style": "ink", "size": [1, 2]}),
    ):
        sent_one = resolve_params(params_cls, {}, given)
        same(over_the_wire(sent_one, inbound_decoder(params_cls=StageParams)), sent_one)


def test_large_image_params_go_through_shared_memory_and_arrive_in_place(engine: str, pool: shm.ShmPool) -> None:
    big = np.random.default_rng(0).integers(0, 255, (512, 512, 3), dtype=np.uint8)  # past SHM_MIN_BYTES
    sent = resolve_params(DiffusionSamplingParams, {}, {"image": big, "lora": {"path": "/srv/ink"}})
    encoder = Encoder(pool)
    got = over_the_wire(sent, inbound_decoder(engine, DiffusionSamplingParams), encoder)
    assert len(encoder.handles) == 1 and shm.pending(encoder.handles[0])  # mapped, not copied
    same(got, sent)
    del got
    assert not shm.pending(encoder.handles[0])  # released once the worker drops the request


def test_a_custom_params_class_is_tagged_and_decoded_as_its_stages() -> None:
    class ToneParams(EchoSamplingParams):
        pitch: float | None = None

    sent = resolve_params(ToneParams, {"pitch": 440.0}, {"seed": None})
    got = over_the_wire(sent, inbound_decoder(params_cls=ToneParams))
    same(got, sent)
    assert got.pitch == 440.0 and got.delay_ms == 0.0  # the echo fallback, inherited


def test_the_runner_sees_each_default_in_force_without_merging_one() -> None:
    """Every fallback of every builtin class is set in what a runner gets from a request that set
    nothing; the stage's default wins over it, and the request's over both."""
    for params_cls in (DiffusionSamplingParams, TextSamplingParams, SpeechSamplingParams, TalkerSamplingParams):
        resolved = resolve_params(params_cls, {}, {})
        assert params_cls.fallbacks, params_cls
        for name, value in params_cls.fallbacks.items():
            assert getattr(resolved, name) == value is not None, (params_cls, name)
    text = resolve_params(TextSamplingParams, {"temperature": 0.5}, {"top_k": 3})
    assert (text.temperature, text.top_k, text.top_p, text.max_tokens) == (0.5, 3, 1.0, 32)
    # A typed request's unset fields (None) do not hide the stage's defaults.
    assert resolve_params(TextSamplingParams, {"temperature": 0.5}, TextSamplingParams(seed=2)).temperature == 0.5
    # The dict view a caller reads shows the value in force too.
    assert params_to_dict(resolve_params(SpeechSamplingParams, {}, {}))["speed"] == 1.0


def test_a_runner_reads_the_resolved_value_and_refuses_params_that_were_not_resolved() -> None:
    stage = msgspec.convert({"stage_id": 0, "stage_type": "echo"}, StageConfig)
    runner = EchoRunner(stage)
    asked = RunnerRequest("r", "hi", resolve_params(EchoSamplingParams, {}, {}))
    assert asked.params.delay_ms == 0.0 and runner.runs_inline([asked])  # no delay: nothing merged here
    assert not runner.runs_inline([RunnerRequest("s", "hi", resolve_params(EchoSamplingParams, {"delay_ms": 5}, {}))])
    with pytest.raises(ValueError, match="not made by resolve_params"):
        in_force(EchoSamplingParams().delay_ms)
