"""What a bigger batch costs on this replica: a learned model of a forward's (or a step's) time
against its batch size, per compatibility key. Pure: no clock, no I/O; the executors feed it the
measured time and size of every wave or step, and the schedulers read it.

The model is ``t(n) = fixed + per_item * n``. On a GPU ``fixed`` dominates (a batch of 4 costs little
more than 1) and batching pays; on a CPU whose cores one request already fills, ``fixed`` is near 0
and a fused forward costs what its requests cost one by one, so any wait to fill a wave is latency
bought for nothing.

How it is fitted, and why. Each key keeps an exponentially weighted mean of the measured time *per
observed batch size* (at most one point per size, so a bounded table of ``max_num_seqs`` entries),
and the line is the least-squares fit through those points, each weighted by how many samples it
has seen (capped, so a size seen a thousand times does not drown out the others). A plain window of
recent samples would forget: once the model caps waves at one request, every new sample has n = 1,
the window would soon hold one size only, the line would become unknowable, and the policy would
flip back and forth. The per-size means keep what was learned at other sizes, and the EWMA still
follows drift (a warmed-up cache, a busier machine). The fit is made monotone: a negative intercept
(a superlinear curve, or noise) is clamped to 0 and the slope refitted through the origin, and a
negative slope to 0, so ``t`` never falls as ``n`` grows.

Old points step aside. The fit uses the sizes fed within the key's last ``_FRESH`` samples, and,
when fewer than two are, the two most recently fed. A size no longer run (a cap at 1 after a flat
curve) thus stops pulling the line once fresher evidence exists, yet the line never loses its
second point: the scheduler's rare re-exploration at 2 refreshes that size, the cap can rise again
once the curve has changed, and the next size's point is refreshed in turn. A stale size fed again
starts its mean afresh from that sample.

Evidence first. With fewer than ``min_samples`` samples, or points at a single batch size (the
intercept is then unknowable), :meth:`CostModel.fit` is None and the schedulers keep today's policy.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import msgspec

#: Weight of a new sample in its batch size's running mean.
_EWMA_ALPHA = 0.3
#: A size's weight in the fit stops growing at this many samples.
_WEIGHT_CAP = 8
#: A size's point takes part in the fit while it was fed within this many samples of its key.
_FRESH = 32
#: Samples outside these bounds (a clock jump, a bogus size) are ignored.
_MAX_N = 4096
_MAX_MS = 1e8
#: Keys the model remembers (least recently fed forgotten first), and keys its snapshot names.
_MAX_KEYS = 64
_SNAPSHOT_KEYS = 8
#: A key's label in a snapshot (metrics label values) is cut to this many characters.
_LABEL_CHARS = 48


@dataclass(frozen=True, slots=True)
class CostFit:
    """The fitted line of one key: ``t(n) = fixed_ms + per_item_ms * n``."""

    fixed_ms: float
    per_item_ms: float
    samples: int

    def time_ms(self, n: int) -> float:
        return self.fixed_ms + self.per_item_ms * n

    def throughput(self, n: int) -> float:
        """Items per second at batch size ``n``."""
        t = self.time_ms(n)
        return math.inf if t <= 0 else n * 1000.0 / t

    def gain_of_one_more(self, n: int) -> float:
        """Machine time (ms) that running one more request with a batch of ``n`` saves, priced at
        the batch of ``n``'s time per item: ``(n + 1) * (t(n)/n - t(n+1)/(n+1))``. ``fixed / n``
        for the line; 0 when per-item cost is flat."""
        if n < 1:
            return 0.0
        return max(0.0, (n + 1) * (self.time_ms(n) / n - self.time_ms(n + 1) / (n + 1)))

    def best_batch(self, max_n: int, margin: float) -> int:
        """The batch size past which throughput rises by less than ``margin`` (relative) per added
        request, at most ``max_n``; 1 when per-item cost is flat."""
        n = 1
        while n < max_n:
            now, more = self.throughput(n), self.throughput(n + 1)
            if math.isinf(now) or more < now * (1.0 + margin):
                break
            n += 1
        return n


class KeyCost(msgspec.Struct, frozen=True, kw_only=True):
    """One key of a :class:`CostSnapshot`."""

    #: The key, summarised (cut to a bounded length): a metrics label value.
    key: str
    fixed_ms: float
    per_item_ms: float
    samples: int
    #: Where throughput stops rising, up to the largest batch size seen.
    best_batch: int


class CostSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The model as ``get_stats`` reports it: the most recently fed keys that have a fit."""

    keys: list[KeyCost]
    #: Keys the model holds samples for (fitted or not).
    num_keys: int


@dataclass(slots=True)
class _Point:
    mean_ms: float
    count: int
    #: The key's sample count when this point was last fed.
    seen_at: int = 0


