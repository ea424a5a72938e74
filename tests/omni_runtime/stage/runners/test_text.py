"""TextRunner: per-row params in one batched decode, streaming, stop strings, abort, sleep."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import InvalidRequestError, RequestAbortedError, StageAsleepError
from omni_runtime.messages import StageConstraints, TextBound
from omni_runtime.params import TextSamplingParams, bounded_defaults, resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.text import TextRunner, _Row

PROMPTS = ["the cat sat on", "a much longer prompt, about the weather and other things", "", "日本語 🐍"]


def make_stage(**overrides: Any) -> StageConfig:
    return msgspec.convert(
        {
            "stage_id": 0,
            "stage_type": "text",
            "model": "builtin:tiny-lm",
            "final_output": True,
            "final_output_type": "text",
            **overrides,
        },
        StageConfig,
    )


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TextRunner]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_RUNTIME_CACHE", str(tmp_path_factory.mktemp("cache")))
        r = TextRunner(make_stage())
        r.load()
        yield r


class Recorder:
    """An ExecuteContext that records emitted deltas and aborts on a predicate."""

    def __init__(self, abort: Callable[[str, list[str]], bool] = lambda rid, deltas: False) -> None:
        self.deltas: dict[str, list[str]] = defaultdict(list)
        self.ctx = ExecuteContext(is_aborted=lambda rid: abort(rid, self.deltas[rid]), emit=self._emit)

    def _emit(self, rid: str, out: RunnerOutput) -> None:
        assert out.text and out.error is None
        self.deltas[rid].append(out.text)


def run(runner: TextRunner, specs: list[tuple[str, dict[str, Any]]], rec: Recorder | None = None) -> list[RunnerOutput]:
    batch = [RunnerRequest(request_id=f"r{i}", prompt=p, params=typed(params)) for i, (p, params) in enumerate(specs)]
    return runner.execute(batch, (rec or Recorder()).ctx)


def typed(params: dict[str, Any], defaults: dict[str, Any] | None = None) -> TextSamplingParams:
    """``params`` as the runner gets them: resolved (over ``defaults``, fallbacks filled in)."""
    return resolve_params(TextSamplingParams, defaults or {}, params)


def solo(runner: TextRunner, prompt: str, params: dict[str, Any]) -> RunnerOutput:
    return run(runner, [(prompt, params)])[0]


GREEDY = {"temperature": 0, "max_tokens": 16}


# --------------------------------------------------------------------------- pure logic


def make_row(**overrides: Any) -> _Row:
    """A row for the pure-logic tests: no model, no detokenizer."""
    fields = {
        "index": 0,
        "request_id": "r",
        "prompt_ids": [1],
        "max_tokens": 10,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "stop": [],
        "seed": 0,
        "generator": torch.Generator().manual_seed(0),
        "detok": None,
    }
    return _Row(**{**fields, **overrides})


def test_stop_string_split_across_deltas_is_held_back_then_cut() -> None:
    row = make_row(stop=["STOP"])
    row.add_text("abc S")
    assert (row.text, row.held, row.done) == ("abc S", 1, False)
    row.add_text("TO")
    assert (row.held, row.done) == (3, False)
    row.add_text("Pxyz")
    assert (row.text, row.done) == ("abc ", True)


def test_text_that_cannot_start_a_stop_string_is_not_held() -> None:
    row = make_row(stop=["xyz", "END"])
    row.add_text("abcx")
    assert row.held == 1
    row.add_text("a")
    assert (row.held, row.done) == (0, False)


def test_pick_respects_top_k_and_top_p() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    for params, allowed in (({"top_k": 1}, {1}), ({"top_k": 2}, {1, 2}), ({"top_p": 0.5}, {1})):
        row = make_row(**params)
        picks = {TextRunner._pick(logits.clone(), row) for _ in range(50)}
        assert picks == allowed, params
    assert TextRunner._pick(logits.clone(), make_row(temperature=0.0)) == 1


# --------------------------------------------------------------------------- with the tiny LM


def test_greedy_is_deterministic_and_reports_metrics(runner: TextRunner) -> None:
    a, b = solo(runner, PROMPTS[0], GREEDY), solo(runner, PROMPTS[0], GREEDY)
    assert a.error is None and a.text and a.text == b.text
    assert a.text.isprintable()
    assert set(a.metrics) == {"seed", "batch_size", "execution_ms", "prompt_tokens", "completion_tokens"}
    assert a.metrics["batch_size"] == 1
    assert a.metrics["prompt_tokens"] == len(runner.tokenizer(PROMPTS[0])["input_ids"])
    assert 1 <= a.metrics["completion_tokens"] <= 16


def test_seeds_reproduce_and_differ(runner: TextRunner) -> None:
    params = {"temperature": 1.0, "max_tokens": 16}
    a = solo(runner, PROMPTS[0], {**params, "seed": 1})
    assert a.text == solo(runner, PROMPTS[0], {**params, "seed": 1}).text
    assert a.text != solo(runner, PROMPTS[0], {**params, "seed": 2}).text
    # No seed: a fresh one is drawn and reported, and replaying it gives the same text.
    drawn = solo(runner, PROMPTS[0], params)
    assert isinstance(drawn.metrics["seed"], int)
    assert solo(runner, PROMPTS[0], {**params, "seed": drawn.metrics["seed"]}).text == drawn.text


def test_batched_rows_equal_their_solo_runs(runner: TextRunner) -> None:
    # Mixed params in one wave. Batched logits differ from solo ones by float round-off (~1e-5,
    # against gaps of ~0.1 between candidate tokens of this model), so the texts are expected equal.
    specs = [
        (PROMPTS[0], GREEDY),
        (PROMPTS[1], {"temperature": 1.0, "seed": 11, "max_tokens": 12}),
        (PROMPTS[2], {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 5, "max_tokens": 20}),
        (PROMPTS[3], {"temperature": 1.3, "seed": 5, "max_tokens": 8}),
    ]
    batched = run(runner, specs)
    for out, (prompt, params) in zip(batched, specs, strict=True):
        assert out.error is None and out.metrics["batch_size"] == len(specs)
        assert out.metrics["completion_tokens"] <= params["max_tokens"]
        assert out.text == solo(runner, prompt, params).text


def test_streamed_deltas_concatenate_to_the_final_text(runner: TextRunner) -> None:
    rec = Recorder()
    specs = [(p, {"temperature": 1.0, "seed": i, "max_tokens": 12}) for i, p in enumerate(PROMPTS)]
    outs = run(runner, specs, rec)
    for i, out in enumerate(outs):
        assert len(rec.deltas[f"r{i}"]) > 1
        assert "".join(rec.deltas[f"r{i}"]) == out.text


def test_stop_string_cuts_the_text_and_is_never_streamed(runner: TextRunner) -> None:
    full = solo(runner, PROMPTS[0], GREEDY).text
    assert len(full) > 9
    stop = full[6:9]
    rec = Recorder()
    out = run(runner, [(PROMPTS[0], {**GREEDY, "stop": ["never-there", stop]})], rec)[0]
    assert out.text == full[: full.find(stop)]
    assert "".join(rec.deltas["r0"]) == out.text
    assert out.metrics["completion_tokens"] < 16


def test_aborting_one_row_mid_generation(runner: TextRunner) -> None:
    rec = Recorder(abort=lambda rid, deltas: rid == "r1" and len(deltas) >= 3)
    params = {"temperature": 1.0, "seed": 3, "max_tokens": 16}
    specs = [(PROMPTS[0], params), (PROMPTS[1], params), (PROMPTS[2], GREEDY)]
    outs = run(runner, specs, rec)
    assert isinstance(outs[1].error, RequestAbortedError)
    assert outs[1].text == "".join(rec.deltas["r1"])
    assert 3 <= outs[1].metrics["completion_tokens"] < 16
    for i in (0, 2):
        assert outs[i].error is None
        assert outs[i].text == solo(runner, *specs[i]).text


def test_all_aborted_stops_before_any_step(runner: TextRunner) -> None:
    outs = run(runner, [(p, GREEDY) for p in PROMPTS[:2]], Recorder(abort=lambda rid, deltas: True))
    assert all(isinstance(o.error, RequestAbortedError) for o in outs)
    assert all(o.metrics["completion_tokens"] == 0 and o.text == "" for o in outs)


def test_a_bad_prompt_fails_alone(runner: TextRunner) -> None:
    outs = run(runner, [(PROMPTS[0], GREEDY), ({"not": "text"}, GREEDY)])  # type: ignore[list-item]
    assert outs[0].error is None and outs[0].text
    assert outs[1].error is not None and outs[1].error.param == "prompt"


def test_sleep_and_wake_up_round_trip(runner: TextRunner) -> None:
    before = solo(runner, PROMPTS[0], GREEDY).text
    assert runner.sleep() == {"released": True}
    assert runner.model is None
    assert isinstance(solo(runner, PROMPTS[0], GREEDY).error, StageAsleepError)
    runner.wake_up()
    assert solo(runner, PROMPTS[0], GREEDY).text == before


def test_loads_in_bfloat16(runner: TextRunner) -> None:
    # The `runner` fixture keeps its cache directory set for this module: the model is not rebuilt.
    r = TextRunner(make_stage(engine_args={"dtype": "bfloat16"}))
    r.load()
    assert r.model.dtype == torch.bfloat16
    out = solo(r, PROMPTS[0], {"temperature": 1.0, "seed": 0, "max_tokens": 8})
    assert out.error is None and out.text.isprintable() and out.metrics["completion_tokens"] <= 8


# --------------------------------------------------------------------------- output bounds

#: Pieces that stress the bound of a prompt's tokens from its bytes: the tokenizer's special
#: tokens, merges, what NFC joins (jamo, combining marks, one onto a special token's last byte),
#: what it leaves apart, and 4-byte characters.
_HARD_PIECES = (
    "<|endoftext|>", "<|pad|>", " the", "ing", "\u1100\u1161\u11a8", "u\u0308\u0301", ">\u0338", "\uff21", "\U0001d400",
)  # fmt: skip


def test_the_runner_reports_its_context_and_what_bounds_a_prompt(runner: TextRunner) -> None:
    bound = runner.constraints().text
    assert bound == TextBound(
        context=16_384,
        bytes_per_token=4,  # tiny-lm's longest merge: " the"
        normalization="NFC",
        special_tokens=("<|endoftext|>", "<|pad|>"),
        extra_tokens=0,
    )


#: Any character a prompt can hold: a lone surrogate (category Cs) is refused at the door, naming the
#: prompt, before any tokenizer sees it (the tokenizer itself raises on one).
_PROMPT_CHARS = st.characters(blacklist_categories=("Cs",))


@given(st.lists(st.one_of(_PROMPT_CHARS, st.sampled_from(_HARD_PIECES)), max_size=48).map("".join))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_fewest_tokens_never_exceed_what_the_tokenizer_makes(runner: TextRunner, prompt: str) -> None:
    """The caller refuses only what cannot fit: its count from the text is never above the stage's."""
    made = len(runner.tokenizer(prompt)["input_ids"]) or 1  # an empty prompt starts from one token
    fewest = runner.text_bound.fewest_tokens(prompt)
    assert fewest is not None and fewest <= made


def test_the_runner_keeps_to_the_cap_and_the_context_with_the_tokens_it_made(runner: TextRunner) -> None:
    capped = copy.copy(runner)
    capped.__dict__["text_bound"] = msgspec.structs.replace(runner.text_bound, max_tokens=4, context=64)
    with pytest.raises(InvalidRequestError, match=r"engine_args\.max_output_tokens") as info:
        capped._new_row(0, RunnerRequest("cap", "hi", typed({"max_tokens": 5})))
    assert info.value.param == "max_tokens"
    # The default a validated request gets is within the cap (the stage's, bounded at resolve).
    defaults = bounded_defaults(TextSamplingParams, {}, StageConstraints(text=capped.text_bound))
    assert capped._new_row(0, RunnerRequest("default", "hi", typed({}, defaults))).max_tokens == 4
    prompt = "the " * 60
    made = len(runner.tokenizer(prompt)["input_ids"])
    assert made < 64 < made + 4
    with pytest.raises(InvalidRequestError, match=f"at most {64 - made} tokens") as info:
        capped._new_row(0, RunnerRequest("long", prompt, typed({"max_tokens": 4})))
    assert info.value.param == "max_tokens"
