"""The in-memory job store: bounded by count and TTL, events replayable after any id."""

from __future__ import annotations

import asyncio

import pytest
from omni_runtime.entrypoints.jobs.store import MemoryJobStore

from omni_runtime.exceptions import InvalidRequestError, QueueFullError


def _record(i: int) -> dict:
    return {"job_id": f"job-{i}", "status": "queued"}


async def test_a_thousand_jobs_with_a_short_ttl_keep_the_store_bounded():
    store = MemoryJobStore(max_jobs=100, ttl_s=0.05)
    for i in range(1000):
        await store.create(_record(i), ("queued", {}))
        await store.append_event(f"job-{i}", "completed", {})
        await store.update(f"job-{i}", {"status": "completed"})
        assert store.count() <= 100
    await asyncio.sleep(0.06)
    await store.create(_record(1000), ("queued", {}))
    assert store.count() == 1  # every finished job has expired
    assert await store.get("job-999") is None
    assert (await store.get("job-1000"))["status"] == "queued"


async def test_a_store_full_of_running_jobs_refuses_a_new_one():
    store = MemoryJobStore(max_jobs=3, ttl_s=60)
    for i in range(3):
        await store.create(_record(i), ("queued", {}))
    with pytest.raises(QueueFullError):
        await store.create(_record(3), ("queued", {}))
    await store.update("job-0", {"status": "failed"})
    await store.create(_record(3), ("queued", {}))  # the finished job made room
    assert await store.get("job-0") is None and store.count() == 3


async def test_events_replay_after_an_id_without_gap_or_duplicate():
    store = MemoryJobStore()
    await store.create(_record(0), ("queued", {"n": 0}))
    for n in range(1, 6):
        await store.append_event("job-0", "step", {"n": n})
    everything = await store.events("job-0", None)
    assert [e.data["n"] for e in everything] == list(range(6))
    for cut in range(6):
        rest = await store.events("job-0", everything[cut].id)
        assert [e.data["n"] for e in rest] == list(range(cut + 1, 6))


async def test_a_waiter_wakes_on_the_next_event_and_times_out_without_one():
    store = MemoryJobStore()
    first = await store.create(_record(0), ("queued", {}))
    assert await store.wait_events("job-0", first, 0.05) == []
    waiter = asyncio.ensure_future(store.wait_events("job-0", first, 5))
    await asyncio.sleep(0.01)
    await store.append_event("job-0", "started", {})
    got = await asyncio.wait_for(waiter, 1)
    assert [e.type for e in got] == ["started"]


@pytest.mark.parametrize("bad", ["", "-1", "1-0", "abc", "1" * 40, "\udfff"])
def test_an_event_id_that_the_store_never_sent_is_a_400(bad):
    with pytest.raises(InvalidRequestError) as info:
        MemoryJobStore().check_event_id(bad)
    assert info.value.param == "Last-Event-ID"


async def test_jobs_of_a_kind_list_in_creation_order_with_pages_and_expiry():
    store = MemoryJobStore(max_jobs=100, ttl_s=0.05)
    for i in range(5):
        await store.create(_record(i), ("queued", {}), kind="video" if i != 2 else "image")
    await store.create(_record(9), ("queued", {}))  # no kind: in no index

    async def ids(**kw) -> list[str]:
        args = {"after": None, "limit": 10, "newest_first": True} | kw
        return [r["job_id"] for r in await store.list_kind("video", **args)]

    assert await ids() == ["job-4", "job-3", "job-1", "job-0"]
    assert await ids(newest_first=False, limit=2) == ["job-0", "job-1"]
    assert await ids(after="job-3", limit=1) == ["job-1"]
    assert await ids(after="job-2") == [] and await ids(after="nope") == []
    assert await store.delete("video", "job-3") and not await store.delete("video", "job-3")
    assert await ids() == ["job-4", "job-1", "job-0"] and await store.get("job-3") is None
    assert await store.events("job-3", None) == []
    await store.update("job-1", {"status": "completed"})
    await asyncio.sleep(0.06)
    assert await ids() == ["job-4", "job-0"]  # the expired job left the index
    assert [r["job_id"] for r in await store.list_kind("image", after=None, limit=5, newest_first=True)] == ["job-2"]
