"""The one place that turns media items into file bytes: a registry of encoders by kind and
format (PNG, JPEG and WebP for images; MP4 and a PNG or WebP poster frame for videos; WAV, FLAC,
Opus, MP3, AAC and raw PCM for audio). The images
routes, chat, jobs, the file store and the CLI all render through it, so a format registered here
is one every one of them can serve.

An encoder is ``fn(item, **options) -> bytes``; the options it understands are its own (the image
encoders take ``quality``, 0-100, for the lossy formats). Encoding is CPU work: :func:`encode_all`
runs a large batch in a worker thread, off the caller's event loop (a video counts every frame's
pixels, so any but the smallest is encoded off it; audio counts its samples, see
:data:`INLINE_ENCODE_SAMPLES`).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

# The registry is encoder_registry.py (below media.py, whose items render through it); its names
# are this module's too.
from omni_runtime.encoder_registry import Encode, encode, register_encoder
from omni_runtime.encoder_registry import Encoder as Encoder
from omni_runtime.encoder_registry import encoder as encoder
from omni_runtime.encoder_registry import formats as formats
from omni_runtime.encoder_registry import media_type as media_type
from omni_runtime.encoder_registry import media_types as media_types
from omni_runtime.encoder_registry import unregister_encoder as unregister_encoder
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.media import AudioItem, ImageItem, MediaItem, VideoItem

#: Items with at most this many pixels in all are encoded inline; more go to a worker thread.
INLINE_ENCODE_PIXELS = 512 * 512
#: Audio samples (all channels) encoded inline; more go to a worker thread. A compressed codec
#: costs more per sample than PNG per pixel: a quarter second of 44.1 kHz stereo stays inline.
INLINE_ENCODE_SAMPLES = 22_050


def _pixels(item: MediaItem) -> int:
    """Pixels to encode: an image's, or every frame's of a video (``FxHxWx3``)."""
    shape: tuple[int, ...] = tuple(getattr(item.data, "shape", ()))
    if len(shape) == 4:
        return int(shape[0]) * int(shape[1]) * int(shape[2])
    return int(shape[0]) * int(shape[1]) if len(shape) >= 2 else 0


def _inline(items: Sequence[MediaItem]) -> bool:
    """Whether encoding ``items`` is cheap enough to do on the caller's event loop."""
    clips = [item for item in items if isinstance(item, AudioItem)]
    if sum(int(np.size(item.data)) for item in clips) > INLINE_ENCODE_SAMPLES:
        return False
    return sum(_pixels(item) for item in items if not isinstance(item, AudioItem)) <= INLINE_ENCODE_PIXELS


async def encode_all(items: Sequence[MediaItem], format: str, **options: Any) -> list[bytes]:
    """Every item as ``format`` bytes, in order: inline when the batch is small, else in a worker
    thread, so that the caller's event loop keeps serving while it runs."""
    if _inline(items):
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


# --------------------------------------------------------------------------- audio

#: The sample rates Opus codes at; a clip at another rate is resampled up to the next of them
#: (44.1 kHz to 48 kHz), or down to 48 kHz from above it, and the file says the rate it holds.
OPUS_RATES = (8_000, 12_000, 16_000, 24_000, 48_000)
#: Bit rate of the lossy formats (MP3, AAC) when none is given: transparent for most listeners.
DEFAULT_AUDIO_BITRATE = 128_000


def _frames(item: AudioItem) -> np.ndarray:
    """``item``'s samples as the ``n x channels`` float32 frames a file holds (channels
    interleaved), clipped to [-1, 1]; refuses what is not a ``channels x n`` clip."""
    samples = np.asarray(item.data)
    if samples.ndim != 2 or samples.shape[0] < 1 or samples.shape[1] < 1:
        raise InvalidRequestError(f"an audio clip needs samples of shape (channels, n), got {samples.shape}")
    if item.sample_rate < 1:
        raise InvalidRequestError(f"an audio clip needs a positive sample rate, got {item.sample_rate}")
    return np.ascontiguousarray(np.clip(samples.astype(np.float32, copy=False), -1.0, 1.0).T)


