"""The one place that turns media items into file bytes: a registry of encoders by kind and
format (PNG, JPEG and WebP for images; MP4 and a PNG or WebP poster frame for videos). The images
routes, chat, jobs, the file store and the CLI all render through it, so a format registered here
is one every one of them can serve.

An encoder is ``fn(item, **options) -> bytes``; the options it understands are its own (the image
encoders take ``quality``, 0-100, for the lossy formats). Encoding is CPU work: :func:`encode_all`
runs a large batch in a worker thread, off the caller's event loop (a video counts every frame's
pixels, so any but the smallest is encoded off it).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.media import ImageItem, MediaItem, VideoItem

#: Items with at most this many pixels in all are encoded inline; more go to a worker thread.
INLINE_ENCODE_PIXELS = 512 * 512

Encode = Callable[..., bytes]


@dataclass(frozen=True)
class Encoder:
    """One registered format of one kind."""

    kind: str
    format: str
    media_type: str
    fn: Encode


_REGISTRY: dict[str, dict[str, Encoder]] = {}


def register_encoder(kind: str, format: str, media_type: str, fn: Encode) -> None:
    """Make ``format`` available for items of ``kind`` (a later registration replaces one of the
    same kind and format)."""
    _REGISTRY.setdefault(kind, {})[format] = Encoder(kind, format, media_type, fn)


def unregister_encoder(kind: str, format: str) -> None:
    """Remove a format (tests that register a throwaway one)."""
    formats = _REGISTRY.get(kind, {})
    formats.pop(format, None)
    if not formats:
        _REGISTRY.pop(kind, None)


def formats(kind: str) -> tuple[str, ...]:
    """The formats items of ``kind`` can be encoded to, in registration order."""
    return tuple(_REGISTRY.get(kind, {}))


def media_type(kind: str, format: str) -> str:
    """The media type (``image/png``) of ``format`` for ``kind``; KeyError if not registered."""
    return encoder(kind, format).media_type


def media_types() -> dict[str, str]:
    """Every registered format's media type by format name (what a file store serves)."""
    return {e.format: e.media_type for kinds in _REGISTRY.values() for e in kinds.values()}


def encoder(kind: str, format: str) -> Encoder:
    try:
        return _REGISTRY[kind][format]
    except KeyError:
        raise KeyError(f"no {format!r} encoder for {kind} items; registered: {list(formats(kind))}") from None


def encode(item: MediaItem, format: str, **options: Any) -> bytes:
    """``item`` as the bytes of a ``format`` file."""
    return encoder(item.kind, format).fn(item, **options)


def _pixels(item: MediaItem) -> int:
    """Pixels to encode: an image's, or every frame's of a video (``FxHxWx3``)."""
    shape: tuple[int, ...] = tuple(getattr(item.data, "shape", ()))
    if len(shape) == 4:
        return int(shape[0]) * int(shape[1]) * int(shape[2])
    return int(shape[0]) * int(shape[1]) if len(shape) >= 2 else 0


async def encode_all(items: Sequence[MediaItem], format: str, **options: Any) -> list[bytes]:
    """Every item as ``format`` bytes, in order: inline when the batch is small, else in a worker
    thread, so that the caller's event loop keeps serving while it runs."""
    if sum(_pixels(item) for item in items) <= INLINE_ENCODE_PIXELS:
        return [encode(item, format, **options) for item in items]
    return await asyncio.to_thread(lambda: [encode(item, format, **options) for item in items])


# --------------------------------------------------------------------------- images


def _image_encoder(pil_format: str) -> Encode:
    def encode_image(item: ImageItem, quality: int | None = None) -> bytes:
        buf = io.BytesIO()
        image = item.to_pil()
        if pil_format == "PNG":  # lossless: no quality
            image.save(buf, format="PNG")
        else:  # JPEG has no alpha channel
            image.convert("RGB").save(buf, format=pil_format, quality=90 if quality is None else quality)
        return buf.getvalue()

    return encode_image


register_encoder("image", "png", "image/png", _image_encoder("PNG"))
register_encoder("image", "jpeg", "image/jpeg", _image_encoder("JPEG"))
register_encoder("image", "webp", "image/webp", _image_encoder("WEBP"))


# --------------------------------------------------------------------------- videos

#: x264's constant rate factor when none is given: visually near-lossless at a modest size.
DEFAULT_CRF = 18


def encode_mp4(item: VideoItem, crf: int | None = None, preset: str = "medium") -> bytes:
    """An MP4 file (H.264, yuv420p: what every browser and player plays) of ``item``'s frames at
    its fps, encoded in memory through PyAV (FFmpeg's libx264, shipped in PyAV's wheels).

    yuv420p halves the chroma planes, so H.264 takes even sizes only: an odd height or width is
    refused (the diffusion families' size steps are all even, so a generated video never is odd).
    """
    import av

    frames = np.ascontiguousarray(item.frames, dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[3] != 3 or frames.shape[0] < 1:
        raise InvalidRequestError(f"an MP4 needs uint8 frames of shape (frames, height, width, 3), got {frames.shape}")
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise InvalidRequestError(
            f"an H.264 MP4 (yuv420p) needs an even width and height, got {width}x{height}", param="size"
        )
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(item.fps))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(DEFAULT_CRF if crf is None else crf), "preset": preset}
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the frames the encoder still holds
            container.mux(packet)
    return buf.getvalue()


def _poster_encoder(pil_format: str) -> Encode:
    """The first frame of a video as an image file (a thumbnail a page shows before playing)."""
    still = _image_encoder(pil_format)

    def encode_poster(item: VideoItem, quality: int | None = None) -> bytes:
        return still(ImageItem(data=item.frames[0], seed=item.seed), quality=quality)

    return encode_poster


register_encoder("video", "mp4", "video/mp4", encode_mp4)
register_encoder("video", "png", "image/png", _poster_encoder("PNG"))
register_encoder("video", "webp", "image/webp", _poster_encoder("WEBP"))
