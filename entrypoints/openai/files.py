"""Generated images: encoding (PNG, JPEG, WebP) and the in-memory store behind ``/v1/files/{id}``."""

from __future__ import annotations

import asyncio
import io
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from .protocol import ApiError

#: Images larger than this are encoded in a worker thread, off the event loop.
_INLINE_ENCODE_PIXELS = 512 * 512
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(image: Any, fmt: str, quality: int | None) -> bytes:
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG")
    else:  # JPEG has no alpha channel
        image.convert("RGB").save(buf, format=fmt.upper(), quality=90 if quality is None else quality)
    return buf.getvalue()


async def encode_images(images: Sequence[Any], fmt: str, quality: int | None) -> list[bytes]:
    if sum(img.width * img.height for img in images) <= _INLINE_ENCODE_PIXELS:
        return [encode_image(img, fmt, quality) for img in images]
    return await asyncio.to_thread(lambda: [encode_image(img, fmt, quality) for img in images])


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

    def put(self, data: bytes, media_type: str) -> str:
        if len(data) > self.max_bytes:
            raise ApiError(
                413, "the image is larger than the file store; use response_format=b64_json",
                param="response_format", code="file_too_large",
            )  # fmt: skip
        now = time.monotonic()
        # Every file lives ttl_s, so insertion order is expiry order.
        while self._files and (next(iter(self._files.values()))[0] <= now or self._bytes + len(data) > self.max_bytes):
            self._drop_oldest()
        file_id = "file-" + secrets.token_urlsafe(18)
        self._files[file_id] = (now + self.ttl_s, media_type, data)
        self._bytes += len(data)
        return file_id

    def get(self, file_id: str) -> tuple[str, bytes, float] | None:
        entry = self._files.get(file_id)
        if entry is None:
            return None
        expires, media_type, data = entry
        left = expires - time.monotonic()
        if left <= 0:
            self._bytes -= len(self._files.pop(file_id)[2])
            return None
        return media_type, data, left

    def __len__(self) -> int:
        return len(self._files)
