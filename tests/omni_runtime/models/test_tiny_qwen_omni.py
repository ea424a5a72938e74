"""The tiny Qwen2.5-Omni pipeline: thinker -> talker -> token2wav, each its own stage.

One engine (``tiny-qwen-omni``, its stages in this process to keep the module cheap) answers a
prompt with text and audio, the same for the same seeds, and refuses bad params before anything
is queued. The stages' runners, loaded beside it from the same build, show the hand-off contract
the chunked pipeline relies on: the talker's streamed code deltas add up to its final codes, and
the decoder's audio of a chunk equals its audio of the same codes given alone; an aborted talker
stops streaming with a typed error, and hostile codes are refused naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_runtime import Omni
from omni_runtime.config import load_config
from omni_runtime.exceptions import InvalidRequestError, RequestAbortedError
from omni_runtime.params import (
    Code2WavSamplingParams,
    TalkerSamplingParams,
    TextSamplingParams,
    link_constraints,
    resolve_params,
)
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.qwen_omni import (
    CODES,
    REPLY_IDS,
    REPLY_STATES,
    THINKER_TENSORS,
    Code2WavRunner,
    TalkerRunner,
    ThinkerRunner,
)

SEEDS = [{"seed": 5, "max_tokens": 8}, {"seed": 6, "max_codes": 12}, {"seed": 7}]


@pytest.mark.unit
@given(value=st.one_of(st.none(), st.integers(), st.floats(allow_nan=True), st.booleans(), st.text(max_size=3)))
@settings(max_examples=100, deadline=None)
def test_hostile_max_codes_is_an_invalid_request_error_naming_it(value: Any) -> None:
    try:
        resolved = resolve_params(TalkerSamplingParams, {}, {"max_codes": value})
    except InvalidRequestError as e:
        assert e.param == "max_codes"
        return
    assert value is None or 1 <= resolved.max_codes <= 4096


@pytest.fixture(scope="module")
def omni(model_cache: Path) -> Any:
    """The bundled config on real stage processes (forked from one launcher that imported
    transformers once, so three stages cost little more than one)."""
    with Omni("tiny-qwen-omni") as engine:
        yield engine


@pytest.fixture(scope="module")
def runners(omni: Any) -> dict[str, Any]:
    """The three runners loaded in this process from the engine's build."""
    stages = load_config("tiny-qwen-omni").stage_args
    loaded = {
        "thinker": ThinkerRunner(stages[0]),
        "talker": TalkerRunner(stages[1]),
        "code2wav": Code2WavRunner(stages[2]),
    }
    for runner in loaded.values():
        runner.load()
    return loaded


def thinker_params(params: dict[str, Any]) -> TextSamplingParams:
    """``params`` as a thinker's runner gets them: resolved (validated, fallbacks filled in)."""
    return resolve_params(TextSamplingParams, {}, params)


def talker_params(params: dict[str, Any]) -> TalkerSamplingParams:
    return resolve_params(TalkerSamplingParams, {}, params)


def code2wav_params(params: dict[str, Any]) -> Code2WavSamplingParams:
    return resolve_params(Code2WavSamplingParams, {}, params)


def _run(runner: Any, request: RunnerRequest) -> tuple[RunnerOutput, list[RunnerOutput]]:
    deltas: list[RunnerOutput] = []
    ctx = ExecuteContext(is_aborted=lambda _: False, emit=lambda _, out: deltas.append(out))
    (out,) = runner.execute([request], ctx)
    return out, deltas


@pytest.mark.integration
def test_a_prompt_gives_text_and_audio_the_same_for_the_same_seeds(omni: Any) -> None:
    first, second = omni.generate(["say hello", "say hello"], SEEDS, use_tqdm=False)
    assert first.error is None and first.text
    (clip,) = first.audios
    assert clip.sample_rate == 16_000 and clip.samples.shape[0] == 1 and clip.num_samples > 0
    assert 0 < float(np.abs(clip.samples).max()) <= 1.0
    # Every code is two mel frames of 32 samples: the clip's length follows the talker's codes.
    assert clip.num_samples == first.outputs_by_stage[2].metrics["codes"] * 64
    assert 1 <= first.outputs_by_stage[2].metrics["codes"] <= 12  # the talker's max_codes
    assert second.text == first.text
    np.testing.assert_array_equal(second.audios[0].samples, clip.samples)