def _soundfile_encoder(container: str, subtype: str) -> Encode:
    """A lossless (or Opus) file through libsndfile (``soundfile``)."""

    def encode_sound(item: AudioItem) -> bytes:
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, _frames(item), item.sample_rate, format=container, subtype=subtype)
        return buf.getvalue()

    return encode_sound


def opus_rate(sample_rate: int) -> int:
    """The rate an Opus file of a ``sample_rate`` clip holds: the least Opus rate at or above it
    (48 kHz for anything above 48 kHz)."""
    return next((rate for rate in OPUS_RATES if rate >= sample_rate), OPUS_RATES[-1])


def resample(frames: np.ndarray, source: int, target: int) -> np.ndarray:
    """``n x channels`` float32 frames from ``source`` Hz to ``target`` Hz (polyphase filtering:
    exact length ``ceil(n * target / source)``, no phase shift)."""
    if source == target:
        return frames
    from scipy.signal import resample_poly

    gcd = np.gcd(source, target)
    out = resample_poly(frames, target // gcd, source // gcd, axis=0)
    return np.ascontiguousarray(np.clip(out, -1.0, 1.0).astype(np.float32))


def encode_opus(item: AudioItem) -> bytes:
    """An Ogg file of Opus (libsndfile's OGG/OPUS). Opus codes at 8, 12, 16, 24 or 48 kHz only: a
    clip at another rate is resampled to :func:`opus_rate` of it first (so a 44.1 kHz clip is a
    48 kHz file, a few more samples long)."""
    import soundfile

    rate = opus_rate(item.sample_rate)
    frames = resample(_frames(item), item.sample_rate, rate)
    buf = io.BytesIO()
    soundfile.write(buf, frames, rate, format="OGG", subtype="OPUS")
    return buf.getvalue()


def _pyav_encoder(container: str, codec: str) -> Encode:
    """A lossy file through PyAV (FFmpeg's encoders, shipped in PyAV's wheels): ``mp3``
    (libmp3lame) or ``adts`` (a raw AAC stream with ADTS headers, FFmpeg's native AAC encoder)."""

    def encode_lossy(item: AudioItem, bitrate: int | None = None) -> bytes:
        import av

        frames = _frames(item)
        channels = frames.shape[1]
        if channels > 2:
            raise InvalidRequestError(f"{container} encoding takes mono or stereo clips, got {channels} channels")
        layout = "mono" if channels == 1 else "stereo"
        buf = io.BytesIO()
        with av.open(buf, "w", format=container) as out:
            stream = out.add_stream(codec, rate=item.sample_rate, layout=layout)
            assert isinstance(stream, av.AudioStream)
            stream.bit_rate = bitrate or DEFAULT_AUDIO_BITRATE
            # One planar float frame for the whole clip; the encoder cuts it into its own frames
            # (the stream's resampler converts to the sample format the codec takes).
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(frames.T), format="fltp", layout=layout)
            frame.sample_rate = item.sample_rate
            for packet in stream.encode(frame):
                out.mux(packet)
            for packet in stream.encode(None):  # flush what the encoder still holds
                out.mux(packet)
        return buf.getvalue()

    return encode_lossy


def encode_pcm(item: AudioItem) -> bytes:
    """Raw signed 16-bit little-endian samples, channels interleaved, no header (OpenAI's
    ``pcm``): the rate and channel count are the caller's to know."""
    pcm = np.round(_frames(item) * 32767.0).astype("<i2")
    return pcm.tobytes()


register_encoder("audio", "wav", "audio/wav", _soundfile_encoder("WAV", "PCM_16"))
register_encoder("audio", "flac", "audio/flac", _soundfile_encoder("FLAC", "PCM_16"))
register_encoder("audio", "opus", "audio/ogg", encode_opus)
register_encoder("audio", "mp3", "audio/mpeg", _pyav_encoder("mp3", "libmp3lame"))
register_encoder("audio", "aac", "audio/aac", _pyav_encoder("adts", "aac"))
register_encoder("audio", "pcm", "audio/pcm", encode_pcm)