class CostModel:
    """Per-key cost of a batch. Not thread-safe: owned by the worker's event loop."""

    def __init__(self, *, min_samples: int = 3, margin: float = 0.05) -> None:
        #: Samples a key needs before its fit is used.
        self.min_samples = min_samples
        #: Relative throughput gain below which one more request is not worth batching.
        self.margin = margin
        self._points: OrderedDict[Hashable, dict[int, _Point]] = OrderedDict()
        self._fits: dict[Hashable, CostFit | None] = {}

    def observe(self, key: Hashable, n: int, elapsed_ms: float) -> None:
        """One wave (or step) of ``n`` requests of ``key`` took ``elapsed_ms``."""
        if not 1 <= n <= _MAX_N or not 0 <= elapsed_ms <= _MAX_MS:  # NaN fails both
            return
        points = self._points.get(key)
        if points is None:
            points = self._points[key] = {}
            if len(self._points) > _MAX_KEYS:
                old, _ = self._points.popitem(last=False)
                self._fits.pop(old, None)
        else:
            self._points.move_to_end(key)
        p = points.get(n)
        seen = 1 + sum(q.count for q in points.values())
        if p is None or seen - p.seen_at > _FRESH:  # a stale mean is old evidence: start again
            points[n] = _Point(elapsed_ms, 1, seen)
        else:
            p.mean_ms += _EWMA_ALPHA * (elapsed_ms - p.mean_ms)
            p.count += 1
            p.seen_at = seen
        self._fits[key] = _fit(points, self.min_samples)

    def fit(self, key: Hashable) -> CostFit | None:
        """The key's line, or None while evidence is short (see the module docstring)."""
        return self._fits.get(key)

    def best_batch(self, key: Hashable, max_n: int) -> int | None:
        """Where throughput stops rising (at most ``max_n``); None without a fit."""
        f = self._fits.get(key)
        return None if f is None else f.best_batch(max_n, self.margin)

    def estimate_ms(self, key: Hashable, n: int = 1) -> float | None:
        """The time of a batch of ``n`` of ``key``: the fit's, else, with samples at one size only,
        that size's mean scaled to ``n`` in proportion (no fixed cost assumed: an estimate for
        planning, not for the batching decisions, which wait for a fit). None for an unknown key."""
        f = self._fits.get(key)
        if f is not None:
            return f.time_ms(n)
        points = self._points.get(key)
        if not points:
            return None
        size, point = min(points.items(), key=lambda item: abs(item[0] - n))
        return point.mean_ms * n / size

    def per_item_ms(self, key: Hashable, max_n: int) -> float | None:
        """What one request of ``key`` costs when it runs in a batch of the best size (at most
        ``max_n``): the machine time a queue of such requests takes, per request. None if unknown."""
        f = self._fits.get(key)
        if f is not None:
            best = f.best_batch(max_n, self.margin)
            return f.time_ms(best) / best
        return self.estimate_ms(key, 1)

    def snapshot(self) -> CostSnapshot:
        keys: list[KeyCost] = []
        for key in reversed(self._points):
            f = self._fits.get(key)
            if f is None:
                continue
            keys.append(
                KeyCost(
                    key=key_label(key),
                    fixed_ms=round(f.fixed_ms, 3),
                    per_item_ms=round(f.per_item_ms, 3),
                    samples=f.samples,
                    best_batch=f.best_batch(max(self._points[key]), self.margin),
                )
            )
            if len(keys) == _SNAPSHOT_KEYS:
                break
        return CostSnapshot(keys=keys, num_keys=len(self._points))


def key_label(key: Hashable) -> str:
    """A short, bounded text for a key: its scalar parts joined by ``x`` (``512x512x20``)."""
    parts = key if isinstance(key, tuple) else (key,)
    text = "x".join(str(p) for p in parts if isinstance(p, int | float | str) and not isinstance(p, bool))
    return (text or type(key).__name__)[:_LABEL_CHARS]


def _fit(points: dict[int, _Point], min_samples: int) -> CostFit | None:
    samples = sum(p.count for p in points.values())
    if samples < min_samples or len(points) < 2:
        return None
    fresh = {n: p for n, p in points.items() if samples - p.seen_at < _FRESH}
    if len(fresh) < 2:
        fresh = dict(sorted(points.items(), key=lambda item: item[1].seen_at)[-2:])
    points = fresh
    w = {n: float(min(p.count, _WEIGHT_CAP)) for n, p in points.items()}
    sw = sum(w.values())
    mx = sum(w[n] * n for n in points) / sw
    my = sum(w[n] * p.mean_ms for n, p in points.items()) / sw
    sxx = sum(w[n] * (n - mx) ** 2 for n in points)
    sxy = sum(w[n] * (n - mx) * (p.mean_ms - my) for n, p in points.items())
    slope = sxy / sxx
    fixed = my - slope * mx
    if fixed < 0:
        # Superlinear (or noise): no fixed cost to share; the line through the origin.
        fixed = 0.0
        slope = sum(w[n] * n * p.mean_ms for n, p in points.items()) / sum(w[n] * n * n for n in points)
    if slope < 0:
        slope, fixed = 0.0, my
    return CostFit(fixed_ms=fixed, per_item_ms=slope, samples=samples)
