"""``/metrics`` series of the served models' lives: state, cold loads, wakes from sleep and
evictions by the budget, and resident weight bytes, each with a ``model`` label. Read from the
:class:`MultiOmni` at each scrape (runs on the server's event loop)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..multi_omni import ModelState, MultiOmni

_STATES: tuple[ModelState, ...] = ("unloaded", "loading", "loaded", "asleep", "failed", "dead", "closed")


class ModelCollector(Collector):
    """The budget's counts and each model's state, by model."""

    def __init__(self, multi: MultiOmni) -> None:
        self.multi = multi

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "omni_model_state", "1 for the state each served model is in, 0 for the others.", labels=["model", "state"]
        )
        loads = CounterMetricFamily("omni_model_loads", "Cold loads of a model (its engine started).", labels=["model"])
        wakes = CounterMetricFamily("omni_model_wakes", "Wake-ups of a model put to sleep.", labels=["model"])
        evictions = CounterMetricFamily(
            "omni_model_evictions", "Evictions of a model by the budget (sleep or stop).", labels=["model"]
        )
        resident = GaugeMetricFamily(
            "omni_model_resident_bytes",
            "Weight bytes a model's runners reported resident when last loaded (0 while evicted).",
            labels=["model"],
        )
        for name, c in self.multi.counts().items():
            for s in _STATES:
                state.add_metric([name, s], 1.0 if c.state == s else 0.0)
            loads.add_metric([name], c.loads)
            wakes.add_metric([name], c.wakes)
            evictions.add_metric([name], c.evictions)
            held = c.state in ("loaded", "loading")
            resident.add_metric([name], float(c.resident_bytes or 0) if held else 0.0)
        yield from (state, loads, wakes, evictions, resident)
