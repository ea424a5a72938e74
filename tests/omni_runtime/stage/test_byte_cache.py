"""The byte-bounded LRU under the stage's caches: the bound holds after every put, the least
recently used leave first (a read counts as a use), an entry larger than the bound is refused
without touching the others, and a clear drops everything but the counters."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_runtime.stage.byte_cache import ByteLRU

pytestmark = pytest.mark.unit


def test_least_recently_used_leave_first_and_a_read_is_a_use() -> None:
    lru: ByteLRU[str, str] = ByteLRU(10)
    assert lru.put("a", "A", 4) == 0 and lru.put("b", "B", 4) == 0
    assert lru.get("a") == "A"  # now b is the least recently used
    assert lru.put("c", "C", 4) == 1
    assert lru.keys() == ["a", "c"] and lru.bytes == 8
    assert lru.get("b") is None
    assert (lru.hits, lru.misses, lru.evictions) == (1, 1, 1)


def test_one_put_evicts_as_many_as_it_needs_room_for() -> None:
    lru: ByteLRU[int, int] = ByteLRU(10)
    for key in range(5):
        lru.put(key, key, 2)
    assert lru.put(9, 9, 9) == 5
    assert lru.keys() == [9] and lru.bytes == 9 and lru.evictions == 5


def test_replacing_a_key_frees_its_old_bytes_first() -> None:
    lru: ByteLRU[str, str] = ByteLRU(10)
    lru.put("a", "old", 6)
    lru.put("b", "B", 4)
    assert lru.put("a", "new", 5) == 0  # 4 + 5 fits once the old 6 are gone
    assert lru.get("a") == "new" and lru.bytes == 9 and len(lru) == 2


def test_an_entry_larger_than_the_bound_is_refused_and_the_rest_stays() -> None:
    lru: ByteLRU[str, str] = ByteLRU(10)
    lru.put("a", "A", 10)  # exactly the bound fits
    assert lru.put("big", "B", 11) is None
    assert lru.keys() == ["a"] and lru.bytes == 10 and lru.refused == 1 and lru.evictions == 0


def test_a_bound_of_zero_stores_nothing() -> None:
    lru: ByteLRU[str, str] = ByteLRU(0)
    assert not lru.enabled
    assert lru.put("a", "A", 0) is None and len(lru) == 0
    with pytest.raises(ValueError):
        ByteLRU(-1)
    with pytest.raises(ValueError):
        ByteLRU(1).put("a", "A", -1)


def test_clear_is_an_invalidation_that_keeps_the_counters() -> None:
    lru: ByteLRU[str, str] = ByteLRU(10)
    lru.put("a", "A", 3)
    lru.get("a")
    lru.get("x")
    assert lru.clear() == 1
    assert len(lru) == 0 and lru.bytes == 0 and "a" not in lru
    assert lru.stats() == {
        "max_bytes": 10,
        "bytes": 0,
        "entries": 0,
        "hits": 1,
        "misses": 1,
        "evictions": 0,
        "refused": 0,
        "invalidations": 1,
    }


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 12), st.booleans()), max_size=60))
def test_the_bound_holds_and_the_order_is_recency(ops: list[tuple[int, int, bool]]) -> None:
    """Against a model: a plain list of (key, size) in recency order, trimmed from the front."""
    lru: ByteLRU[int, int] = ByteLRU(10)
    model: list[tuple[int, int]] = []
    for key, size, read in ops:
        if read:
            found = lru.get(key)
            held = [k for k, _ in model]
            assert (found is not None) == (key in held)
            if key in held:
                model.append(model.pop(held.index(key)))
            continue
        result = lru.put(key, key, size)
        if size > 10:
            assert result is None
            continue
        model = [(k, s) for k, s in model if k != key]
        evicted = 0
        while model and sum(s for _, s in model) + size > 10:
            model.pop(0)
            evicted += 1
        model.append((key, size))
        assert result == evicted
        assert lru.keys() == [k for k, _ in model]
        assert lru.bytes == sum(s for _, s in model) <= 10
