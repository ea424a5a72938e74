"""The Redis job store against a real redis-server: records, streams, TTLs, cancel signals and
the claim of a dead gateway's jobs (exactly once, by one gateway)."""

from __future__ import annotations

import asyncio

import pytest
from omni_runtime.entrypoints.jobs.redis_store import RedisJobStore

from omni_runtime.exceptions import InvalidRequestError
from tests.conftest import eventually


@pytest.fixture
async def stores(redis_server):
    redis_server.flush()
    made: list[RedisJobStore] = []

    def make(**kwargs) -> RedisJobStore:
        store = RedisJobStore(redis_server.url, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def test_a_record_and_its_events_are_shared_between_two_stores(stores):
    a, b = stores(), stores()
    first = await a.create({"job_id": "j1", "status": "queued", "n": [1, 2]}, ("queued", {"x": 1}))
    assert await b.get("j1") == {"job_id": "j1", "status": "queued", "n": [1, 2]}
    await b.update("j1", {"status": "running"})
    assert (await a.get("j1"))["status"] == "running"
    ids = [first] + [await a.append_event("j1", "step", {"i": i}) for i in range(5)]
    replay = await b.events("j1", None)
    assert [e.id for e in replay] == ids
    assert [e.data.get("i") for e in await b.events("j1", ids[2])] == [2, 3, 4]
    await b.update("missing", {"status": "running"})  # an expired job is not brought back
    assert await a.get("missing") is None


async def test_xread_wakes_a_waiter_on_another_connection(stores):
    a, b = stores(), stores()
    last = await a.create({"job_id": "j2", "status": "queued"}, ("queued", {}))
    assert await b.wait_events("j2", last, 0.05) == []
    waiter = asyncio.ensure_future(b.wait_events("j2", last, 5))
    await asyncio.sleep(0.05)
    await a.append_event("j2", "completed", {})
    got = await asyncio.wait_for(waiter, 2)
    assert [e.type for e in got] == ["completed"]


async def test_records_and_streams_expire_with_the_ttl(stores):
    a = stores(ttl_s=1)
    await a.create({"job_id": "j3", "status": "queued"}, ("queued", {}))
    assert await a.redis.ttl("omni:job:j3") > 0 and await a.redis.ttl("omni:job:j3:events") > 0
    await eventually(lambda: _gone(a, "j3"), timeout=5, what="expiry")


async def _gone(store: RedisJobStore, job_id: str) -> bool:
    return await store.get(job_id) is None and not await store.redis.exists(f"omni:job:{job_id}:events")


async def test_a_cancel_reaches_the_owning_gateway(stores):
    owner, other = stores(), stores()
    heard: list[str] = []
    await owner.start("gw-owner", heard.append)
    await other.start("gw-other", lambda job_id: None)
    await owner.create({"job_id": "j4", "status": "running", "owner": "gw-owner"}, ("queued", {}))
    await other.signal_cancel(await other.get("j4"))
    await eventually(lambda: heard == ["j4"], timeout=5, what="the cancel message")
    assert (await owner.get("j4"))["cancel_requested"] is True


async def test_a_dead_gateways_jobs_are_claimed_once(stores):
    dead = stores(lease_s=0.3)
    await dead.start("gw-dead", lambda job_id: None)
    for i in range(3):
        await dead.create({"job_id": f"d{i}", "status": "queued", "owner": "gw-dead"}, ("queued", {}))
    await dead.update("d2", {"status": "completed"})  # a finished job leaves the owner's set
    live = [stores(lease_s=5), stores(lease_s=5)]
    for i, store in enumerate(live):
        await store.start(f"gw-live{i}", lambda job_id: None)
    assert await live[0].claim_orphans() == []  # the lease still runs
    # Nothing renews the dead gateway's lease (the job manager's heartbeat would): as after SIGKILL.
    await asyncio.sleep(0.4)
    claims = await asyncio.gather(*(s.claim_orphans() for s in live))
    assert sorted(claims[0] + claims[1]) == ["d0", "d1"]
    assert [] in claims  # one gateway got them all
    winner = "gw-live0" if claims[0] else "gw-live1"
    assert (await live[0].get("d0"))["owner"] == winner
    assert await live[0].claim_orphans() == [] and await live[1].claim_orphans() == []


@pytest.mark.parametrize("bad", ["", "1", "abc-1", "1-2-3", "9" * 30 + "-0"])
def test_an_event_id_redis_never_made_is_a_400(bad):
    store = RedisJobStore("redis://127.0.0.1:1/0")
    with pytest.raises(InvalidRequestError):
        store.check_event_id(bad)
