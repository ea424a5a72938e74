"""Property-based fuzzing of the Python API on real stage processes: whatever ``generate`` and
``collective_rpc`` are given (text UTF-8 cannot encode, integers past 64 bits, NaN, wrong types,
deep nesting), the call ends quickly with an output or a typed error, and the engine serves the
next request with the same replica. Before the hardening, one lone surrogate in a prompt killed
the orchestrator thread for good."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_runtime import AsyncOmni, Omni
from omni_runtime.exceptions import InvalidRequestError, OmniError
from omni_runtime.messages import RpcReplicaResult
from tests.conftest import echo_stage, make_config
from tests.strategies import ANY_TEXT, JSON_VALUES

from .support import pids

FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
#: The echo stage waits ``delay_ms``: fuzzing it would only fuzz the test's patience.
PARAMS = st.dictionaries(ANY_TEXT.filter(lambda k: k != "delay_ms"), JSON_VALUES, max_size=3)


def config():
    return make_config(
        [echo_stage(stage_type="tests.reliability.runners:AnyParamsRunner", engine_args={"max_num_seqs": 8})]
    )


@pytest.fixture(scope="module")
def engine():
    with AsyncOmni(config()) as engine:
        yield engine


async def serves_still(engine: AsyncOmni, pid: int) -> None:
    last = None
    async for out in engine.generate("still serving", None):
        last = out
    assert last.text == "still serving"
    assert await pids(engine) == {0: pid}


@FUZZ
@given(
    prompt=ANY_TEXT | JSON_VALUES | st.just("x" * 100_001),
    params=st.none() | PARAMS | JSON_VALUES,
    request_id=st.none() | ANY_TEXT | JSON_VALUES,
    modalities=st.none() | st.lists(ANY_TEXT, max_size=2) | JSON_VALUES,
)
async def test_generate_with_anything_ends_with_an_output_or_a_typed_error(
    engine, prompt, params, request_id, modalities
):
    pid = (await pids(engine))[0]

    async def call():
        async for out in engine.generate(prompt, params, request_id, modalities=modalities):
            if out.finished:
                return out
        raise AssertionError("generate ended without a finished output")

    try:
        out = await asyncio.wait_for(call(), 10)
    except OmniError as e:
        assert str(e)  # typed, with a message
        if isinstance(prompt, str) and any("\ud800" <= c <= "\udfff" for c in prompt):
            assert isinstance(e, InvalidRequestError) and e.param == "prompt"  # the first thing checked
    else:
        assert out.text == prompt
    await serves_still(engine, pid)


@FUZZ
@given(
    method=st.sampled_from(["ping", "get_stats", "set_batching", "no_such"]) | ANY_TEXT | JSON_VALUES,
    args=st.lists(JSON_VALUES, max_size=3) | JSON_VALUES,
    kwargs=st.none() | PARAMS | JSON_VALUES,
    stage_ids=st.none() | st.lists(st.integers(-1, 2) | ANY_TEXT, max_size=2) | JSON_VALUES,
    timeout=st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.integers() | ANY_TEXT,
)
async def test_collective_rpc_with_anything_answers_or_raises_a_typed_error(
    engine, method, args, kwargs, stage_ids, timeout
):
    pid = (await pids(engine))[0]
    try:
        results = await asyncio.wait_for(engine.collective_rpc(method, args, kwargs, stage_ids, timeout), 10)
    except OmniError as e:
        assert str(e)
    else:
        assert isinstance(results, list) and all(isinstance(r, RpcReplicaResult) for r in results)
    await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 8})
    await serves_still(engine, pid)


def test_lone_surrogates_anywhere_are_invalid_request_errors_naming_the_field(engine):
    async def check():
        cases = [
            (("a\ud800b",), {}, "prompt"),
            (("ok", {"note": "\udfff"}), {}, "note"),
            (("ok", None, "id-\ud800"), {}, "request_id"),
            (("ok", {"n": 2**64}), {}, "n"),
        ]
        for args, kw, param in cases:
            with pytest.raises(InvalidRequestError) as err:
                async for _ in engine.generate(*args, **kw):
                    pass
            assert err.value.param == param
        with pytest.raises(InvalidRequestError) as err:
            await engine.collective_rpc("set_batching", kwargs={"max_num_seqs": 100000000000000000000000})
        assert err.value.param == "kwargs.max_num_seqs"

    asyncio.run(check())


def test_the_blocking_api_survives_the_same_inputs():
    with Omni(config()) as omni:
        outs = omni.generate(["fine", "a\ud800b", "also fine"], use_tqdm=False)
        assert [o.text for o in outs] == ["fine", None, "also fine"]
        assert isinstance(outs[1].error, InvalidRequestError) and outs[1].error.param == "prompt"
        with pytest.raises(InvalidRequestError):
            omni.generate("x", {"weird": float("nan"), "big": 10**30}, use_tqdm=False)
        assert omni.generate("after", use_tqdm=False)[0].text == "after"
