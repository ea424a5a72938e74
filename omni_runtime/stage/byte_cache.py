"""A least-recently-used map bounded by the bytes of its values: the store of the stage's caches
across requests (the diffusion runner's prompt embeddings, the worker's exact results).

Pure: the caller says what an entry weighs, so the same policy serves tensors on a device and
arrays in host memory, and is tested without either. Not thread-safe: each cache is used from one
thread (the prompt cache from the forward thread, the result cache from the worker's event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """At most ``max_bytes`` of values; past it the least recently used entries leave first.

    An entry larger than the whole bound is refused (it would only evict everything and then be
    evicted itself); ``max_bytes == 0`` refuses everything, so a cache that is off costs one
    comparison per request. :meth:`clear` is the invalidation: the counters survive it, so what
    ``/metrics`` counts keeps rising across a model change.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        #: Entries refused for being larger than the bound.
        self.refused = 0
        #: Times the cache was cleared because what its entries were made from changed.
        self.invalidations = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None; counted as a hit or a miss."""
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found[0]

    def put(self, key: K, value: V, nbytes: int) -> int | None:
        """Store ``value`` (``nbytes`` of it) under ``key``, replacing any value it had, and evict
        the least recently used others until the total fits. Returns how many entries it evicted,
        or None if the value was refused (larger than the bound; the cache is left as it was)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes > self.max_bytes or not self.enabled:
            self.refused += 1
            return None
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        evicted = 0
        while self._entries and self._bytes + nbytes > self.max_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self._bytes -= size
            evicted += 1
        self._entries[key] = (value, nbytes)
        self._bytes += nbytes
        self.evictions += evicted
        return evicted

    def clear(self) -> int:
        """Drop every entry (an invalidation); returns how many there were."""
        dropped = len(self._entries)
        self._entries.clear()
        self._bytes = 0
        self.invalidations += 1
        return dropped

    def keys(self) -> list[K]:
        """The keys, least recently used first (what leaves next)."""
        return list(self._entries)

    def stats(self) -> dict[str, Any]:
        """What ``get_stats`` reports of this cache."""
        return {
            "max_bytes": self.max_bytes,
            "bytes": self._bytes,
            "entries": len(self._entries),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "refused": self.refused,
            "invalidations": self.invalidations,
        }
