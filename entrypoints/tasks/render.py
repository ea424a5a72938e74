"""How a result's media become what a surface sends: one renderer per media kind (images, videos
with their poster, audio), over the encoder registry (:mod:`omni_runtime.encoders`, the one
place that turns a media item into file bytes), and the chat message's parts made from them.

Every surface renders through these: the images routes and ``/v1/generate`` jobs (an entry per
item, inline as base64 or stored in the file store: :meth:`MediaRenderer.render`), speech and
chat (audio :meth:`AudioRenderer.pieces` for a stream, image parts as data URLs), SSE and the
WebSocket (the job's rendered result, or those pieces as base64), ``GET /v1/jobs/{id}/content``
(a result entry back to bytes: :func:`result_files`) and ``omni-runtime generate``'s files
(:meth:`MediaRenderer.write`)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni_runtime import encoders
from omni_runtime.media import AudioItem, ImageItem, MediaItem, VideoItem, items_of
from omni_runtime.outputs import OmniRequestOutput

#: Samples per piece of a raw PCM stream (a quarter second at 16 kHz): speech and chat deltas.
PCM_CHUNK_SAMPLES = 4096


def b64(blob: bytes) -> str:
    """``blob`` as base64 text (``b64_json``, an SSE delta, a data URL's payload)."""
    return base64.b64encode(blob).decode()


#: Where an item's bytes are: ``{"url", "file_id"}`` or ``{"b64_json"}``.
Placed = dict[str, Any]


@dataclass(frozen=True)
class FileSink:
    """Where a ``url`` result's files go: a store's ``put(bytes, media type) -> file id`` and the
    base URL ``/v1/files/{id}`` is served under."""

    put: Callable[[bytes, str], Awaitable[str]]
    base_url: str

    def url(self, file_id: str) -> str:
        return f"{self.base_url}/v1/files/{file_id}"


class MediaRenderer:
    """One media kind: its items in an output, their file bytes in a format, and a result's entry
    per item (``seed``, what the kind adds, then ``url`` and ``file_id`` or ``b64_json``)."""

    #: The media kind (omni_runtime.media), a result's list of entries and the type of its items.
    kind = ""
    key = ""
    item_type: type = object
    #: The format when a request names none.
    default_format = ""
    #: Whether an entry may carry its bytes inline (``b64_json``); else it is always stored.
    inline = True
    #: The encoder options a request may set (``quality``).
    options: tuple[str, ...] = ()

    def formats(self) -> tuple[str, ...]:
        return encoders.formats(self.kind)

    def takes(self, fmt: str) -> bool:
        """Whether a request may ask for ``fmt``."""
        return fmt in self.formats()

    def output_format(self, requested: str | None) -> str:
        """The format a result is made in: the one asked for, else the default."""
        return requested or self.default_format

    def media_type(self, fmt: str) -> str:
        return encoders.media_type(self.kind, fmt)

    def items(self, media: Sequence[MediaItem]) -> list[Any]:
        return [item for item in items_of(list(media), self.kind) if isinstance(item, self.item_type)]

    def seeded(self, outs: Sequence[OmniRequestOutput]) -> list[tuple[Any, int | None]]:
        """Every item of ``outs`` (in order, each in its ``media``'s order) with its seed: the
        item's own, else the seed its stage reported."""
        return [
            (item, item.seed if item.seed is not None else result.metrics.get("seed"))
            for out in outs
            for result in out.outputs_by_stage.values()
            for item in self.items(result.media)
        ]

    async def encode(self, items: Sequence[MediaItem], fmt: str, **options: Any) -> list[bytes]:
        return await encoders.encode_all(items, fmt, **options)

    def describe(self, item: Any) -> dict[str, Any]:
        """What an entry says of its item besides the seed and the bytes."""
        return {}

    def summary(self, items: Sequence[Any], fmt: str) -> dict[str, Any]:
        """What a result says of all its items besides their entries and the format."""
        return {}

    async def files(self, items: Sequence[Any], fmt: str, sink: FileSink | None, **options: Any) -> list[Placed]:
        """Where each item's bytes are: ``url`` and ``file_id`` in ``sink``, or ``b64_json``.
        Of ``options``, the encoder gets those of :attr:`options` that are set."""
        taken = {k: v for k, v in options.items() if k in self.options and v is not None}
        blobs = await self.encode(items, fmt, **taken)
        if sink is None:
            return [{"b64_json": b64(blob)} for blob in blobs]
        placed = []
        for blob in blobs:
            file_id = await sink.put(blob, self.media_type(fmt))
            placed.append({"url": sink.url(file_id), "file_id": file_id})
        return placed

    async def render(
        self, outs: Sequence[OmniRequestOutput], fmt: str, sink: FileSink | None, **options: Any
    ) -> dict[str, Any]:
        """The items of ``outs`` (one request's output, or the ``n`` of an images call) as
        ``{key: [entry per item], "output_format": fmt, ...summary}``; ``sink`` None: inline (a
        kind that is never inline needs one)."""
        seeded = self.seeded(outs)
        items = [item for item, _ in seeded]
        placed = await self.files(items, fmt, sink, **options)
        entries = [
            {"seed": seed, **self.describe(item), **where} for (item, seed), where in zip(seeded, placed, strict=True)
        ]
        return {self.key: entries, "output_format": fmt, **self.summary(items, fmt)}

    def write(self, items: Sequence[MediaItem], folder: Path, stem: str, fmt: str) -> list[str]:
        """Each item as a ``fmt`` file in ``folder`` (``stem.fmt``, then ``stem-1.fmt``...); the paths."""
        paths = []
        for j, item in enumerate(items):
            path = folder / f"{stem}{f'-{j}' if j else ''}.{fmt}"
            path.write_bytes(encoders.encode(item, fmt))
            paths.append(str(path))
        return paths


def _size(items: Sequence[Any]) -> dict[str, Any]:
    return {"size": f"{items[0].width}x{items[0].height}" if items else None}


class ImageRenderer(MediaRenderer):
    kind, key, item_type, default_format = "image", "images", ImageItem, "png"
    options = ("quality",)

    def summary(self, items: Sequence[Any], fmt: str) -> dict[str, Any]:
        return _size(items)

    async def data_urls(self, media: Sequence[MediaItem], fmt: str = "png") -> list[str]:
        """The images among ``media`` as ``data:`` URLs (a chat answer's image parts)."""
        prefix = f"data:{self.media_type(fmt)};base64,"
        return [prefix + b64(blob) for blob in await self.encode(self.items(media), fmt)]


class VideoRenderer(MediaRenderer):
    """Always stored: each video an MP4 file and its poster (the first frame) beside it."""

    kind, key, item_type, default_format = "video", "videos", VideoItem, "mp4"
    inline = False
    #: The format of a video's poster (the encoder registry's poster encoder).
    poster_format = "png"

    def takes(self, fmt: str) -> bool:
        return True  # a video is always MP4: a format named for another kind is not used

    def output_format(self, requested: str | None) -> str:
        return self.default_format

    async def files(self, items: Sequence[Any], fmt: str, sink: FileSink | None, **options: Any) -> list[Placed]:
        if sink is None:
            raise ValueError("videos are stored, never inline: a file sink is needed")
        videos = await super().files(items, fmt, sink)
        posters = await super().files(items, self.poster_format, sink)
        return [video | {"thumbnail_file_id": poster["file_id"]} for video, poster in zip(videos, posters, strict=True)]

    def describe(self, item: Any) -> dict[str, Any]:
        return {"num_frames": item.num_frames, "fps": item.fps}

    def summary(self, items: Sequence[Any], fmt: str) -> dict[str, Any]:
        return _size(items)


class AudioRenderer(MediaRenderer):
    kind, key, item_type, default_format = "audio", "audios", AudioItem, "wav"

    def describe(self, item: Any) -> dict[str, Any]:
        return {"sample_rate": item.sample_rate, "channels": item.channels, "duration_s": round(item.duration_s, 6)}

    def summary(self, items: Sequence[Any], fmt: str) -> dict[str, Any]:
        return {"media_type": self.media_type(fmt)}

    async def pieces(self, clip: AudioItem, fmt: str, file_bytes: int | None = None) -> AsyncIterator[bytes]:
        """``clip`` as ``fmt`` bytes in the pieces a stream sends: ``pcm`` as the samples, in
        :data:`PCM_CHUNK_SAMPLES` (at least one piece), another format as its whole file, cut in
        ``file_bytes`` pieces when given."""
        if fmt == "pcm":
            for start in range(0, max(clip.num_samples, 1), PCM_CHUNK_SAMPLES):
                part = AudioItem(data=clip.samples[:, start : start + PCM_CHUNK_SAMPLES], sample_rate=clip.sample_rate)
                yield (await self.encode([part], fmt))[0]
            return
        blob = (await self.encode([clip], fmt))[0]
        step = file_bytes or max(len(blob), 1)
        for start in range(0, max(len(blob), 1), step):
            yield blob[start : start + step]

    def pcm16_pieces(self, clip: AudioItem, rate: int) -> list[bytes]:
        """``clip`` as mono 16-bit PCM at ``rate`` Hz (channels averaged, resampled), in pieces of
        :data:`PCM_CHUNK_SAMPLES` at that rate: a realtime session's audio deltas. On the caller's
        thread (a chunk of speech takes well under a millisecond)."""
        mono = clip.samples.mean(axis=0, keepdims=True).astype("float32")
        frames = encoders.resample(np.ascontiguousarray(mono.T), clip.sample_rate, rate)
        item = AudioItem(data=np.ascontiguousarray(frames.T), sample_rate=rate)
        blob = encoders.encode(item, "pcm")
        step = 2 * PCM_CHUNK_SAMPLES
        return [blob[start : start + step] for start in range(0, len(blob), step)]


IMAGES, VIDEOS, AUDIO = ImageRenderer(), VideoRenderer(), AudioRenderer()
#: Every media renderer, by kind.
RENDERERS: dict[str, MediaRenderer] = {r.kind: r for r in (IMAGES, VIDEOS, AUDIO)}


class MessageRenderer:
    """A chat answer: text, with the images and audio a model makes as parts of the message
    (images as PNG data URLs, audio as base64 of :data:`default_format` unless asked otherwise)."""

    kind = "text"
    default_format = AUDIO.default_format
    images, audio = IMAGES, AUDIO

    async def image_parts(self, media: Sequence[MediaItem]) -> list[dict[str, Any]]:
        """The images among ``media`` as ``image_url`` content parts."""
        return [{"type": "image_url", "image_url": {"url": url}} for url in await self.images.data_urls(media)]

    async def audio_pieces(self, clips: Sequence[AudioItem], fmt: str) -> list[str]:
        """``clips`` as the base64 pieces of ``delta.audio`` (see :meth:`AudioRenderer.pieces`)."""
        return [b64(piece) for clip in clips async for piece in self.audio.pieces(clip, fmt)]

    async def audio_file(self, clip: AudioItem, fmt: str) -> str:
        """``clip`` as one base64 file (``message.audio``)."""
        return b64((await self.audio.encode([clip], fmt))[0])


MESSAGE = MessageRenderer()


def result_files(result: dict[str, Any]) -> tuple[MediaRenderer | None, list[dict[str, Any]]]:
    """A rendered result's renderer and entries (``images``, ``videos`` or ``audios``)."""
    for renderer in RENDERERS.values():
        if renderer.key in result:
            return renderer, list(result[renderer.key])
    return None, []
