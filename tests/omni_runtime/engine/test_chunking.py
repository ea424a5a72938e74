"""Chunkers and ``input_chunking``: chunks in order, complete, ``last`` exact; the join of chunk
outputs; every hostile chunk policy in a YAML a ConfigError naming its path, never a crash."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.config import InputChunking, parse_config
from omni_runtime.engine.chunking import Chunker, join_outputs
from omni_runtime.exceptions import ConfigError
from omni_runtime.media import AudioItem
from omni_runtime.messages import Payload, StageMetrics
from tests.strategies import ANY_TEXT, JSON_VALUES

pytestmark = pytest.mark.unit

WORDS = st.lists(
    st.one_of(st.sampled_from([".", "!", "?", ",", " ", "\n", ";"]), st.text("ab1 ", min_size=1, max_size=6), ANY_TEXT),
    max_size=40,
)


def run(policy: InputChunking, deltas: list[str]):
    chunker = Chunker(policy)
    chunks = [c for d in deltas for c in chunker.feed(d)]
    return chunks + chunker.finish()


@settings(max_examples=200, deadline=None, database=None)
@given(
    deltas=WORDS,
    policy=st.sampled_from(["sentence", "tokens"]),
    size=st.integers(1, 6),
    first=st.one_of(st.none(), st.integers(1, 6)),
)
def test_text_chunks_are_in_order_complete_and_only_the_last_says_so(deltas, policy, size, first):
    chunks = run(InputChunking(policy=policy, size=size, first_size=first), deltas)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text or "" for c in chunks) == "".join(deltas)
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    # Every chunk but a lone last one has something to speak.
    if len(chunks) > 1:
        assert all(any(ch.isalnum() for ch in c.text or "") for c in chunks)


def test_sentences_go_as_they_end_and_long_ones_are_cut_by_words():
    chunker = Chunker(InputChunking(policy="sentence", size=3))
    out = []
    for delta in ["Hi", " there.", " One", " two", " three", " four", "!"]:
        out += chunker.feed(delta)
    # "Hi there. " goes once something follows it; three words make a chunk without a full stop.
    assert [c.text for c in out] == ["Hi there. ", "One two three "]
    assert [(c.text, c.last) for c in chunker.finish()] == [("four!", True)]


def test_a_small_first_chunk_goes_first_then_chunks_of_size():
    chunker = Chunker(InputChunking(policy="sentence", size=4, first_size=2))
    out = []
    for delta in ["One", " two", " three", " four", " five", " six", " seven", " eight"]:
        out += chunker.feed(delta)
    assert [c.text for c in out] == ["One two ", "three four five six "]
    assert [(c.text, c.last) for c in chunker.finish()] == [("seven eight", True)]


def test_a_cut_waits_for_what_follows_it_so_last_is_exact():
    chunker = Chunker(InputChunking(policy="tokens", size=2))
    assert chunker.feed("a") == [] and chunker.feed("b") == []  # cut, held: it may be the last
    assert [(c.text, c.last) for c in chunker.feed(" c")] == [("ab", False)]
    assert [(c.text, c.last) for c in chunker.finish()] == [(" c", True)]
    chunker = Chunker(InputChunking(policy="tokens", size=1))
    chunker.feed("x")
    assert [(c.text, c.last) for c in chunker.finish()] == [("x", True)]  # no empty chunk after it
    assert [(c.text, c.last) for c in Chunker(InputChunking(policy="sentence")).finish()] == [("", True)]


@settings(max_examples=100, deadline=None, database=None)
@given(
    lengths=st.lists(st.integers(0, 7), max_size=12),
    size=st.integers(1, 5),
    first=st.one_of(st.none(), st.integers(1, 5)),
)
def test_item_chunks_cut_every_array_along_the_first_axis(lengths, size, first):
    chunker = Chunker(InputChunking(policy="items", size=size, first_size=first))
    start, chunks = 0, []
    for n in lengths:  # deltas: only the new items, as a streaming upstream sends them
        codes = np.arange(start, start + n)
        chunks += chunker.feed(tensors={"codes": codes, "mask": codes[:, None] * 2})
        start += n
    chunks += chunker.finish()
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    # The first chunk is first_size items (size when unset), every later one but the last size.
    expected = [first or size] + [size] * (len(chunks) - 2)
    assert [len(c.tensors["codes"]) for c in chunks[:-1]] == expected[: len(chunks) - 1]
    if start:
        got = np.concatenate([c.tensors["codes"] for c in chunks])
        np.testing.assert_array_equal(got, np.arange(start))
        np.testing.assert_array_equal(np.concatenate([c.tensors["mask"] for c in chunks])[:, 0], 2 * np.arange(start))


def test_the_join_of_chunk_outputs_is_their_concatenation():
    def clip(*values: float) -> AudioItem:
        return AudioItem(data=np.array([values], dtype=np.float32), sample_rate=16_000, seed=5)

    pieces = [
        Payload(media=[clip(1, 2)], tensors={"t": np.zeros((2, 3))}, metrics=StageMetrics(execution_ms=1.0)),
        Payload(media=[clip(3)], tensors={"t": np.ones((1, 3))}, metrics=StageMetrics(execution_ms=2.0)),
    ]
    whole = join_outputs(pieces)
    assert len(whole.media) == 1 and isinstance(whole.media[0], AudioItem)
    np.testing.assert_array_equal(whole.media[0].samples, [[1, 2, 3]])
    assert whole.tensors["t"].shape == (3, 3) and whole.metrics.execution_ms == 3.0
    assert whole.metrics.extra["chunks"] == 2 and whole.text is None
    scalars = join_outputs([Payload(tensors={"chunk_index": np.int64(i)}) for i in range(3)])
    assert scalars.tensors["chunk_index"] == 2  # not an array of items: the last chunk's


TEXT = {
    "stage_id": 0,
    "stage_type": "text",
    "model": "builtin:tiny-lm",
    "final_output": True,
    "final_output_type": "text",
}


def speech(**kw):
    return {
        "stage_id": 1,
        "stage_type": "speech",
        "model": "builtin:tiny-tts",
        "engine_input_source": [0],
        "final_output": True,
        "final_output_type": "audio",
        **kw,
    }


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "deploy.yaml")
    return str(info.value)


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        (
            [TEXT, speech(input_chunking={"policy": "paragraph"})],
            "deploy.yaml: stage_args[1].input_chunking.policy: Invalid enum value 'paragraph'",
        ),
        ([TEXT, speech(input_chunking={"policy": "tokens", "size": 0})], "stage_args[1].input_chunking.size"),
        ([TEXT, speech(input_chunking={"policy": "tokens", "size": 10**9})], "stage_args[1].input_chunking.size"),
        (
            [TEXT, speech(input_chunking={"policy": "items", "max_buffered": 0})],
            "stage_args[1].input_chunking.max_buffered",
        ),
        ([TEXT, speech(input_chunking={"policy": "items", "speed": 2})], "stage_args[1].input_chunking.speed"),
        (
            [{**TEXT, "input_chunking": {"policy": "sentence"}}, speech()],
            "stage_args[0].input_chunking: input_chunking needs exactly one upstream stage",
        ),
        (
            [
                {**speech(), "stage_id": 0, "engine_input_source": []},
                speech(input_chunking={"policy": "sentence"}),
            ],
            "stage_args[1].input_chunking: input_chunking: the upstream stage 0 (speech) does not stream",
        ),
        (
            [TEXT, {**TEXT, "stage_id": 2}, speech(engine_input_source=[0, 2], input_chunking={"policy": "sentence"})],
            "stage_args[2].input_chunking: input_chunking needs exactly one upstream stage",
        ),
    ],
)
def test_bad_chunk_policies_name_their_yaml_path(stages, expected):
    assert expected in error_of({"stage_args": stages})


def test_a_chunked_stage_after_a_chunked_stage_is_accepted():
    chained = [TEXT, speech(input_chunking={"policy": "sentence"}), speech(stage_id=2, engine_input_source=[1])]
    chained[2]["input_chunking"] = {"policy": "items", "size": 4}
    config = parse_config({"stage_args": chained})
    assert config.stage(2).input_chunking == InputChunking(policy="items", size=4)


@settings(max_examples=150, deadline=None, database=None)
@given(value=st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(["policy", "size", "max_buffered"]), JSON_VALUES)))
def test_hostile_chunk_policies_are_config_errors(value):
    try:
        config = parse_config({"stage_args": [TEXT, speech(input_chunking=value)]}, "deploy.yaml")
    except ConfigError as e:
        assert "stage_args[1]" in str(e)
    else:  # what is accepted is a policy the chunker runs
        chunking = config.stage(1).input_chunking
        assert chunking is None or run(chunking, ["a b. ", "c"])[-1].last
