"""What a stage output is made of, as types: the kinds of output a pipeline can produce, and the
media items (arrays with their metadata) that carry them from a runner to the caller.

The kinds (``image``, ``video``, ``audio``, ``text``, ``tensor``) are declared here once: a stage's
``final_output_type`` (config.py), the ``modalities`` a caller asks for (the engine and the HTTP
protocol) and the encoders (:mod:`omni_runtime.encoders`) all read this module; an item's ``save``
renders through the encoder registry (:mod:`omni_runtime.encoder_registry`), below both. Text and
named tensors travel as the ``text`` and ``tensors`` fields of a
:class:`~omni_runtime.messages.Payload` (text streams as deltas); every other kind is a media item
in ``Payload.media``.

A media item is a tagged msgspec Struct, so a list of them travels on the stage sockets as any
other message part: its array goes through :mod:`omni_runtime.serialization` as a raw buffer
(its own frame, or shared memory for a large one), never copied into the header. A new kind adds
one Struct here, joins it to :data:`MediaItem`, and registers its encoders; the layers between
the runner and the renderer pass items on without looking at their kind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import msgspec
import numpy as np

from omni_runtime.encoder_registry import encode

#: The kinds of output, once for the whole project.
Kind = Literal["image", "video", "audio", "text", "tensor"]
KINDS: tuple[str, ...] = get_args(Kind)
#: What a stage may declare as its ``final_output_type``: a kind, or ``latent`` (the latents of a
#: diffusion stage, which travel as the tensor ``latents``).
OutputType = Literal[Kind, "latent"]
OUTPUT_TYPES: tuple[str, ...] = (*KINDS, "latent")
#: Other names callers use for an output type, and the type each stands for.
ALIASES: dict[str, str] = {"images": "image", "videos": "video", "audios": "audio"}
#: What a caller may name in ``modalities``: an output type or an alias of one.
Modality = Literal[OutputType, "images", "videos", "audios"]


def output_type(name: str) -> str:
    """The output type ``name`` stands for (an alias resolved; anything else unchanged)."""
    return ALIASES.get(name, name)


#: As every message (messages.py): keyword-only, frozen, encoded as an array, not tracked by the
#: cycle collector. Tagged: the tag is the item's kind, so a list of mixed items decodes right.
_Item = {"kw_only": True, "frozen": True, "array_like": True, "gc": False}


class ImageItem(msgspec.Struct, tag="image", **_Item):
    """One image: a uint8 ``HxWx3`` RGB array and what is known of how it was made."""

    kind: ClassVar[str] = "image"

    #: uint8 ``HxWx3``. Between processes the orchestrator may hold it as a shared-memory
    #: reference; every caller-side item holds a numpy array.
    data: Any
    #: The seed of the generator this image was drawn with (None when unknown).
    seed: int | None = None

    @property
    def height(self) -> int:
        return int(self.data.shape[0])

    @property
    def width(self) -> int:
        return int(self.data.shape[1])

    def to_pil(self) -> Any:
        """The image as a PIL image (PIL is imported here, not where the item is made)."""
        from PIL import Image

        return Image.fromarray(np.asarray(self.data))


class VideoItem(msgspec.Struct, tag="video", **_Item):
    """One video: uint8 ``FxHxWx3`` RGB frames, the rate they play at, and how they were made."""

    kind: ClassVar[str] = "video"

    #: uint8 ``FxHxWx3`` (frames, height, width, RGB); as :attr:`ImageItem.data` between processes.
    data: Any
    #: Frames per second a player shows them at.
    fps: int
    #: The seed of the generator this video was drawn with (None when unknown).
    seed: int | None = None

    @property
    def frames(self) -> np.ndarray:
        """The frames, uint8 ``FxHxWx3``."""
        return np.asarray(self.data)

    @property
    def num_frames(self) -> int:
        return int(self.data.shape[0])

    @property
    def height(self) -> int:
        return int(self.data.shape[1])

    @property
    def width(self) -> int:
        return int(self.data.shape[2])

    def save(self, path: str | os.PathLike[str], **options: Any) -> None:
        """Write the video to ``path`` in the format its suffix names (``.mp4``; ``.png`` writes the
        poster frame), through the encoder registry; ``options`` go to the encoder."""
        suffix = Path(path).suffix.lstrip(".").lower()
        if not suffix:
            raise ValueError(f"cannot tell the format of {str(path)!r}: give it a suffix such as .mp4")
        Path(path).write_bytes(encode(self, suffix, **options))


class AudioItem(msgspec.Struct, tag="audio", **_Item):
    """One audio clip: float32 samples in [-1, 1], the rate they play at, and how they were made.

    The layout is always ``channels x n`` (2-D, mono included: ``1 x n``), channel-major as the
    diffusers audio pipelines return it; ``samples`` is that array, ``channels`` its first axis.
    An encoder interleaves the channels itself (a file's frames are ``n x channels``).
    """

    kind: ClassVar[str] = "audio"

    #: float32 ``channels x n``; as :attr:`ImageItem.data` between processes.
    data: Any
    #: Samples per second per channel.
    sample_rate: int
    #: The seed of the generator this clip was drawn with (None when unknown).
    seed: int | None = None

    @property
    def samples(self) -> np.ndarray:
        """The samples, float32 ``channels x n``."""
        return np.asarray(self.data)

    @property
    def channels(self) -> int:
        return int(self.data.shape[0])

    @property
    def num_samples(self) -> int:
        """Samples per channel (``n``)."""
        return int(self.data.shape[1])

    @property
    def duration_s(self) -> float:
        return self.num_samples / self.sample_rate

    def save(self, path: str | os.PathLike[str], **options: Any) -> None:
        """Write the clip to ``path`` in the format its suffix names (``.wav``, ``.flac``,
        ``.mp3``, ``.aac``, ``.opus`` or ``.ogg`` (Opus), ``.pcm``), through the encoder registry;
        ``options`` go to the encoder."""
        suffix = Path(path).suffix.lstrip(".").lower()
        if not suffix:
            raise ValueError(f"cannot tell the format of {str(path)!r}: give it a suffix such as .wav")
        Path(path).write_bytes(encode(self, AUDIO_SUFFIXES.get(suffix, suffix), **options))


#: File suffixes that name an audio format under another name (an Ogg file of Opus).
AUDIO_SUFFIXES: dict[str, str] = {"ogg": "opus"}

#: Every media item; a new kind joins here.
MediaItem = ImageItem | VideoItem | AudioItem


def image_items(floats: Any, seed: float | None = None) -> list[ImageItem]:
    """Images from a pipeline's float output (``NxHxWx3`` in [0, 1]), rounded to uint8 the same way
    for every runner; image ``j`` of a request was drawn with ``seed + j`` (``seed`` comes from the
    metrics, whose values are typed ``float | int``; it is an int)."""
    return [
        ImageItem(data=(x * 255).round().astype(np.uint8), seed=None if seed is None else int(seed) + j)
        for j, x in enumerate(floats)
    ]


def video_items(floats: Any, fps: int, seed: float | None = None) -> list[VideoItem]:
    """Videos from a video pipeline's float output (``NxFxHxWx3`` in [0, 1]), rounded to uint8 as
    :func:`image_items` rounds images; video ``j`` of a request was drawn with ``seed + j``."""
    return [
        VideoItem(
            data=(np.clip(x, 0.0, 1.0) * 255).round().astype(np.uint8),
            fps=int(fps),
            seed=None if seed is None else int(seed) + j,
        )
        for j, x in enumerate(floats)
    ]


def audio_items(floats: Any, sample_rate: int, seed: float | None = None) -> list[AudioItem]:
    """Clips from an audio pipeline's float output (``N x channels x n``, nominally in [-1, 1]),
    clipped to that range as float32; clip ``j`` of a request was drawn with ``seed + j``."""
    return [
        AudioItem(
            data=np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0),
            sample_rate=int(sample_rate),
            seed=None if seed is None else int(seed) + j,
        )
        for j, x in enumerate(floats)
    ]


def items_of(media: list[MediaItem], kind: str) -> list[MediaItem]:
    """The items of one kind, in order."""
    return [m for m in media if m.kind == kind]
