"""``slo_ms``, a request's latency target: one bound for the engine's params (msgspec) and every
HTTP route that takes it (pydantic), whatever value a client sends."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from omni_runtime.entrypoints.openai import protocol
from pydantic import ValidationError

from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.params import DiffusionSamplingParams, TextSamplingParams, resolve_params
from tests.strategies import ANY_TEXT

pytestmark = pytest.mark.unit

HOSTILE = st.one_of(
    st.none(),
    st.floats(),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.text(max_size=8),
    ANY_TEXT,  # lone surrogates: msgspec itself raises UnicodeEncodeError on them
    st.lists(st.integers(), max_size=2),
    st.sampled_from([0, 0.0, -0.0, 3_600_000, 3_600_000.5, math.nan, math.inf, "100", 1e-300]),
)


def _valid(value: object) -> bool:
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0 < value <= 3_600_000


def _http_bodies(value: object) -> list[tuple[type, dict]]:
    return [
        (protocol.ImageGenerationRequest, {"prompt": "x", "slo_ms": value}),
        (protocol.VideoCreateRequest, {"prompt": "x", "slo_ms": value}),
        (protocol.GenerateConfig, {"slo_ms": value}),
    ]


@given(value=HOSTILE)
def test_slo_ms_is_taken_exactly_within_its_bounds_everywhere(value: object) -> None:
    # The engine's entry (resolve_params), not msgspec.convert: that raises UnicodeEncodeError on a
    # lone surrogate, which resolve_params turns into the typed error naming the field.
    for params_cls in (DiffusionSamplingParams, TextSamplingParams):
        try:
            got = resolve_params(params_cls, {}, {"slo_ms": value}).slo_ms
        except InvalidRequestError as e:
            assert not _valid(value) and e.param == "slo_ms"
        else:
            assert got is None or 0 < got <= 3_600_000
            # Lax, as a request's params are read: numeric text is taken as its number, then bounded.
            assert got == value if _valid(value) else isinstance(value, str)
    for model, body in _http_bodies(value):
        try:
            got_http = model.model_validate(body)
        except ValidationError as e:
            # pydantic (lax) reads a numeric string as a number; the engine then holds it to the bound.
            assert not _valid(value) or isinstance(value, str)
            assert "slo_ms" in str(e)
        else:
            assert got_http.slo_ms is None or 0 < got_http.slo_ms <= 3_600_000
