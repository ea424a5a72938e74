"""The stores behind ``/v1/files/{id}`` for generated files: in this process (:class:`FileStore`),
or in Redis with ``--redis-url`` (:class:`RedisFileStore`), where every gateway on the same Redis
serves every gateway's files. A file is stored with the media type its encoder declares
(omni_runtime/encoders.py, the one renderer of media items). Runs on the server's event loop."""

from __future__ import annotations

import re
import secrets
import time
from collections import OrderedDict

from redis.exceptions import RedisError

from omni_runtime.exceptions import UnavailableError

from .protocol import ApiError

#: A file id: ``file-`` and the 24 characters of ``secrets.token_urlsafe(18)``.
FILE_ID = re.compile(r"file-[A-Za-z0-9_-]{24}")
#: Largest file kept in Redis (a value of one key; larger images are refused, not truncated).
MAX_REDIS_FILE_BYTES = 16 * 1024 * 1024


def _new_file_id() -> str:
    return "file-" + secrets.token_urlsafe(18)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"the image is larger than the file store takes ({limit} bytes); use response_format=b64_json",
        param="response_format", code="file_too_large",
    )  # fmt: skip


class FileStore:
    """Generated files behind ``/v1/files/{id}``: in memory, each kept ``ttl_s`` seconds, at most
    ``max_bytes`` in all (oldest dropped first). Expiry is checked on access, so nothing polls."""

    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self._files: OrderedDict[str, tuple[float, str, bytes]] = OrderedDict()
        self._bytes = 0

    def _drop_oldest(self) -> None:
        _, (_, _, data) = self._files.popitem(last=False)
        self._bytes -= len(data)

    async def put(self, data: bytes, media_type: str) -> str:
        if len(data) > self.max_bytes:
            raise _too_large(self.max_bytes)
        now = time.monotonic()
        # Every file lives ttl_s, so insertion order is expiry order.
        while self._files and (next(iter(self._files.values()))[0] <= now or self._bytes + len(data) > self.max_bytes):
            self._drop_oldest()
        file_id = _new_file_id()
        self._files[file_id] = (now + self.ttl_s, media_type, data)
        self._bytes += len(data)
        return file_id

    async def get(self, file_id: str) -> tuple[str, bytes, float] | None:
        """(media type, bytes, seconds left), or None when missing or expired."""
        entry = self._files.get(file_id)
        if entry is None:
            return None
        expires, media_type, data = entry
        left = expires - time.monotonic()
        if left <= 0:
            self._bytes -= len(self._files.pop(file_id)[2])
            return None
        return media_type, data, left

    async def delete(self, file_ids: list[str]) -> None:
        """Remove files now (ids that are gone already are skipped)."""
        for file_id in file_ids:
            entry = self._files.pop(file_id, None)
            if entry is not None:
                self._bytes -= len(entry[2])

    def __len__(self) -> int:
        return len(self._files)

    async def close(self) -> None:
        self._files.clear()


class RedisFileStore:
    """Generated files in Redis (``{prefix}file:{id}``, a hash of the media type and the bytes),
    each expiring ``ttl_s`` seconds after it was stored, at most ``max_file_bytes`` each: any
    gateway on the same Redis serves any gateway's files, also after that gateway is gone. Its
    own small connection pool (``max_connections``), apart from the job store's."""

    def __init__(
        self,
        url: str,
        ttl_s: float,
        max_file_bytes: int,
        *,
        prefix: str = "omni:",
        max_connections: int = 8,
        timeout_s: float = 2.0,
    ) -> None:
        import redis.asyncio as aioredis

        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.max_file_bytes, self.prefix = max_file_bytes, prefix
        # Short timeouts like the job store's (--redis-timeout) plus the time to move the largest
        # file: an unreachable Redis is a 503 at once, not a request that waits on a socket.
        timeout = timeout_s + max_file_bytes / 50e6
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, socket_timeout=timeout,
            socket_connect_timeout=timeout_s,
        )  # fmt: skip
        self.redis = aioredis.Redis(connection_pool=pool)

    def _key(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}"

    async def put(self, data: bytes, media_type: str) -> str:
        """Store a file; UnavailableError while Redis cannot be reached (nothing stored)."""
        if len(data) > self.max_file_bytes:
            raise _too_large(self.max_file_bytes)
        file_id = _new_file_id()
        try:
            async with self.redis.pipeline(transaction=True) as p:
                p.hset(self._key(file_id), mapping={"t": media_type, "d": data})
                p.pexpire(self._key(file_id), self.ttl_ms)
                await p.execute()
        except (RedisError, OSError) as e:
            raise UnavailableError(f"the file store cannot be reached: {e}", retry_after_s=2.0) from e
        return file_id

    async def get(self, file_id: str) -> tuple[str, bytes, float] | None:
        try:
            async with self.redis.pipeline(transaction=True) as p:
                p.hmget(self._key(file_id), ["t", "d"])
                p.pttl(self._key(file_id))
                (media_type, data), left_ms = await p.execute()
        except (RedisError, OSError) as e:
            raise UnavailableError(f"the file store cannot be reached: {e}", retry_after_s=2.0) from e
        if media_type is None or data is None or left_ms <= 0:
            return None
        return media_type.decode(), data, left_ms / 1000.0

    async def delete(self, file_ids: list[str]) -> None:
        """Remove files now, for every gateway; UnavailableError while Redis cannot be reached."""
        if not file_ids:
            return
        try:
            await self.redis.delete(*(self._key(f) for f in file_ids))
        except (RedisError, OSError) as e:
            raise UnavailableError(f"the file store cannot be reached: {e}", retry_after_s=2.0) from e

    async def close(self) -> None:
        await self.redis.aclose()
