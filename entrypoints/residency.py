"""The residency budget of several served models: at most ``max_loaded_models`` models holding
memory (loaded, or loading) and at most ``max_resident_bytes`` weight bytes resident at once, and
which model goes when they do not fit: the least recently used idle one.

A pure policy over snapshots of the models (:class:`ModelUse`): no engine, no lock, no clock.
:class:`~omni_runtime.entrypoints.multi_omni.MultiOmni` takes the snapshots, asks
:meth:`ResidencyBudget.next_eviction`, and evicts (sleep or stop) the model it names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from omni_runtime.exceptions import ConfigError

from .model_specs import ModelState

__all__ = ["Eviction", "ModelUse", "ResidencyBudget"]


@dataclass(frozen=True, kw_only=True)
class ModelUse:
    """What the budget reads of one model at one moment."""

    name: str
    state: ModelState
    #: When a request last took or gave it back (any clock that only goes forward).
    last_used: float = 0.0
    #: Weight bytes its runners reported resident; None (none reported) counts as nothing.
    resident_bytes: int | None = None
    #: Requests holding it, requests waiting for it to come back, requests running in its engine.
    leases: int = 0
    waiters: int = 0
    running: int = 0
    #: In a transition (load, wake, sleep, stop).
    changing: bool = False

    @property
    def holds_memory(self) -> bool:
        return self.state in ("loaded", "loading")

    @property
    def idle(self) -> bool:
        """No request holds it, waits for it, or runs in its engine."""
        return not (self.leases or self.waiters or self.running)


@dataclass(frozen=True, kw_only=True)
class Eviction:
    """The budget's answer: the model to evict next (None: none), whether the models holding
    memory exceed the budget, and why."""

    victim: str | None
    over: bool
    reason: str


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


class ResidencyBudget:
    """The limits (None: no limit on that count) and the choice of what to evict under them."""

    def __init__(self, max_loaded_models: int | None = None, max_resident_bytes: int | None = None) -> None:
        if max_loaded_models is not None and max_loaded_models < 1:
            raise ConfigError(f"max_loaded_models: expected int >= 1, got {max_loaded_models}")
        if max_resident_bytes is not None and max_resident_bytes < 1:
            raise ConfigError(f"max_resident_bytes: expected int >= 1, got {max_resident_bytes}")
        self.max_loaded_models = max_loaded_models
        self.max_resident_bytes = max_resident_bytes

    def excess(self, models: Iterable[ModelUse], coming: str | None = None) -> str | None:
        """How the models holding memory (and ``coming``, about to load or wake) exceed the
        budget, or None while they fit. ``models`` is not read when there is no limit."""
        if self.max_loaded_models is None and self.max_resident_bytes is None:
            return None
        held = [m for m in models if m.holds_memory or m.name == coming]
        if self.max_loaded_models is not None and len(held) > self.max_loaded_models:
            return f"{_count(len(held), 'model')} loaded, at most {self.max_loaded_models} allowed"
        size = sum(m.resident_bytes or 0 for m in held)
        if self.max_resident_bytes is not None and size > self.max_resident_bytes:
            return f"{size} weight bytes resident, at most {self.max_resident_bytes} allowed"
        return None

    @staticmethod
    def blocker(model: ModelUse, coming: str | None = None) -> str | None:
        """Why ``model`` cannot be evicted now, or None: only a loaded model that is idle and in
        no transition can be, and never the one coming."""
        if model.name == coming:
            return "about to load"
        if model.state != "loaded":
            return model.state
        if model.changing:
            return "in a transition"
        if model.leases:
            return f"held by {_count(model.leases, 'request')}"
        if model.waiters:
            return f"{_count(model.waiters, 'request')} waiting for it"
        if model.running:
            return f"{_count(model.running, 'request')} running in its engine"
        return None

    def next_eviction(self, models: Iterable[ModelUse], coming: str | None = None) -> Eviction:
        """The model to evict next so that the budget holds (``coming``: a model about to load
        or wake, counted as holding memory and never evicted): the least recently used one that
        can be; none while the budget holds, or when no model can be (the reason names each
        model holding memory and what keeps it)."""
        models = list(models)
        excess = self.excess(models, coming)
        if excess is None:
            return Eviction(victim=None, over=False, reason="within the budget")
        candidates = [m for m in models if self.blocker(m, coming) is None]
        if candidates:
            victim = min(candidates, key=lambda m: m.last_used)
            reason = f"{excess}; {victim.name} is the least recently used idle model"
            return Eviction(victim=victim.name, over=True, reason=reason)
        kept = "; ".join(f"{m.name}: {self.blocker(m, coming)}" for m in models if m.holds_memory and m.name != coming)
        reason = f"{excess}, and no model can be evicted ({kept or 'none is loaded'})"
        return Eviction(victim=None, over=True, reason=reason)
