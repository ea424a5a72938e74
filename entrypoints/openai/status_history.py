"""The dashboard's history: per served model, a bounded rolling window of samples taken every
:data:`PERIOD_S` seconds, served by ``GET /v1/status/history``.

A sample holds what happened since the one before it, and the gauges at its moment:

- rates from the change of the server's Prometheus counters over the interval (requests finished,
  waves run, cache hits), a counter that went back (a reset) counting from zero;
- end-to-end latency of the requests finished in the interval: its mean (exact, from the
  histogram's sum and count) and quantiles from the change of the ``omni_request_e2e_seconds``
  buckets, interpolated within a bucket as Prometheus' ``histogram_quantile`` does (as coarse as
  the buckets: one request between 2.5 and 5 s is a p50 of 3.75 s);
- the mean size of the waves the interval's requests ran in (the batch-size histogram's sum over
  its count);
- queue depth per stage and replica (requests inside each replica), live replicas and restarts
  from the engine's health, the model's state and its resident weight bytes.

A sample reads memory only (the metrics registry and the engines' health): no replica is asked,
so the sampler never waits on a stage. Memory is fixed: at most :data:`SAMPLES` samples per model,
the oldest dropped. :class:`StatusHistory` runs on the server's event loop; its task is started and
stopped with the app's lifespan (``server.py``). The math (:class:`Window`, :func:`rate`,
:func:`histogram_quantile`) is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .state import ServerState

logger = logging.getLogger(__name__)

#: Seconds between two samples.
PERIOD_S = 2.0
#: Samples kept per model: ten minutes at :data:`PERIOD_S`.
SAMPLES = 300

#: Cumulative counts of a histogram by bucket upper bound (``inf`` last: the total).
Buckets = Mapping[float, float]

_Body = {"kw_only": True, "frozen": True}


# --------------------------------------------------------------------------- the math


def rate(before: float | None, now: float, seconds: float) -> float | None:
    """Per second, the change of a counter from ``before`` to ``now`` over ``seconds``; None
    without an earlier reading. A counter that went back was reset: it counts from zero."""
    if before is None or seconds <= 0:
        return None
    delta = now - before if now >= before else now
    return delta / seconds


def bucket_change(before: Buckets | None, now: Buckets) -> dict[float, float]:
    """The cumulative bucket counts of the observations made between two readings of a
    histogram (``before`` None: since it began; a reset, some count that went back: ``now``)."""
    if before is None or any(count < before.get(bound, 0.0) for bound, count in now.items()):
        return dict(now)
    return {bound: count - before.get(bound, 0.0) for bound, count in now.items()}


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q`` quantile of cumulative bucket counts, interpolated linearly within its bucket
    (from 0 for the first), as Prometheus' ``histogram_quantile``; in the ``+Inf`` bucket, the
    largest finite bound. None when the histogram holds nothing."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# --------------------------------------------------------------------------- readings and samples


@dataclass(frozen=True)
class StageReading:
    """One stage of a model at one moment: gauges now, counters since the server started."""

    stage_id: int
    #: Requests inside each replica (waiting or running), by replica id.
    queue_depth: tuple[int, ...] = ()
    live_replicas: int = 0
    restarts: int = 0
    #: Waves run (the wave-duration histogram's count).
    waves: float = 0.0
    #: The batch-size histogram's count (requests) and sum (their waves' sizes).
    batch_count: float = 0.0
    batch_sum: float = 0.0
    #: Hits of the caches across requests (prompt and result caches).
    cache_hits: float = 0.0


@dataclass(frozen=True)
class Reading:
    """One model at one moment (epoch seconds)."""

    time: float
    state: str
    pending: int = 0
    resident_bytes: int = 0
    #: End-to-end latency buckets (seconds), cumulative since the server started, and their sum.
    e2e: Buckets = field(default_factory=dict)
    e2e_sum: float = 0.0
    stages: tuple[StageReading, ...] = ()


class StagePoint(msgspec.Struct, **_Body):
    """One stage in a sample."""

    stage_id: int
    #: Requests inside each replica now (waiting or running), by replica id.
    queue_depth: list[int]
    live_replicas: int
    restarts: int
    #: Over the interval since the previous sample (None on the first, or when nothing ran):
    waves_per_s: float | None
    #: The mean size of the waves the interval's requests ran in.
    batch_size: float | None
    cache_hits_per_s: float | None


class Sample(msgspec.Struct, **_Body):
    """One model in the window: its state and gauges at ``time`` (epoch seconds), and what
    happened since the previous sample."""

    time: float
    state: str
    pending: int
    resident_bytes: int
    #: Requests finished per second.
    requests_per_s: float | None
    #: End-to-end latency of the requests finished in the interval (None when none did).
    e2e_mean_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    stages: list[StagePoint]


class HistoryReport(msgspec.Struct, **_Body):
    """The body of ``GET /v1/status/history`` for one model: its samples, oldest first."""

    model: str
    period_s: float
    span_s: float
    samples: list[Sample]


class MultiHistoryReport(msgspec.Struct, **_Body):
    """The body of ``GET /v1/status/history`` when several models are served and none is named."""

    models: list[HistoryReport]


class Window:
    """One model's samples, oldest first: at most ``size`` (the oldest dropped), each made from
    a :class:`Reading` and the one before it."""

    def __init__(self, size: int = SAMPLES) -> None:
        self.samples: deque[Sample] = deque(maxlen=size)
        self._last: Reading | None = None

    def add(self, reading: Reading) -> Sample:
        last, self._last = self._last, reading
        dt = reading.time - last.time if last is not None else 0.0
        mean = p50 = p99 = None
        if last is not None:
            change = bucket_change(last.e2e, reading.e2e)
            p50, p99 = histogram_quantile(0.5, change), histogram_quantile(0.99, change)
            finished = _total(change)
            if finished > 0:
                reset = _total(reading.e2e) < _total(last.e2e)
                mean = (reading.e2e_sum - (0.0 if reset else last.e2e_sum)) / finished
        before = {s.stage_id: s for s in last.stages} if last is not None else {}
        stages = [_stage_point(before.get(s.stage_id), s, dt) for s in reading.stages]
        sample = Sample(
            time=round(reading.time, 3),
            state=reading.state,
            pending=reading.pending,
            resident_bytes=reading.resident_bytes,
            requests_per_s=_round(rate(_total(last.e2e) if last else None, _total(reading.e2e), dt)),
            e2e_mean_ms=_ms(mean),
            e2e_p50_ms=_ms(p50),
            e2e_p99_ms=_ms(p99),
            stages=stages,
        )
        self.samples.append(sample)
        return sample

    def since(self, time_s: float | None) -> list[Sample]:
        """The samples taken after ``time_s`` (epoch seconds; None: all)."""
        if time_s is None:
            return list(self.samples)
        return [s for s in self.samples if s.time > time_s]


def _total(buckets: Buckets) -> float:
    return buckets[max(buckets)] if buckets else 0.0


def _stage_point(before: StageReading | None, now: StageReading, dt: float) -> StagePoint:
    # A stage absent from the previous reading (its model had no engine) has no rates yet: its
    # counters may hold an earlier load's.
    requests = rate(before.batch_count if before else None, now.batch_count, dt)
    sizes = rate(before.batch_sum if before else None, now.batch_sum, dt)
    return StagePoint(
        stage_id=now.stage_id,
        queue_depth=list(now.queue_depth),
        live_replicas=now.live_replicas,
        restarts=now.restarts,
        waves_per_s=_round(rate(before.waves if before else None, now.waves, dt)),
        batch_size=_round(sizes / requests) if requests and sizes is not None else None,
        cache_hits_per_s=_round(rate(before.cache_hits if before else None, now.cache_hits, dt)),
    )


# --------------------------------------------------------------------------- reading the server


def _series(metric: Collector, suffix: str) -> Iterator[tuple[dict[str, str], float]]:
    """The samples of a metric whose name ends with ``suffix``: labels and value."""
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith(suffix):
                yield s.labels, s.value


def _key(labels: Mapping[str, str], only: str) -> tuple[str, int]:
    """(model, stage) of a series; an unlabelled model is the only one served."""
    stage = labels.get("stage", "")
    return labels.get("model") or only, int(stage) if stage.isdigit() else -1


def _buckets(metric: Collector, only: str) -> dict[tuple[str, int], dict[float, float]]:
    out: dict[tuple[str, int], dict[float, float]] = {}
    for labels, value in _series(metric, "_bucket"):
        out.setdefault(_key(labels, only), {})[float(labels["le"])] = value
    return out


def _sums(metric: Collector, suffix: str, only: str, **match: str) -> dict[tuple[str, int], float]:
    out: dict[tuple[str, int], float] = {}
    for labels, value in _series(metric, suffix):
        if all(labels.get(k) == v for k, v in match.items()):
            key = _key(labels, only)
            out[key] = out.get(key, 0.0) + value
    return out


def read_server(state: ServerState, now: float) -> Iterable[tuple[str, Reading]]:
    """A :class:`Reading` of every served model (memory only: the metrics registry, the health
    the engines keep)."""
    m = state.metrics
    only = "" if state.several else state.only.name
    e2e, e2e_sum = _buckets(m.e2e, only), _sums(m.e2e, "_sum", only)
    waves = _sums(m.wave_seconds, "_count", only)
    batch_count, batch_sum = _sums(m.batch_size, "_count", only), _sums(m.batch_size, "_sum", only)
    hits: dict[tuple[str, int], float] = {}
    for series in m.caches.values():
        for key, value in _sums(series.requests, "_total", only, outcome="hit").items():
            hits[key] = hits.get(key, 0.0) + value
    for name, model in state.multi.models.items():
        h = model.health()
        stages = tuple(
            StageReading(
                stage_id=s.stage_id,
                queue_depth=tuple(s.per_replica_inflight),
                live_replicas=s.live_replicas,
                restarts=s.restarts,
                waves=waves.get((name, s.stage_id), 0.0),
                batch_count=batch_count.get((name, s.stage_id), 0.0),
                batch_sum=batch_sum.get((name, s.stage_id), 0.0),
                cache_hits=hits.get((name, s.stage_id), 0.0),
            )
            for s in (h.stages if h is not None else ())
        )
        held = model.state in ("loaded", "loading")
        yield (
            name,
            Reading(
                time=now,
                state=model.status(),
                pending=h.pending if h is not None else 0,
                resident_bytes=(model.resident_bytes or 0) if held else 0,
                e2e=e2e.get((name, -1), {}),
                e2e_sum=e2e_sum.get((name, -1), 0.0),
                stages=stages,
            ),
        )


class StatusHistory:
    """Every served model's :class:`Window`, and the task that samples them every ``period_s``
    seconds. Runs on the server's event loop: :meth:`start` in the app's lifespan, :meth:`stop`
    when it ends."""

    def __init__(self, state: ServerState, *, period_s: float = PERIOD_S, size: int = SAMPLES) -> None:
        self.state = state
        self.period_s = period_s
        self.size = size
        self.windows: dict[str, Window] = {name: Window(size) for name in state.multi.models}
        self._task: asyncio.Task[None] | None = None

    @property
    def span_s(self) -> float:
        return self.period_s * self.size

    def sample(self, now: float | None = None) -> None:
        """Take one sample of every model."""
        for name, reading in read_server(self.state, time.time() if now is None else now):
            self.windows.setdefault(name, Window(self.size)).add(reading)

    def report(self, model: str, since: float | None = None) -> HistoryReport:
        window = self.windows.get(model) or Window(self.size)
        return HistoryReport(model=model, period_s=self.period_s, span_s=self.span_s, samples=window.since(since))

    def start(self) -> None:
        # The task holds the history weakly: nothing keeps it alive in a cycle through the loop.
        self._task = asyncio.ensure_future(_sample_every(weakref.ref(self), self.period_s))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _sample_every(ref: weakref.ref[StatusHistory], period_s: float) -> None:
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    while (history := ref()) is not None:
        try:
            history.sample()
        except Exception:  # a bad sample costs one point of the charts, never the sampler
            logger.exception("the status history could not take a sample")
        del history
        # On a fixed beat: a slow sample does not push the later ones back.
        next_at = max(next_at + period_s, loop.time())
        await asyncio.sleep(next_at - loop.time())
