"""The input functions of deploy YAMLs, called as the orchestrator calls them."""

from __future__ import annotations

import pytest

from omni_runtime.input_funcs import prompt_then_transcript, speak_or_pause, speak_text

pytestmark = pytest.mark.unit


def test_speak_text_speaks_the_answer_on_one_line():
    upstream = {0: {"text": " the sea\nis  calm ", "images": [], "tensors": {}}}
    assert speak_text("say something", upstream) == {"prompt": "the sea is calm"}


def test_speak_text_joins_text_stages_in_order():
    upstream = {1: {"text": "second"}, 0: {"text": "first"}}
    assert speak_text("q", upstream) == {"prompt": "first second"}


@pytest.mark.parametrize("answer", ["", "   ", "?! ...", None])
def test_an_answer_with_nothing_to_say_speaks_the_prompt(answer):
    assert speak_text(" say something ", {0: {"text": answer}}) == {"prompt": "say something"}


def test_the_transcript_follows_the_callers_prompt_and_no_audio_leaves_the_prompt_alone():
    heard = {0: {"text": " what is\nthe time "}}
    assert prompt_then_transcript("Be brief.", heard) == {"prompt": "Be brief.\n\nwhat is the time"}
    assert prompt_then_transcript("", heard) == {"prompt": "what is the time"}  # a spoken turn, no instructions
    assert prompt_then_transcript("hello", {0: {"text": ""}}) == {"prompt": "hello"}  # a text turn


@pytest.mark.parametrize("answer", ["", "  ", "{@}", "?!"])
def test_a_chunk_with_nothing_to_say_is_a_pause_never_the_prompt(answer):
    assert speak_or_pause("Be brief.", {1: {"text": answer}}) == {"prompt": ","}
    assert speak_or_pause("", {1: {"text": " the\nsea "}}) == {"prompt": "the sea"}
