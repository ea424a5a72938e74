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


def test_a_long_message_from_any_logger_keeps_its_ends_and_says_what_was_cut(bounded, caplog):
    prompt = " ".join(f"w{i:05d}" for i in range(10_000))
    with caplog.at_level(logging.WARNING):
        logging.getLogger("diffusers.pipelines.some_pipeline").warning("truncated: %s", prompt)
    (record,) = caplog.records
    assert isinstance(record, BoundedLogRecord)
    message = record.getMessage()
    assert len(message) < MAX_MESSAGE_CHARS + 60
    assert message.startswith("truncated: w00000") and message.endswith("w09999")  # a traceback's last line stays
    assert "w05000" not in message
    assert f"[... {len('truncated: ') + len(prompt) - MAX_MESSAGE_CHARS} characters cut ...]" in message


@given(st.text(max_size=2 * MAX_MESSAGE_CHARS + 10))
def test_messages_are_kept_whole_up_to_the_bound_and_cut_in_the_middle_past_it(text):
    record = BoundedLogRecord("x", logging.INFO, __file__, 1, "%s", (text,), None)
    message = record.getMessage()
    half = MAX_MESSAGE_CHARS // 2
    if len(text) <= MAX_MESSAGE_CHARS:
        assert message == text
    else:
        assert message.startswith(text[:half]) and message.endswith(text[-half:])
        assert f"[... {len(text) - 2 * half} characters cut ...]" in message
