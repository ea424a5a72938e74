"""The one body parser (bounded nesting and number literals) and the strict fields of
``POST /v1/videos``: in process, no server."""

from __future__ import annotations

import re

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_runtime.entrypoints.openai.body import MAX_NUMBER_CHARS, parse_json
from omni_runtime.entrypoints.openai.protocol import MAX_SECONDS, ApiError, VideoCreateRequest
from pydantic import ValidationError

from omni_runtime.bounds import MAX_SIDE, MIN_SIDE
from omni_runtime.serialization import MAX_DEPTH

pytestmark = pytest.mark.unit


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_nesting_and_numbers_are_bounded() -> None:
    assert parse_json(nested(MAX_DEPTH)) is not None
    for raw in (nested(MAX_DEPTH + 1), nested(5000), b'{"a": ' + nested(100_000) + b"}"):
        with pytest.raises(ApiError) as err:
            parse_json(raw)
        assert (err.value.status, err.value.code) == (400, "invalid_json")
    assert parse_json(b"9" * MAX_NUMBER_CHARS) == int("9" * MAX_NUMBER_CHARS)
    for raw in (b"9" * 5000, b"-" + b"9" * MAX_NUMBER_CHARS, b"0." + b"5" * 5000):
        with pytest.raises(ApiError):
            parse_json(raw)
    with pytest.raises(RequestValidationError):
        parse_json(b'{"a": ')


def accepted(field: str, value: object) -> bool:
    try:
        VideoCreateRequest.model_validate({"prompt": "x", field: value})
    except ValidationError as e:
        assert e.errors()[0]["loc"][0] == field
        return False
    return True


_SIZE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})", re.ASCII)
_SECONDS = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6})?", re.ASCII)
sizes = st.one_of(
    st.text(alphabet="0123456789xX \uff10\uff11\u0661_+-.", max_size=12),
    st.builds("{}x{}".format, st.integers(0, 5000), st.integers(0, 5000)),
)
seconds = st.one_of(
    st.text(alphabet="0123456789.\u0661\u0966_ +-eE", max_size=10), st.from_regex(_SECONDS, fullmatch=True)
)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(size=sizes, secs=seconds)
def test_size_and_seconds_are_ascii_and_exact(size: str, secs: str) -> None:
    m = _SIZE.fullmatch(size)
    assert accepted("size", size) == (size == "auto" or (m is not None and all(
        MIN_SIDE <= int(side) <= MAX_SIDE for side in m.groups())))  # fmt: skip
    assert accepted("seconds", secs) == (_SECONDS.fullmatch(secs) is not None and 0 < float(secs) <= MAX_SECONDS)


@settings(max_examples=50, deadline=None, database=None, derandomize=True)
@given(
    field=st.sampled_from(["num_frames", "fps", "slo_ms", "seed", "priority", "timeout", "num_inference_steps"]),
    value=st.booleans(),
)
def test_a_boolean_is_no_number(field: str, value: bool) -> None:
    assert not accepted(field, value)
    assert accepted(field, 1) or field == "num_frames"  # a number is taken (1 frame is no video length)
