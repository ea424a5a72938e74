"""Typed errors survive the wire: every class in ERROR_TYPES, whatever its constructor takes."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_runtime.exceptions import ERROR_TYPES, OmniError, QueueFullError, RequestError
from omni_runtime.messages import ErrorInfo, StageOutput
from omni_runtime.serialization import Encoder, outbound_decoder
from tests.strategies import ANY_TEXT


def _instance(cls: type[OmniError], message: str, param: str | None, stage_id: int | None) -> OmniError:
    if issubclass(cls, RequestError):
        return cls(message, param=param, stage_id=stage_id)
    return cls(message)


@pytest.mark.parametrize("name", sorted(ERROR_TYPES))
@given(message=ANY_TEXT, param=st.none() | ANY_TEXT, stage_id=st.none() | st.integers(0, 2**31))
def test_every_error_type_round_trips_over_a_stage_socket(name, message, param, stage_id):
    cls = ERROR_TYPES[name]
    original = _instance(cls, message, param, stage_id)
    info = ErrorInfo.from_exception(original)
    frames = Encoder().encode(StageOutput(request_id="r", error=info))  # encodable, surrogates and all
    decoded = outbound_decoder().decode([bytes(f) for f in frames]).error
    again = decoded.to_exception()
    assert type(again) is cls
    assert isinstance(again, OmniError)
    assert str(again) == msgspec.msgpack.decode(msgspec.msgpack.encode(info.message))
    if issubclass(cls, RequestError):
        assert again.stage_id == stage_id
        expected = None if param is None else info.param
        assert again.param == expected


def test_queue_full_from_a_stage_keeps_its_type_and_retry_hint():
    """The defect: QueueFullError(msg, param=...) raised TypeError, so the request never ended."""
    info = ErrorInfo(type="QueueFullError", message="4096 requests already wait", param=None, stage_id=2)
    err = info.to_exception()
    assert isinstance(err, QueueFullError) and err.stage_id == 2 and err.retry_after_s == 1.0
    assert QueueFullError("full", param="n", stage_id=1, retry_after_s=3).retry_after_s == 3


@given(retry=st.floats(allow_nan=True, allow_infinity=True) | st.integers() | st.booleans() | st.text(max_size=3))
def test_a_stage_s_retry_hint_crosses_the_socket_when_it_is_a_sane_number(retry):
    """A request shed for its latency target says when its backlog clears; the hint reached the
    client as the default 1 s before it travelled with the error."""
    exc = QueueFullError("shed", retry_after_s=1.0)
    exc.retry_after_s = retry
    info = msgspec.msgpack.decode(msgspec.msgpack.encode(ErrorInfo.from_exception(exc, 0)), type=ErrorInfo)
    sane = not isinstance(retry, bool) and isinstance(retry, int | float) and 0 <= retry < 1e9
    assert info.to_exception().retry_after_s == (float(retry) if sane else 1.0)


@given(name=st.text(max_size=20))
def test_an_unknown_error_name_becomes_an_execution_error(name):
    err = ErrorInfo(type=name, message="m").to_exception()
    assert isinstance(err, OmniError)
    if name not in ERROR_TYPES:
        assert type(err).__name__ == "StageExecutionError"
