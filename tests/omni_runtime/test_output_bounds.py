"""Output lengths bounded before a request is queued: a text stage's ``max_tokens`` against its
model's context and ``engine_args.max_output_tokens`` (the prompt's share counted from its bytes),
and a Qwen-Omni talker's ``max_codes`` against what the decoder it feeds takes. Pure checks, no
model: what each stage reports at READY is written out here."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.config import InputChunking, StageConfig, load_config
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints, TextBound
from omni_runtime.params import (
    DEFAULT_MAX_CODES,
    DEFAULT_MAX_TOKENS,
    DiffusionSamplingParams,
    TalkerSamplingParams,
    TextSamplingParams,
    bounded_defaults,
    check_constraints,
    check_prompt_tokens,
    check_text_length,
    link_constraints,
    resolve_params,
)

pytestmark = pytest.mark.unit

#: What tiny-lm's text stage reports: a byte-level BPE whose longest token is 4 bytes.
TINY_LM = TextBound(context=16_384, bytes_per_token=4, normalization="NFC", special_tokens=("<|endoftext|>", "<|pad|>"))


def refusal(prompt: str, params: dict, bound: TextBound) -> InvalidRequestError | None:
    """The error of the caller's checks of a text stage's request (the validate path), or None."""
    constraints = StageConstraints(text=bound)
    fields = resolve_params(TextSamplingParams, bounded_defaults(TextSamplingParams, {}, constraints), params)
    try:
        check_constraints(fields, constraints)
        check_text_length(prompt, fields, constraints)
    except InvalidRequestError as e:
        return e
    return None


# --------------------------------------------------------------------------- text


def test_the_fewest_tokens_count_bytes_specials_and_normalization() -> None:
    assert TINY_LM.fewest_tokens("") == 1  # an empty prompt is one token
    assert TINY_LM.fewest_tokens("a" * 9) == 3
    assert TINY_LM.fewest_tokens("é" * 4) == 2  # 8 bytes
    # A special token is one token of its 13 bytes wherever it is: the bound takes it so.
    assert TINY_LM.fewest_tokens("<|endoftext|>" * 50) == 1
    # NFC joins u + two combining marks (5 bytes) into one character of 2 bytes.
    assert TINY_LM.fewest_tokens("u\u0308\u0301" * 8) == 4
    assert TextBound(context=8).fewest_tokens("anything") is None  # not a byte-level tokenizer
    assert TextBound(bytes_per_token=4, extra_tokens=2).fewest_tokens("abcd") == 3


def test_max_tokens_past_the_operators_cap_is_refused_naming_it() -> None:
    capped = msgspec.structs.replace(TINY_LM, max_tokens=256)
    error = refusal("hi", {"max_tokens": 257}, capped)
    assert error is not None and error.param == "max_tokens"
    assert "256" in str(error) and "engine_args.max_output_tokens" in str(error)
    assert refusal("hi", {"max_tokens": 256}, capped) is None


def test_max_tokens_no_prompt_can_leave_room_for_is_refused() -> None:
    small = TextBound(context=100)  # no bound from the text: only the shortest prompt counts
    error = refusal("hi", {"max_tokens": 100}, small)
    assert error is not None and error.param == "max_tokens" and "at most 99 tokens" in str(error)
    assert refusal("x" * 10_000, {"max_tokens": 99}, small) is None  # the stage counts this prompt


def test_a_prompt_that_cannot_fit_is_refused_and_one_that_may_fit_is_not() -> None:
    # 40,000 ASCII bytes are at least 10,000 tokens: 8,000 more cannot follow in 16,384.
    error = refusal("a" * 40_000, {"max_tokens": 8000}, TINY_LM)
    assert error is not None and error.param == "max_tokens"
    assert "at least 10000 tokens" in str(error) and "at most 6384 tokens" in str(error)
    assert refusal("a" * 40_000, {"max_tokens": 6384}, TINY_LM) is None
    # A prompt that leaves no room for one token is the prompt's fault, whatever max_tokens.
    error = refusal("a" * 70_000, {}, TINY_LM)
    assert error is not None and error.param == "prompt" and "shorten it" in str(error)


def test_the_default_max_tokens_keeps_within_the_cap_and_the_context() -> None:
    def default(bound: TextBound, stage_default: dict) -> int:
        return bounded_defaults(TextSamplingParams, stage_default, StageConstraints(text=bound))["max_tokens"]

    assert default(TINY_LM, {}) == DEFAULT_MAX_TOKENS
    assert default(TINY_LM, {"max_tokens": 16}) == 16
    assert default(msgspec.structs.replace(TINY_LM, max_tokens=8), {"max_tokens": 16}) == 8
    assert default(TextBound(context=10), {}) == 9
    # A stage that makes no text, or takes no max_tokens, keeps its defaults as they are.
    assert bounded_defaults(TextSamplingParams, {"top_k": 3}, StageConstraints()) == {"top_k": 3}
    assert bounded_defaults(DiffusionSamplingParams, {}, StageConstraints(text=TINY_LM)) == {}


@given(
    chars=st.integers(0, 80_000),
    max_tokens=st.integers(1, 8192),
    context=st.integers(1, 20_000),
    cap=st.one_of(st.none(), st.integers(1, 8192)),
    spread=st.floats(0, 1),
)
@settings(max_examples=400, deadline=None)
def test_refused_requests_cannot_fit_and_accepted_ones_fit_once_the_stage_counted(
    chars: int, max_tokens: int, context: int, cap: int | None, spread: float
) -> None:
    """Whatever a byte-level tokenizer makes of the prompt (from the fewest tokens its bytes allow
    to one a byte), a request refused before the queue could not have fitted and names
    ``max_tokens`` or the prompt; one accepted there and by the stage's exact count fits; and one
    that fits is never refused before the queue."""
    bound = TextBound(context=context, max_tokens=cap, bytes_per_token=4)
    prompt = "x" * chars
    fewest = bound.fewest_tokens(prompt)
    assert fewest is not None
    tokens = fewest + round(spread * (max(chars, 1) - fewest))  # what the tokenizer made of it

    def fits(n: int) -> bool:
        return n + max_tokens <= context and (cap is None or max_tokens <= cap)

    error = refusal(prompt, {"max_tokens": max_tokens}, bound)
    if error is not None:
        assert error.param in ("max_tokens", "prompt")
        assert not fits(fewest)  # no tokenization of it fits
        return
    try:
        check_prompt_tokens(tokens, max_tokens, bound, "the prompt")  # the stage's exact check
    except InvalidRequestError as e:
        assert e.param in ("max_tokens", "prompt") and not fits(tokens)
        return
    assert fits(tokens)


# --------------------------------------------------------------------------- the Qwen-Omni talker

#: The decoder of tiny-qwen-omni takes 2048 codes at once (4096 DiT positions / 2 repeats).
DECODER = StageConstraints(voices=("chelsie", "ethan"), max_input_codes=2048)


def stages(chunking: InputChunking | None = None, custom: str | None = None) -> list[StageConfig]:
    """The bundled tiny-qwen-omni stages with the decoder's hand-off as given."""
    thinker, talker, decoder = load_config("tiny-qwen-omni").stage_args
    decoder = msgspec.structs.replace(decoder, input_chunking=chunking, custom_process_input_func=custom)
    return [thinker, talker, decoder]


