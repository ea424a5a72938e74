"""Log messages are bounded whatever library logs them (omni_runtime/logs.py)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_runtime.logs import MAX_MESSAGE_CHARS, BoundedLogRecord, bound_log_messages


@pytest.fixture
def bounded():
    factory = logging.getLogRecordFactory()
    bound_log_messages()
    yield
    logging.setLogRecordFactory(factory)


def test_a_long_message_from_any_logger_is_cut_and_says_its_length(bounded, caplog):
    prompt = "lighthouse " * 10_000
    with caplog.at_level(logging.WARNING):
        logging.getLogger("diffusers.pipelines.some_pipeline").warning("truncated: %s", prompt)
    (record,) = caplog.records
    assert isinstance(record, BoundedLogRecord)
    message = record.getMessage()
    assert len(message) < MAX_MESSAGE_CHARS + 60
    assert message.endswith(f"[{len('truncated: ') + len(prompt)} characters, cut]")


@given(st.text(max_size=2 * MAX_MESSAGE_CHARS))
def test_messages_are_kept_whole_up_to_the_bound_and_cut_past_it(text):
    record = BoundedLogRecord("x", logging.INFO, __file__, 1, "%s", (text,), None)
    message = record.getMessage()
    if len(text) <= MAX_MESSAGE_CHARS:
        assert message == text
    else:
        assert message.startswith(text[:MAX_MESSAGE_CHARS]) and message.endswith(f"[{len(text)} characters, cut]")
