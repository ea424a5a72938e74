"""The Redis job store (``serve --redis-url``): gateways that share one Redis share their jobs.

Keys (``omni:`` prefix):

* ``job:{id}``: the record, a hash of JSON values, expiring ``ttl_s`` after its last change;
* ``job:{id}:events``: the events, one Redis Stream per job (same TTL). Stream ids are the SSE
  event ids, so ``Last-Event-ID`` replays from any gateway with ``XRANGE`` and ``XREAD BLOCK``
  waits for new ones without polling;
* ``gw:{gateway}``: a gateway's lease, ``lease_s`` long, renewed every ``lease_s / 3``;
* ``gw:{gateway}:jobs``: the unfinished jobs a gateway runs; ``gws``: every gateway with a set;
* channel ``gw:{gateway}:cancel``: cancel requests for a gateway's jobs, from other gateways.

A gateway whose lease ran out (SIGKILL, a lost host) is dead: the first live gateway to notice
claims its jobs in one Lua script (atomic, so no job is claimed twice); the job manager then
re-queues each once, or fails it with ``gateway_lost`` (docs/jobs.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from omni_runtime.exceptions import InvalidRequestError

from .store import TERMINAL, Event, JobStore

logger = logging.getLogger(__name__)

_EVENT_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
#: A Redis Stream id is two unsigned 64-bit integers: a larger part makes Redis fail the read.
_MAX_ID_PART = 2**64 - 1
#: Events kept per job at most (approximate trimming: XADD MAXLEN ~).
MAX_EVENTS = 10_000

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


class RedisJobStore(JobStore):
    """Jobs in Redis, shared by every gateway that uses the same URL and ``prefix``."""

    backend = "redis"

    def __init__(self, url: str, *, ttl_s: float = 3600.0, lease_s: float = 10.0, prefix: str = "omni:") -> None:
        self.url, self.ttl_s, self.lease_s, self.prefix = url, ttl_s, lease_s, prefix
        self._ttl = max(1, int(ttl_s))
        # The read timeout must outlast the longest XREAD BLOCK (an SSE keep-alive period).
        self.redis = aioredis.Redis.from_url(
            url, decode_responses=True, health_check_interval=30, socket_timeout=60, socket_connect_timeout=5
        )
        self.gateway_id: str | None = None
        self._pubsub: Any = None
        self._listener: asyncio.Task | None = None
        self._claim = self.redis.register_script(_CLAIM)

    # ------------------------------------------------------------------ keys

    def _job(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}"

    def _events(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}:events"

    def _lease(self, gateway_id: str) -> str:
        return f"{self.prefix}gw:{gateway_id}"

    def _owned(self, gateway_id: str) -> str:
        return f"{self.prefix}gw:{gateway_id}:jobs"

    def _channel(self, gateway_id: str) -> str:
        return f"{self.prefix}gw:{gateway_id}:cancel"

    # ------------------------------------------------------------------ records and events

    async def create(self, record: dict[str, Any], first_event: tuple[str, dict[str, Any]]) -> str:
        job_id = record["job_id"]
        type_, data = first_event
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(self._job(job_id), mapping={k: json.dumps(v) for k, v in record.items()})
            p.expire(self._job(job_id), self._ttl)
            p.xadd(self._events(job_id), {"t": type_, "d": json.dumps(data)}, maxlen=MAX_EVENTS, approximate=True)
            p.expire(self._events(job_id), self._ttl)
            owner = record.get("owner")
            if owner:
                p.sadd(self._owned(owner), job_id)
            results = await p.execute()
        return results[2]

    async def get(self, job_id: str) -> dict[str, Any] | None:
        fields = await self.redis.hgetall(self._job(job_id))
        if not fields:
            return None
        return {k: json.loads(v) for k, v in fields.items()}

    def _update(self, p: Any, job_id: str, fields: dict[str, Any]) -> None:
        p.hset(self._job(job_id), mapping={k: json.dumps(v) for k, v in fields.items()})
        p.expire(self._job(job_id), self._ttl)
        p.expire(self._events(job_id), self._ttl)
        if fields.get("status") in TERMINAL and self.gateway_id is not None:
            p.srem(self._owned(self.gateway_id), job_id)

    async def update(self, job_id: str, fields: dict[str, Any]) -> None:
        # Only an existing record is updated: an expired job is not brought back half-empty.
        if not await self.redis.exists(self._job(job_id)):
            return
        async with self.redis.pipeline(transaction=True) as p:
            self._update(p, job_id, fields)
            await p.execute()

    async def append_event(
        self, job_id: str, type: str, data: dict[str, Any], fields: dict[str, Any] | None = None
    ) -> str:
        if fields and not await self.redis.exists(self._job(job_id)):
            return "0-0"
        async with self.redis.pipeline(transaction=True) as p:
            p.xadd(self._events(job_id), {"t": type, "d": json.dumps(data)}, maxlen=MAX_EVENTS, approximate=True)
            p.expire(self._events(job_id), self._ttl)
            if fields:
                self._update(p, job_id, fields)
            results = await p.execute()
        return results[0]

    @staticmethod
    def _decode(entries: list[tuple[str, dict[str, str]]]) -> list[Event]:
        return [Event(eid, fields.get("t", "?"), json.loads(fields.get("d", "{}"))) for eid, fields in entries]

    async def events(self, job_id: str, after: str | None) -> list[Event]:
        start = "-" if after is None else f"({after}"
        return self._decode(await self.redis.xrange(self._events(job_id), start, "+"))

    async def wait_events(self, job_id: str, after: str | None, timeout: float) -> list[Event]:
        found = await self.events(job_id, after)
        if found or timeout <= 0:
            return found
        block_ms = max(1, int(min(timeout, 30.0) * 1000))
        got = await self.redis.xread({self._events(job_id): after or "0-0"}, block=block_ms)
        return self._decode(got[0][1]) if got else []

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
        await self.heartbeat()
        await self.redis.sadd(f"{self.prefix}gws", gateway_id)
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(self._channel(gateway_id))
        self._listener = asyncio.create_task(self._listen(on_cancel), name="job-cancel-listener")

    async def _listen(self, on_cancel: Callable[[str], None]) -> None:
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:
                logger.warning("job cancel channel: %s; resubscribing in 1 s", e)
                await asyncio.sleep(1.0)
                continue
            if message is not None and message.get("type") == "message":
                on_cancel(str(message["data"]))

    async def heartbeat(self) -> None:
        assert self.gateway_id is not None
        lease_ms = max(100, int(self.lease_s * 1000))
        await self.redis.set(self._lease(self.gateway_id), "1", px=lease_ms)

    async def keep_alive(self, job_ids: list[str]) -> None:
        """Renew the TTL of jobs this gateway still runs (a long queue must not expire them)."""
        if not job_ids:
            return
        async with self.redis.pipeline(transaction=False) as p:
            for job_id in job_ids:
                p.expire(self._job(job_id), self._ttl)
                p.expire(self._events(job_id), self._ttl)
            await p.execute()

    async def signal_cancel(self, record: dict[str, Any]) -> None:
        job_id, owner = record["job_id"], record.get("owner")
        await self.redis.hset(self._job(job_id), "cancel_requested", "true")
        if owner:
            await self.redis.publish(self._channel(owner), job_id)

    async def claim_orphans(self) -> list[str]:
        assert self.gateway_id is not None
        claimed: list[str] = []
        for gateway in await self.redis.smembers(f"{self.prefix}gws"):
            if gateway == self.gateway_id or await self.redis.exists(self._lease(gateway)):
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
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
        if self.gateway_id is not None:
            with contextlib.suppress(RedisError, OSError):
                # Unfinished jobs stay in this gateway's set; without a lease, the next gateway
                # that looks recovers them at once instead of after the lease runs out.
                await self.redis.delete(self._lease(self.gateway_id))
                if not await self.redis.scard(self._owned(self.gateway_id)):
                    await self.redis.srem(f"{self.prefix}gws", self.gateway_id)
        await self.redis.aclose()