def linked(chunking: InputChunking | None = None, custom: str | None = None) -> dict[int, StageConstraints]:
    return link_constraints(stages(chunking, custom), {0: StageConstraints(), 1: StageConstraints(), 2: DECODER})


def test_a_decoder_taking_the_codes_whole_bounds_the_talkers_max_codes() -> None:
    talker = linked()[1]
    assert talker.max_codes == 2048
    check_constraints({"max_codes": 2048}, talker)
    with pytest.raises(InvalidRequestError) as info:
        check_constraints({"max_codes": 2049}, talker)
    assert info.value.param == "max_codes"
    assert "2048 codes stage 2 decodes at once" in str(info.value) and "input_chunking" in str(info.value)
    assert linked()[2] == DECODER and linked()[0].max_codes is None  # only the decoder's upstream


def test_chunks_the_decoder_takes_lift_the_bound_and_larger_ones_do_not() -> None:
    assert linked(InputChunking(policy="items", size=16))[1].max_codes is None
    assert linked(InputChunking(policy="items", size=16, first_size=2048))[1].max_codes is None
    assert linked(InputChunking(policy="items", size=4096))[1].max_codes == 2048
    assert linked(InputChunking(policy="items", size=16, first_size=2049))[1].max_codes == 2048
    # An input function may make anything of the codes: the decoder checks what it gets.
    assert linked(custom="omni_runtime.input_funcs:speak_text")[1].max_codes is None


def test_the_talkers_default_max_codes_keeps_within_the_decoders_bound() -> None:
    talker = StageConstraints(max_codes=40)
    assert bounded_defaults(TalkerSamplingParams, {"max_codes": 48}, talker) == {"max_codes": 40}
    assert bounded_defaults(TalkerSamplingParams, {}, talker) == {"max_codes": 40}
    assert bounded_defaults(TalkerSamplingParams, {}, linked()[1]) == {"max_codes": DEFAULT_MAX_CODES}
    # A default request passes; a request's own max_codes past the bound is refused.
    defaults = bounded_defaults(TalkerSamplingParams, {"max_codes": 48, "top_k": 40}, talker)
    check_constraints(resolve_params(TalkerSamplingParams, defaults, {"seed": 1}), talker)
    with pytest.raises(InvalidRequestError, match="max_codes"):
        check_constraints(resolve_params(TalkerSamplingParams, defaults, {"max_codes": 41}), talker)
