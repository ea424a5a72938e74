"""Hypothesis strategies for hostile input, shared by the property-based tests."""

from __future__ import annotations

from hypothesis import strategies as st

#: Lone surrogates: valid in a Python str (and in JSON as ``\ud800``), impossible in UTF-8.
SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
#: Any character, lone surrogates included often enough to matter.
ANY_CHAR = st.one_of(st.characters(), SURROGATES)
ANY_TEXT = st.text(ANY_CHAR, max_size=24)
#: Integers around and far past what msgpack can carry.
EDGE_INTS = st.sampled_from(
    [0, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, -(10**30)]
)
ANY_INT = st.one_of(st.integers(), EDGE_INTS)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
JSON_LEAVES = st.one_of(st.none(), st.booleans(), ANY_INT, ANY_FLOAT, ANY_TEXT)
#: Arbitrary JSON-like values: what a decoded body, YAML document or RPC argument can hold.
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(ANY_TEXT, inner, max_size=4)),
    max_leaves=12,
)