@pytest.mark.integration
def test_the_decoder_speaks_the_codes_chunk_by_chunk_in_order(omni: Any) -> None:
    """The bundled config hands the talker's codes on 16 at a time: the caller gets each chunk's
    audio as it is made, in order, and together they are the final clip (that a chunk's audio is
    the decoder's audio of those codes alone is the runner test below)."""
    request = omni._async.sampling_params(shared={"seed": 3, "max_codes": 40})

    async def collect() -> tuple[list[np.ndarray], Any]:
        deltas: list[np.ndarray] = []
        final = None
        async for out in omni._async.generate("say hello", request):
            deltas += [m.samples for m in out.media_delta]
            final = out
        return deltas, final

    deltas, final = omni._run("generate", collect())
    (clip,) = final.audios
    codes = final.outputs_by_stage[2].metrics["codes"]
    assert len(deltas) == -(-codes // 16) and codes > 16  # the first audio came before the last code
    np.testing.assert_array_equal(np.concatenate(deltas, axis=-1), clip.samples)
    assert [d.shape[-1] for d in deltas] == [16 * 64] * (len(deltas) - 1) + [
        clip.num_samples - (len(deltas) - 1) * 16 * 64
    ]


@pytest.mark.integration
def test_bad_params_are_typed_errors_before_anything_runs(omni: Any) -> None:
    for stage, params, field in (
        (1, {"max_codes": 0}, "max_codes"),
        (2, {"speed": 9.0}, "speed"),
        (2, {"voice": "nobody"}, "voice"),
        (0, {"max_codes": 4}, "max_codes"),  # a thinker has no codes
        (0, {"max_tokens": 8192}, "max_tokens"),  # the thinker's context is 8192 tokens, prompt included
    ):
        per_stage: list[Any] = [None, None, None]
        per_stage[stage] = params
        with pytest.raises(InvalidRequestError) as info:
            omni.generate("hi", per_stage, use_tqdm=False)
        assert info.value.param is not None and field in info.value.param


@pytest.mark.integration
def test_the_talkers_streamed_code_deltas_add_up_to_its_final_codes(runners: dict[str, Any]) -> None:
    asked = RunnerRequest("t", "hello there", thinker_params({"seed": 1, "max_tokens": 6}))
    thought, text_deltas = _run(runners["thinker"], asked)
    assert thought.error is None and "".join(d.text or "" for d in text_deltas) == thought.text
    assert set(THINKER_TENSORS) <= set(thought.tensors)
    talked = talker_params({"seed": 2, "max_codes": 10})
    request = RunnerRequest("k", thought.text, talked, inputs=dict(thought.tensors))
    talked, deltas = _run(runners["talker"], request)
    codes = talked.tensors[CODES]
    assert talked.error is None and 1 <= len(codes) <= 10 and codes.dtype == np.int64
    assert all(len(d.tensors[CODES]) == 1 for d in deltas)  # each delta holds only the new code
    np.testing.assert_array_equal(np.concatenate([d.tensors[CODES] for d in deltas]), codes)
    again, _ = _run(runners["talker"], request)
    np.testing.assert_array_equal(again.tensors[CODES], codes)


@pytest.mark.integration
def test_code2wav_of_a_chunk_equals_code2wav_of_its_codes_alone(runners: dict[str, Any]) -> None:
    codes = np.arange(24, dtype=np.int64) * 5 % 64
    params = {"seed": 3, "voice": "ethan"}

    def audio(inputs: dict[str, Any]) -> np.ndarray:
        out, _ = _run(runners["code2wav"], RunnerRequest("c", "", code2wav_params(params), inputs=inputs))
        assert out.error is None
        return np.asarray(out.media[0].data)

    whole = audio({CODES: codes})
    chunks = [audio({CODES: codes[i : i + 8], "chunk_index": i // 8, "last_chunk": i == 16}) for i in (0, 8, 16)]
    for i, chunk in enumerate(chunks):
        np.testing.assert_array_equal(chunk, audio({CODES: codes[8 * i : 8 * i + 8]}))
    # Chunks carry their share of the samples; their audio is not a slice of the whole's (the
    # decoder looks past a chunk's ends and each decode draws its own noise; docs/models.md).
    assert sum(c.shape[1] for c in chunks) == whole.shape[1]


@pytest.mark.integration
@given(
    codes=st.one_of(
        st.lists(st.integers(-(2**40), 2**40), max_size=5).map(lambda v: np.asarray(v, dtype=np.int64)),
        st.lists(st.floats(allow_nan=True), min_size=1, max_size=3).map(np.asarray),
        st.just(np.zeros((2, 2), dtype=np.int64)),
        st.just("codes"),
    ),
    chunk=st.one_of(st.none(), st.integers(-3, 3), st.booleans(), st.text(max_size=2)),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_hostile_codes_are_invalid_request_errors(runners: dict[str, Any], codes: Any, chunk: Any) -> None:
    inputs = {CODES: codes, "chunk_index": chunk}
    try:
        runners["code2wav"]._codes(RunnerRequest("h", "", code2wav_params({}), inputs=inputs))
    except InvalidRequestError as e:
        assert e.param in ("codes", "chunk_index")
        return
    accepted = np.asarray(codes)
    assert accepted.ndim == 1 and accepted.min() >= 0 and accepted.max() < 64
    assert chunk is None or (type(chunk) is int and chunk >= 0)


@pytest.mark.integration
def test_a_talker_without_a_thinkers_states_fails_alone(runners: dict[str, Any]) -> None:
    out, deltas = _run(runners["talker"], RunnerRequest("x", "hi", talker_params({}), inputs={}))
    assert isinstance(out.error, InvalidRequestError) and out.error.param == "inputs" and not deltas


@pytest.mark.integration
def test_an_aborted_talker_stops_streaming_and_fails_with_a_typed_error(runners: dict[str, Any]) -> None:
    thought, _ = _run(runners["thinker"], RunnerRequest("t2", "abc", thinker_params({"seed": 4, "max_tokens": 3})))
    deltas: list[RunnerOutput] = []
    ctx = ExecuteContext(is_aborted=lambda _: len(deltas) >= 3, emit=lambda _, out: deltas.append(out))
    request = RunnerRequest("a", "", talker_params({"seed": 1, "max_codes": 40}), inputs=dict(thought.tensors))
    (out,) = runners["talker"].execute([request], ctx)
    assert isinstance(out.error, RequestAbortedError) and len(deltas) == 3


@pytest.mark.integration
def test_a_thinker_reply_without_tokens_still_gives_codes(runners: dict[str, Any]) -> None:
    thought, _ = _run(runners["thinker"], RunnerRequest("t3", "abc", thinker_params({"seed": 4, "max_tokens": 3})))
    inputs = {**thought.tensors, REPLY_IDS: np.zeros(0, np.int64), REPLY_STATES: np.zeros((0, 64), np.float32)}
    request = RunnerRequest("e", "", talker_params({"seed": 1, "max_codes": 4}), inputs=inputs)
    out, deltas = _run(runners["talker"], request)
    assert out.error is None and 1 <= len(out.tensors[CODES]) <= 4 and len(deltas) == len(out.tensors[CODES])


@pytest.mark.integration
def test_a_talker_asked_for_more_codes_than_its_decoder_takes_is_refused_before_it_is_queued(omni: Any) -> None:
    engine = omni.engine
    reported = engine.constraints()
    assert reported[2].max_input_codes == 2048  # the decoder's 4096 DiT positions / 2 repeats
    # The bundled config decodes the codes 16 at a time: the decoder bounds no request's max_codes.
    assert reported[1].max_codes is None
    assert omni._async.validate("hi", [None, {"max_codes": 4096}, None]).params[1]["max_codes"] == 4096
    # Handed on whole, the codes are bounded by the decoder, as the engine links what its stages
    # reported at start: a talker asked for more is refused in the caller's thread.
    thinker, talker, decoder = load_config("tiny-qwen-omni").stage_args
    whole = msgspec.structs.replace(decoder, input_chunking=None)
    linked = link_constraints([thinker, talker, whole], reported)
    kept = engine._orchestrator.constraints
    engine._orchestrator.constraints = linked
    try:
        with pytest.raises(InvalidRequestError) as info:
            omni.generate("hi", [None, {"max_codes": 2049}, None], use_tqdm=False)
        assert info.value.param == "max_codes" and "2048 codes stage 2 decodes at once" in str(info.value)
        assert omni._async.validate("hi").params[1]["max_codes"] == 48  # the stage's default, within it
    finally:
        engine._orchestrator.constraints = kept


@pytest.mark.integration
def test_the_talker_makes_at_most_max_codes_however_long_the_thinkers_reply(runners: dict[str, Any]) -> None:
    thought, _ = _run(runners["thinker"], RunnerRequest("t4", "abc", thinker_params({"seed": 4, "max_tokens": 3})))
    reply = np.asarray(thought.tensors[REPLY_STATES])
    long_reply = np.concatenate([reply] * 100) if len(reply) else np.zeros((300, 64), np.float32)
    inputs = {**thought.tensors, REPLY_STATES: long_reply, REPLY_IDS: np.zeros(len(long_reply), np.int64)}
    request = RunnerRequest("long", "", talker_params({"seed": 1, "max_codes": 5}), inputs=inputs)
    out, deltas = _run(runners["talker"], request)
    assert out.error is None and len(out.tensors[CODES]) <= 5 and len(deltas) == len(out.tensors[CODES])
