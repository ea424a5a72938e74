"""The input functions of deploy YAMLs, called as the orchestrator calls them."""

from __future__ import annotations

import pytest

from omni_runtime.input_funcs import speak_text

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
