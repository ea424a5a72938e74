"""The Redis job store against a real redis-server: records, streams, TTLs, cancel signals, the
claim of a dead gateway's jobs (exactly once, by one gateway), fenced writes, the shared blocking
reader, calls against a stopped Redis, and the start-up check of the user's commands."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omni_runtime.entrypoints.jobs.redis_store import RedisJobStore
from omni_runtime.entrypoints.jobs.store import TERMINAL, JobFencedError, JobStoreUnavailableError

from omni_runtime.exceptions import ConfigError, InvalidRequestError
from tests.conftest import eventually
from tests.redis_server import RedisServer


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


# --------------------------------------------------------------------------- fencing


async def test_a_write_from_a_gateway_that_lost_the_job_is_refused_and_a_terminal_state_is_final(stores):
    a, b = stores(), stores()
    await a.start("gw-a", lambda job_id: None)
    await b.start("gw-b", lambda job_id: None)
    await a.create({"job_id": "f1", "status": "running", "owner": "gw-a", "attempts": 1}, ("queued", {}))
    await a.append_event("f1", "step", {"i": 1}, {"progress": 1}, fence=("gw-a", 1))
    await b.update("f1", {"owner": "gw-b", "attempts": 2})  # b claimed it (as the claim script does)
    with pytest.raises(JobFencedError):
        await a.append_event("f1", "failed", {}, {"status": "failed"}, fence=("gw-a", 1))
    await b.append_event("f1", "completed", {}, {"status": "completed"}, fence=("gw-b", 2))
    with pytest.raises(JobFencedError):  # final: not even the owner changes it again
        await b.append_event("f1", "failed", {}, {"status": "failed"}, fence=("gw-b", 2))
    await a.update("f1", {"status": "running"})
    assert (await a.get("f1"))["status"] == "completed"
    assert [e.type for e in await a.events("f1", None)] == ["queued", "step", "completed"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    writes=st.lists(
        st.tuples(st.sampled_from(["gw-a", "gw-b"]), st.integers(1, 2), st.sampled_from(["step", *TERMINAL])),
        min_size=1,
        max_size=12,
    )
)
async def test_whatever_the_writers_do_a_job_has_at_most_one_terminal_event(stores, writes):
    store = stores()
    job_id = f"p{uuid.uuid4().hex}"
    await store.create({"job_id": job_id, "status": "running", "owner": "gw-a", "attempts": 1}, ("queued", {}))
    statuses = []
    for owner, attempt, type_ in writes:
        fields = {"status": type_} if type_ in TERMINAL else {"progress": 1}
        with contextlib.suppress(JobFencedError):
            await store.append_event(job_id, type_, {}, fields, fence=(owner, attempt))
        statuses.append((await store.get(job_id))["status"])
    types = [e.type for e in await store.events(job_id, None)]
    ends = [t for t in types if t in TERMINAL]
    assert len(ends) <= 1
    # Exactly the owner's writes are taken, up to and including the first terminal one.
    expected: list[str] = []
    for owner, attempt, type_ in writes:
        if (owner, attempt) == ("gw-a", 1) and not (expected and expected[-1] in TERMINAL):
            expected.append(type_)
    assert types[1:] == expected
    if ends:  # never back from a terminal state
        first_end = statuses.index(ends[0])
        assert set(statuses[first_end:]) == {ends[0]}


# --------------------------------------------------------------------------- the connection budget


async def test_many_waiters_share_one_blocking_connection(stores, redis_server):
    writer, reader = stores(), stores(connections=2)
    ids = {}
    for i in range(10):
        ids[f"w{i}"] = await writer.create({"job_id": f"w{i}", "status": "queued"}, ("queued", {}))
    waiters = [asyncio.ensure_future(reader.wait_events(f"w{i % 10}", ids[f"w{i % 10}"], 10)) for i in range(60)]
    await eventually(lambda: reader.reader.waiting() == 60, timeout=5, what="60 waiters registered")
    # Meanwhile reads and writes go through at once: no connection waits behind the XREAD.
    assert (await reader.get("w3"))["status"] == "queued"
    for i in range(10):
        await writer.append_event(f"w{i}", "completed", {"i": i}, {"status": "completed"})
    got = await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert [[e.data["i"] for e in g] for g in got] == [[i % 10] for i in range(60)]
    clients = (await writer.redis.execute_command("CLIENT", "LIST")).splitlines()
    assert len(clients) < 12  # two stores: their pools (at most 2 + 2 used) and one reader each


async def test_a_stopped_redis_fails_each_call_within_its_timeout(stores):
    private = RedisServer()
    try:
        store = RedisJobStore(private.url, timeout_s=0.5)
        await store.create({"job_id": "s1", "status": "queued"}, ("queued", {}))
        private.pause()
        for call in (store.get("s1"), store.events("s1", None), store.append_event("s1", "step", {}, {"p": 1})):
            started = time.monotonic()
            with pytest.raises(JobStoreUnavailableError):
                await call
            assert time.monotonic() - started < 3
        assert await store.ping() is False
        started = time.monotonic()
        with pytest.raises(JobStoreUnavailableError):
            await store.reader.wait("omni:job:s1:events", "9-0", 10)  # the shared reader's XREAD fails too
        assert time.monotonic() - started < 4
        private.resume()
        await eventually(store.ping, timeout=10, what="redis back")
        assert (await store.get("s1"))["status"] == "queued"
        await store.close()
    finally:
        private.stop()


async def test_a_user_without_the_commands_the_store_needs_is_told_which(stores, redis_server):
    redis_server.command("ACL", "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", "-publish", "-evalsha")
    try:
        host = redis_server.url.split("//", 1)[1]
        store = RedisJobStore(f"redis://limited:pw@{host}")
        with pytest.raises(ConfigError) as caught:
            await store.start("gw-limited", lambda job_id: None)
        await store.close()
        assert "PUBLISH" in str(caught.value) and "EVALSHA" in str(caught.value)
        assert "XREAD" not in str(caught.value)
    finally:
        redis_server.command("ACL", "DELUSER", "limited")


async def test_jobs_of_a_kind_list_from_another_store_newest_first(stores, redis_server):
    a, b = stores(), stores()
    for i in range(6):
        record = {"job_id": f"k{i}", "status": "queued", "created_at": 1000.0 + i}
        await a.create(record, ("queued", {}), kind="video" if i != 2 else "image")

    async def ids(**kw) -> list[str]:
        args = {"after": None, "limit": 10, "newest_first": True} | kw
        return [r["job_id"] for r in await b.list_kind("video", **args)]

    assert await ids() == ["k5", "k4", "k3", "k1", "k0"]
    assert await ids(newest_first=False, limit=2) == ["k0", "k1"]
    assert await ids(after="k4", limit=2) == ["k3", "k1"]
    assert await ids(after="k2") == [] and await ids(after="nope") == []
    assert await b.delete("video", "k4") and not await b.delete("video", "k4")
    assert await ids(limit=2) == ["k5", "k3"] and await a.get("k4") is None and await a.events("k4", None) == []
    await a.redis.delete("omni:job:k3", "omni:job:k1")  # as if both had expired
    assert await ids(limit=2) == ["k5", "k0"]  # the page is filled past the expired ones
    assert await a.redis.zrange("omni:kind:video", 0, -1) == ["k0", "k5"]
