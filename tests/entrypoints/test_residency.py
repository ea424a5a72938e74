"""The residency budget's eviction policy, without engines: snapshots of models in, the model to
evict (or none, and why) out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_runtime.entrypoints.multi_omni import ResidencyBudget as ReExported
from omni_runtime.entrypoints.residency import Eviction, ModelUse, ResidencyBudget

from omni_runtime.exceptions import ConfigError

pytestmark = pytest.mark.unit


def loaded(name: str, last_used: float, **fields: object) -> ModelUse:
    return ModelUse(**({"name": name, "state": "loaded", "last_used": last_used} | fields))  # type: ignore[arg-type]


def test_it_evicts_the_least_recently_used_idle_model() -> None:
    models = [loaded("a", 3.0), loaded("b", 1.0), loaded("c", 2.0)]
    step = ResidencyBudget(max_loaded_models=2).next_eviction(models)
    assert step.victim == "b" and step.over
    assert "3 models loaded, at most 2 allowed" in step.reason and "b is the least recently used" in step.reason
    # With the least recently used gone, the budget holds.
    rest = [m for m in models if m.name != "b"]
    assert ResidencyBudget(max_loaded_models=2).next_eviction(rest) == Eviction(
        victim=None, over=False, reason="within the budget"
    )


@pytest.mark.parametrize(
    ("kept", "why"),
    [
        ({"leases": 1}, "held by 1 request"),
        ({"leases": 2}, "held by 2 requests"),
        ({"waiters": 3}, "3 requests waiting for it"),
        ({"running": 1}, "1 request running in its engine"),
        ({"changing": True}, "in a transition"),
        ({"state": "loading"}, "loading"),
    ],
)
def test_a_held_busy_or_loading_model_is_never_evicted(kept: dict[str, object], why: str) -> None:
    # The least recently used one is kept busy: the next one goes instead.
    models = [loaded("old", 0.0, **kept), loaded("mid", 1.0), loaded("new", 2.0)]
    step = ResidencyBudget(max_loaded_models=2).next_eviction(models)
    assert step.victim == "mid"
    assert ResidencyBudget.blocker(models[0]) == why


def test_the_model_coming_counts_and_is_never_the_victim() -> None:
    models = [loaded("a", 5.0), ModelUse(name="b", state="asleep", last_used=0.0)]
    budget = ResidencyBudget(max_loaded_models=1)
    assert budget.next_eviction(models).victim is None  # asleep: holds no memory
    step = budget.next_eviction(models, coming="b")
    assert step.victim == "a" and "2 models loaded" in step.reason
    # The one coming is spared even when it is the least recently used loaded model.
    models = [loaded("a", 0.0), loaded("b", 1.0)]
    assert budget.next_eviction(models, coming="a").victim == "b"


def test_the_resident_bytes_budget_holds_on_its_own_and_with_the_count() -> None:
    models = [loaded("a", 0.0, resident_bytes=600), loaded("b", 1.0, resident_bytes=500), loaded("c", 2.0)]
    bytes_only = ResidencyBudget(max_resident_bytes=1000)
    step = bytes_only.next_eviction(models)
    assert step.victim == "a" and "1100 weight bytes resident, at most 1000 allowed" in step.reason
    assert bytes_only.next_eviction(models[1:]).victim is None  # c reported no size: it counts as 0
    both = ResidencyBudget(max_loaded_models=3, max_resident_bytes=1100)
    assert both.next_eviction(models).victim is None
    assert both.next_eviction([*models, loaded("d", 3.0)]).victim == "a"  # the count, this time
    # An evicted model's size is kept as what bringing it back takes.
    asleep = ModelUse(name="d", state="asleep", resident_bytes=200)
    assert both.next_eviction([*models, asleep]).victim is None
    assert both.next_eviction([*models, asleep], coming="d").victim == "a"


def test_it_says_why_when_nothing_can_be_evicted() -> None:
    models = [
        loaded("a", 0.0, leases=1),
        loaded("b", 1.0, running=2),
        ModelUse(name="c", state="loading"),
        ModelUse(name="d", state="asleep"),
    ]
    step = ResidencyBudget(max_loaded_models=1).next_eviction(models)
    assert step.victim is None and step.over
    assert step.reason == (
        "3 models loaded, at most 1 allowed, and no model can be evicted "
        "(a: held by 1 request; b: 2 requests running in its engine; c: loading)"
    )
    step = ResidencyBudget(max_resident_bytes=10).next_eviction([ModelUse(name="x", state="unloaded")], coming="x")
    assert step == Eviction(victim=None, over=False, reason="within the budget")


def test_no_limit_reads_no_model() -> None:
    def models() -> Iterator[ModelUse]:
        raise AssertionError("read")
        yield  # pragma: no cover

    assert ResidencyBudget().excess(models()) is None


@pytest.mark.parametrize("limits", [{"max_loaded_models": 0}, {"max_resident_bytes": 0}])
def test_a_limit_under_one_is_refused(limits: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=f"{next(iter(limits))}: expected int >= 1, got 0"):
        ResidencyBudget(**limits)


def test_multi_omni_re_exports_it() -> None:
    assert ReExported is ResidencyBudget


_uses = st.lists(
    st.builds(
        ModelUse,
        name=st.sampled_from("abcdefgh"),
        state=st.sampled_from(["unloaded", "loading", "loaded", "asleep", "failed"]),
        last_used=st.floats(0, 100),
        resident_bytes=st.none() | st.integers(0, 1000),
        leases=st.integers(0, 2),
        waiters=st.integers(0, 1),
        running=st.integers(0, 2),
        changing=st.booleans(),
    ),
    max_size=8,
    unique_by=lambda m: m.name,
)


@settings(max_examples=100, deadline=None)
@given(
    models=_uses,
    max_loaded=st.none() | st.integers(1, 4),
    max_bytes=st.none() | st.integers(1, 3000),
    coming=st.none() | st.sampled_from("abcdefgh"),
)
def test_the_victim_is_always_the_least_recently_used_evictable_model(
    models: list[ModelUse], max_loaded: int | None, max_bytes: int | None, coming: str | None
) -> None:
    budget = ResidencyBudget(max_loaded, max_bytes)
    step = budget.next_eviction(models, coming)
    evictable = [
        m for m in models if m.state == "loaded" and m.idle and not m.changing and m.name != coming
    ]  # fmt: skip
    assert step.over == (budget.excess(models, coming) is not None)
    if not step.over or not evictable:
        assert step.victim is None
        return
    assert step.victim in {m.name for m in evictable}
    assert min(m.last_used for m in evictable) == next(m.last_used for m in models if m.name == step.victim)
