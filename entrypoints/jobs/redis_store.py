"""The Redis job store (``serve --redis-url``): gateways that share one Redis share their jobs.

Keys (``omni:`` prefix):

* ``job:{id}``: the record, a hash of JSON values, expiring ``ttl_s`` after its last change;
* ``job:{id}:events``: the events, one Redis Stream per job (same TTL). Stream ids are the SSE
  event ids, so ``Last-Event-ID`` replays from any gateway with ``XRANGE`` and ``XREAD BLOCK``
  waits for new ones without polling;
* ``kind:{kind}``: the jobs created with a kind (``video``, ...), a sorted set scored by creation
  time: a list page is one ``ZRANGE`` by rank, a job that expired leaves it when a list meets it,
  and the oldest go past :data:`MAX_INDEXED`;
* ``gw:{gateway}``: a gateway's lease, ``lease_s`` long, renewed every ``lease_s / 3``;
* ``gw:{gateway}:jobs``: the unfinished jobs a gateway runs; ``gws``: every gateway with a set;
* channel ``gw:{gateway}:cancel``: cancel requests for a gateway's jobs, from other gateways.

A gateway whose lease ran out (SIGKILL, a lost host) is dead: the first live gateway to notice
claims its jobs in one Lua script (atomic, so no job is claimed twice); the job manager then
re-queues each once, or fails it with ``gateway_lost`` (docs/jobs.md).

Connections: job-state writes (create, events, heartbeat, claim) have a pool of their own, client
reads (GET, replays) another, both bounded (``connections`` each) with short timeouts
(``timeout_s``): a stopped Redis fails a call within seconds. Blocking reads never use them: one
:class:`StreamReader` per gateway waits on every stream at once over one connection. Every job
write after ``create`` is one Lua script that refuses to change a finished job and, when fenced,
a job whose owner or attempt is no longer the writer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omni_runtime.exceptions import ConfigError, InvalidRequestError

from .store import TERMINAL, Backoff, Event, Fence, JobFencedError, JobStore, JobStoreUnavailableError
from .stream_reader import StreamReader

logger = logging.getLogger(__name__)

_EVENT_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
#: A Redis Stream id is two unsigned 64-bit integers: a larger part makes Redis fail the read.
_MAX_ID_PART = 2**64 - 1
#: Events kept per job at most (approximate trimming: XADD MAXLEN ~).
MAX_EVENTS = 10_000
#: Jobs kept per kind's index at most (the oldest leave first).
MAX_INDEXED = 100_000

# Claims a dead gateway's jobs for this one, unless its lease came back meanwhile.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {} end
local ids = redis.call('SMEMBERS', KEYS[2])
for _, id in ipairs(ids) do
  if redis.call('EXISTS', ARGV[3] .. id) == 1 then
    redis.call('HSET', ARGV[3] .. id, 'owner', ARGV[2])
    redis.call('SADD', KEYS[3], id)
  end
end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[4], ARGV[1])
return ids
"""


#: Backoff between tries to subscribe the cancel channel again after its connection was lost, s.
RESUBSCRIBE_S = (0.25, 5.0)


# Every job write after create: refused for a gone or finished job, and, when fenced, unless the
# record's owner and attempts are the writer's. KEYS: record, events, the writer's job set.
# ARGV: ttl, owner (JSON or ''), attempts (JSON or ''), event type ('' = none), event data,
# MAXLEN, the job id when the write ends the job (else ''), then field/value pairs.
_WRITE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 'gone'} end
local status = redis.call('HGET', KEYS[1], 'status')
if status == '"completed"' or status == '"failed"' or status == '"cancelled"' then return {0, 'final'} end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return {0, 'fenced'} end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[3] then return {0, 'fenced'} end
if #ARGV > 7 then redis.call('HSET', KEYS[1], unpack(ARGV, 8)) end
local id = ''
if ARGV[4] ~= '' then
  id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 't', ARGV[4], 'd', ARGV[5])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
if ARGV[7] ~= '' then redis.call('SREM', KEYS[3], ARGV[7]) end
return {1, id}
"""

#: Commands the store sends, each tried once harmlessly at start (a Redis user without one of
#: them is a start-up error that names it, not a failure later).
_PROBE_SCRIPT = "return 1"


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Connection errors and timeouts are a :class:`JobStoreUnavailableError` (HTTP 503)."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError) as e:
        raise JobStoreUnavailableError(f"the job store (redis) cannot be reached: {e or type(e).__name__}") from e


class RedisJobStore(JobStore):
    """Jobs in Redis, shared by every gateway that uses the same URL and ``prefix``."""

    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float = 3600.0,
        lease_s: float = 10.0,
        prefix: str = "omni:",
        connections: int = 16,
        timeout_s: float = 2.0,
    ) -> None:
        self.url, self.ttl_s, self.lease_s, self.prefix = url, ttl_s, lease_s, prefix
        self._ttl = max(1, int(ttl_s))
        #: Client reads (GET, event replays, cancel signals).
        self.redis = self._client(connections, timeout_s, reads=True)
        #: Job-state writes and the lease: never queued behind client reads.
        self.writes = self._client(connections, timeout_s)
        # The shared reader blocks up to block_ms at a time: its read timeout is longer.
        reader = self._client(1, timeout_s + 1.0, health_check_interval=0, reads=True)
        self.reader = StreamReader(reader, block_ms=200)
        self.gateway_id: str | None = None
        self._pubsub: Any = None
        self._listener: asyncio.Task | None = None
        self._claim = self.writes.register_script(_CLAIM)
        self._write = self.writes.register_script(_WRITE)

    def _client(
        self, connections: int, timeout_s: float, health_check_interval: int = 30, *, reads: bool = False
    ) -> aioredis.Redis:
        # A blocking pool: a call waits (up to timeout_s) for a free connection instead of failing
        # with "Too many connections"; no retry on a timeout, so a call fails within about
        # timeout_s. After a Redis restart each pooled connection is stale and fails its next
        # command ("Connection closed by server"): reads, which may run twice, try once more on a
        # new connection; writes do not (a write is never sent twice: a progress event is
        # dropped, a job's end is kept and written later).
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)) if reads else Retry(NoBackoff(), 0)
        pool = aioredis.BlockingConnectionPool.from_url(
            self.url,
            max_connections=connections,
            timeout=timeout_s,
            decode_responses=True,
            health_check_interval=health_check_interval,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=retry,
        )
        return aioredis.Redis.from_pool(pool)

    # ------------------------------------------------------------------ keys

    def _job(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}"

    def _events(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}:events"

    def _kind(self, kind: str) -> str:
        return f"{self.prefix}kind:{kind}"

    def _lease(self, gateway_id: str) -> str:
        return f"{self.prefix}gw:{gateway_id}"

    def _owned(self, gateway_id: str) -> str:
        return f"{self.prefix}gw:{gateway_id}:jobs"

    def _channel(self, gateway_id: str) -> str:
        return f"{self.prefix}gw:{gateway_id}:cancel"

    # ------------------------------------------------------------------ records and events

    async def create(
        self, record: dict[str, Any], first_event: tuple[str, dict[str, Any]], *, kind: str | None = None
    ) -> str:
        job_id = record["job_id"]
        type_, data = first_event
        with _reachable():
            return await self._create(job_id, record, type_, data, kind)

    async def _create(
        self, job_id: str, record: dict[str, Any], type_: str, data: dict[str, Any], kind: str | None
    ) -> str:
        async with self.writes.pipeline(transaction=True) as p:
            p.hset(self._job(job_id), mapping={k: json.dumps(v) for k, v in record.items()})
            p.expire(self._job(job_id), self._ttl)
            p.xadd(self._events(job_id), {"t": type_, "d": json.dumps(data)}, maxlen=MAX_EVENTS, approximate=True)
            p.expire(self._events(job_id), self._ttl)
            owner = record.get("owner")
            if owner:
                p.sadd(self._owned(owner), job_id)
            if kind is not None:
                p.zadd(self._kind(kind), {job_id: float(record.get("created_at") or 0.0)})
                p.zremrangebyrank(self._kind(kind), 0, -MAX_INDEXED - 1)
            results = await p.execute()
        return results[2]

    async def list_kind(self, kind: str, *, after: str | None, limit: int, newest_first: bool) -> list[dict[str, Any]]:
        key = self._kind(kind)
        found: list[dict[str, Any]] = []
        with _reachable():
            start = 0
            if after is not None:
                rank = await (self.redis.zrevrank if newest_first else self.redis.zrank)(key, after)
                if not isinstance(rank, int):  # not in the index
                    return []
                start = rank + 1
            # A page of ids by rank, then their records in one round trip; ids whose record
            # expired leave the index, and the page is filled from the next ranks.
            while len(found) < limit:
                page = self.redis.zrevrange if newest_first else self.redis.zrange
                ids: list[str] = await page(key, start, start + limit - len(found) - 1)  # type: ignore[assignment]
                if not ids:
                    break
                async with self.redis.pipeline(transaction=False) as p:
                    for job_id in ids:
                        p.hgetall(self._job(job_id))
                    records = await p.execute()
                gone = [job_id for job_id, fields in zip(ids, records, strict=True) if not fields]
                found += [{k: json.loads(v) for k, v in fields.items()} for fields in records if fields]
                if gone:
                    await self.writes.zrem(key, *gone)
                start += len(ids) - len(gone)
        return found

    async def delete(self, kind: str, job_id: str) -> bool:
        with _reachable():
            async with self.writes.pipeline(transaction=True) as p:
                p.zrem(self._kind(kind), job_id)
                p.delete(self._job(job_id), self._events(job_id))
                _, removed = await p.execute()
        return bool(removed)

    async def get(self, job_id: str) -> dict[str, Any] | None:
        with _reachable():
            fields = await self.redis.hgetall(self._job(job_id))
        if not fields:
            return None
        # The pool decodes responses (decode_responses=True), which redis's types cannot express.
        return {k: json.loads(v) for k, v in fields.items()}  # type: ignore[misc]

    async def update(self, job_id: str, fields: dict[str, Any]) -> None:
        # Only an existing, unfinished record is updated: an expired job is not brought back.
        with contextlib.suppress(JobFencedError):
            await self._write_job(job_id, None, {}, fields, None)

    async def append_event(
        self,
        job_id: str,
        type: str,
        data: dict[str, Any],
        fields: dict[str, Any] | None = None,
        *,
        fence: Fence | None = None,
    ) -> str:
        return await self._write_job(job_id, type, data, fields or {}, fence)

    async def _write_job(
        self, job_id: str, type: str | None, data: dict[str, Any], fields: dict[str, Any], fence: Fence | None
    ) -> str:
        ends = fields.get("status") in TERMINAL and self.gateway_id is not None
        args: list[Any] = [
            self._ttl,
            json.dumps(fence[0]) if fence else "",
            json.dumps(fence[1]) if fence else "",
            type or "",
            json.dumps(data),
            MAX_EVENTS,
            job_id if ends else "",
        ]
        for key, value in fields.items():
            args += [key, json.dumps(value)]
        owned = self._owned(self.gateway_id or "-")
        with _reachable():
            ok, answer = await self._write(keys=[self._job(job_id), self._events(job_id), owned], args=args)
        if ok:
            return answer or "0-0"
        if answer == "gone":
            return "0-0"
        raise JobFencedError(job_id, answer)

    @staticmethod
    def _decode(entries: list[tuple[str, dict[str, str]]]) -> list[Event]:
        return [Event(eid, fields.get("t", "?"), json.loads(fields.get("d", "{}"))) for eid, fields in entries]

    async def events(self, job_id: str, after: str | None) -> list[Event]:
        start = "-" if after is None else f"({after}"
        with _reachable():
            entries = await self.redis.xrange(self._events(job_id), start, "+")
            return self._decode(entries)  # type: ignore[arg-type]  # str: the pool decodes (see get)

    async def wait_events(self, job_id: str, after: str | None, timeout: float) -> list[Event]:
        found = await self.events(job_id, after)
        if found or timeout <= 0:
            return found
        return self._decode(await self.reader.wait(self._events(job_id), after or "0-0", timeout))

    def check_event_id(self, event_id: str) -> str:
        m = _EVENT_ID.fullmatch(event_id)
        # Both parts fit in 64 bits, and some id can follow it (an exclusive XRANGE start).
        if m is None or int(m[1]) > _MAX_ID_PART or int(m[2]) > _MAX_ID_PART or m[1] == m[2] == str(_MAX_ID_PART):
            raise InvalidRequestError(
                f"Last-Event-ID must be an event id this server sent (like 1700000000000-0), got {event_id[:40]!r}",
                param="Last-Event-ID",
            )
        return event_id

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False

    # ------------------------------------------------------------------ gateways

    async def start(self, gateway_id: str, on_cancel: Callable[[str], None]) -> None:
        self.gateway_id = gateway_id
        await self.check_commands()
        await self.heartbeat()
        await self.writes.sadd(f"{self.prefix}gws", gateway_id)
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await self._pubsub.subscribe(self._channel(gateway_id))
        except NoPermissionError as e:
            raise ConfigError(f"the Redis user may not run SUBSCRIBE, which the job store needs: {e}") from e
        self._listener = asyncio.create_task(self._listen(on_cancel), name="job-cancel-listener")

    async def _listen(self, on_cancel: Callable[[str], None]) -> None:
        """Cancel signals of this gateway's channel. A lost connection (Redis restarted or
        unreachable) gets a new pub/sub connection and subscription, tried with backoff until
        the store answers: cross-gateway cancel works again without a gateway restart."""
        backoff = Backoff(*RESUBSCRIBE_S)
        while True:
            try:
                if self._pubsub is None:
                    self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    await self._pubsub.subscribe(self._channel(self.gateway_id or "-"))
                    logger.warning("job cancel channel: subscribed again")
                message = await self._pubsub.get_message(timeout=None)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:
                logger.warning("job cancel channel: %s; subscribing again in %g s", e, backoff.delay)
                await self._drop_pubsub()
                await backoff.wait()
                continue
            backoff.reset()
            if message is not None and message.get("type") == "message":
                on_cancel(str(message["data"]))

    async def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def check_commands(self) -> None:
        """Try every command the store sends, harmlessly, on probe keys; a ConfigError names the
        ones this Redis user may not run."""
        probe = f"{self.prefix}probe:{self.gateway_id}"
        sha = hashlib.sha1(_PROBE_SCRIPT.encode()).hexdigest()
        tried = [
            ("ping", lambda p: p.ping()),
            ("hset", lambda p: p.hset(probe, "f", "1")),
            ("hget", lambda p: p.hget(probe, "f")),
            ("hgetall", lambda p: p.hgetall(probe)),
            ("exists", lambda p: p.exists(probe)),
            ("expire", lambda p: p.expire(probe, 10)),
            ("xadd", lambda p: p.xadd(probe + ":s", {"t": "x"}, maxlen=1, approximate=True)),
            ("xrange", lambda p: p.xrange(probe + ":s", "-", "+")),
            ("xread", lambda p: p.xread({probe + ":s": "0-0"}, count=1)),
            ("set", lambda p: p.set(probe + ":l", "1", px=10_000, get=True)),
            ("sadd", lambda p: p.sadd(probe + ":set", "x")),
            ("smembers", lambda p: p.smembers(probe + ":set")),
            ("scard", lambda p: p.scard(probe + ":set")),
            ("srem", lambda p: p.srem(probe + ":set", "x")),
            ("zadd", lambda p: p.zadd(probe + ":z", {"x": 1.0})),
            ("zremrangebyrank", lambda p: p.zremrangebyrank(probe + ":z", 0, -2)),
            ("zrange", lambda p: p.zrange(probe + ":z", 0, 0)),
            ("zrevrange", lambda p: p.zrevrange(probe + ":z", 0, 0)),
            ("zrank", lambda p: p.zrank(probe + ":z", "x")),
            ("zrevrank", lambda p: p.zrevrank(probe + ":z", "x")),
            ("zrem", lambda p: p.zrem(probe + ":z", "x")),
            ("publish", lambda p: p.publish(probe, "probe")),
            ("script", lambda p: p.script_load(_PROBE_SCRIPT)),
            ("evalsha", lambda p: p.evalsha(sha, 0)),
            ("eval", lambda p: p.eval(_PROBE_SCRIPT, 0)),
            ("del", lambda p: p.delete(probe, probe + ":s", probe + ":l", probe + ":set", probe + ":z")),
        ]
        with _reachable():
            async with self.writes.pipeline(transaction=False) as p:
                for _, call in tried:
                    call(p)
                results = await p.execute(raise_on_error=False)
            missing = [name for (name, _), r in zip(tried, results, strict=True) if isinstance(r, NoPermissionError)]
            try:
                async with self.writes.pipeline(transaction=True) as p:
                    p.exists(probe)
                    await p.execute()
            except NoPermissionError:
                missing += ["multi", "exec"]
        if missing:
            raise ConfigError(
                "the Redis user may not run commands the job store needs: "
                + ", ".join(m.upper() for m in missing)
                + " (grant them, e.g. ACL SETUSER <user> "
                + " ".join(f"+{m}" for m in missing)
                + ")"
            )

    async def heartbeat(self) -> bool:
        assert self.gateway_id is not None
        lease_ms = max(100, int(self.lease_s * 1000))
        with _reachable():
            previous = await self.writes.set(self._lease(self.gateway_id), "1", px=lease_ms, get=True)
        return previous is not None

    async def keep_alive(self, job_ids: list[str]) -> None:
        """Renew the TTL of jobs this gateway still runs (a long queue must not expire them)."""
        if not job_ids:
            return
        async with self.writes.pipeline(transaction=False) as p:
            for job_id in job_ids:
                p.expire(self._job(job_id), self._ttl)
                p.expire(self._events(job_id), self._ttl)
            await p.execute()

    async def signal_cancel(self, record: dict[str, Any]) -> None:
        job_id, owner = record["job_id"], record.get("owner")
        await self.update(job_id, {"cancel_requested": True})
        if owner:
            with _reachable():
                await self.writes.publish(self._channel(owner), job_id)

    async def claim_orphans(self) -> list[str]:
        assert self.gateway_id is not None
        claimed: list[str] = []
        gateways: set[str] = await self.writes.smembers(f"{self.prefix}gws")  # type: ignore[assignment]  # decoded
        for gateway in gateways:
            if gateway == self.gateway_id or await self.writes.exists(self._lease(gateway)):
                continue
            ids = await self._claim(
                keys=[self._lease(gateway), self._owned(gateway), self._owned(self.gateway_id), f"{self.prefix}gws"],
                args=[gateway, json.dumps(self.gateway_id), f"{self.prefix}job:"],
            )
            if ids:
                logger.warning("gateway %s is gone; recovering its %d job(s)", gateway, len(ids))
            claimed.extend(ids)
        return claimed

    async def close(self) -> None:
        await self.reader.close()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        await self._drop_pubsub()
        if self.gateway_id is not None:
            with contextlib.suppress(RedisError, OSError):
                # Unfinished jobs stay in this gateway's set; without a lease, the next gateway
                # that looks recovers them at once instead of after the lease runs out.
                await self.writes.delete(self._lease(self.gateway_id))
                if not await self.writes.scard(self._owned(self.gateway_id)):
                    await self.writes.srem(f"{self.prefix}gws", self.gateway_id)
        for client in (self.redis, self.writes, self.reader.redis):
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()
