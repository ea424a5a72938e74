"""Media items on the wire, the encoder registry, and how callers read them (``OmniRequestOutput``)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, get_args

import av
import msgspec
import numpy as np
import pytest
import soundfile
from PIL import Image
from pydantic import ValidationError

from entrypoints.async_omni import apply_output
from entrypoints.openai import protocol as proto
from omni_runtime import encoders
from omni_runtime.config import StageConfig
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.media import (
    ALIASES,
    KINDS,
    OUTPUT_TYPES,
    AudioItem,
    ImageItem,
    Modality,
    VideoItem,
    audio_items,
    image_items,
    items_of,
    output_type,
    video_items,
)
from omni_runtime.messages import EngineOutput, Payload, Progress, StageMetrics, StageOutput
from omni_runtime.outputs import OmniRequestOutput, RequestProgress
from omni_runtime.serialization import INLINE_MAX, Encoder, outbound_decoder


def picture(height: int = 24, width: int = 40) -> np.ndarray:
    return (np.arange(height * width * 3) % 251).astype(np.uint8).reshape(height, width, 3)


def roundtrip(msg: StageOutput) -> StageOutput:
    frames = Encoder().encode(msg)
    return outbound_decoder().decode([bytes(f) for f in frames])


# --------------------------------------------------------------------------- items on the wire


def test_an_image_item_travels_with_its_metadata_and_its_array_as_a_frame() -> None:
    image = picture()
    assert image.nbytes >= INLINE_MAX
    msg = StageOutput(request_id="r", payload=Payload(media=[ImageItem(data=image, seed=3)]))
    frames = Encoder().encode(msg)
    assert len(frames) == 2  # the header, and the array as a frame of its own (never copied into it)
    out = outbound_decoder().decode(frames)
    (item,) = out.payload.media
    assert isinstance(item, ImageItem) and item.kind == "image" and item.seed == 3
    assert (item.width, item.height) == (40, 24)
    assert item.data.dtype == np.uint8 and np.array_equal(item.data, image)
    assert not item.data.flags.owndata  # a view over the received frame


def test_items_are_tagged_with_their_kind() -> None:
    header = msgspec.msgpack.decode(Encoder().encode(ImageItem(data=np.zeros((2, 2, 3), np.uint8)))[0])
    assert header[0] == "image"


def test_image_items_round_like_the_pipelines_and_number_seeds_per_image() -> None:
    floats = np.stack([np.full((4, 6, 3), 0.5, np.float32), np.full((4, 6, 3), 1.0, np.float32)])
    items = image_items(floats, seed=10)
    assert [i.seed for i in items] == [10, 11]
    assert items[0].data.dtype == np.uint8 and int(items[0].data[0, 0, 0]) == 128 and int(items[1].data.max()) == 255
    assert [i.seed for i in image_items(floats)] == [None, None]
    assert items_of(items, "image") == items and items_of(items, "video") == []


# --------------------------------------------------------------------------- kinds, declared once


def test_kinds_and_aliases_come_from_one_declaration() -> None:
    assert KINDS == ("image", "video", "audio", "text", "tensor")
    assert set(KINDS) < set(OUTPUT_TYPES) and "latent" in OUTPUT_TYPES
    assert output_type("images") == "image" and output_type("videos") == "video" and output_type("text") == "text"
    assert ALIASES == {"images": "image", "videos": "video", "audios": "audio"}
    assert set(ALIASES) <= set(get_args(Modality))
    for value in OUTPUT_TYPES:
        assert msgspec.convert({"stage_id": 0, "stage_type": "echo", "final_output_type": value}, StageConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"stage_id": 0, "stage_type": "echo", "final_output_type": "smell"}, StageConfig)


def test_http_modalities_take_the_declared_kinds_and_the_alias() -> None:
    messages = [{"role": "user", "content": "x"}]
    for value in ("text", "image", "images"):
        assert proto.ChatCompletionRequest(messages=messages, modalities=[value]).modalities == [value]
    with pytest.raises(ValidationError):
        proto.ChatCompletionRequest(messages=messages, modalities=["smell"])


# --------------------------------------------------------------------------- the encoder registry


@pytest.mark.parametrize("fmt", encoders.formats("image"))
def test_every_image_format_decodes_back_to_the_same_size(fmt: str) -> None:
    item = ImageItem(data=picture(24, 40))
    blob = encoders.encode(item, fmt)
    decoded = Image.open(io.BytesIO(blob))
    assert decoded.size == (40, 24)
    assert Image.MIME[decoded.format] == encoders.media_type("image", fmt)
    if fmt == "png":  # lossless
        assert np.array_equal(np.asarray(decoded.convert("RGB")), item.data)


def test_lossy_formats_take_a_quality() -> None:
    item = ImageItem(data=np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    assert len(encoders.encode(item, "jpeg", quality=10)) < len(encoders.encode(item, "jpeg", quality=95))


def test_an_unknown_format_names_the_registered_ones() -> None:
    with pytest.raises(KeyError, match="png"):
        encoders.encode(ImageItem(data=picture()), "gif")


def test_encode_all_keeps_order_inline_and_in_a_thread() -> None:
    small = [ImageItem(data=picture(8, 8 + i)) for i in range(3)]
    large = [ImageItem(data=picture(600, 600)), ImageItem(data=picture(8, 9))]  # past the inline budget
    for items in (small, large):
        blobs = asyncio.run(encoders.encode_all(items, "png"))
        assert [Image.open(io.BytesIO(b)).size for b in blobs] == [(i.width, i.height) for i in items]


class Smell(msgspec.Struct, frozen=True, kw_only=True):
    """A kind no product code knows: registering its encoder is all it takes to render it."""

    kind: ClassVar[str] = "smell"
    data: str


@pytest.fixture
def smell_and_bmp() -> Iterator[None]:
    encoders.register_encoder("smell", "txt", "text/plain", lambda item, **_: item.data.encode())
    encoders.register_encoder("image", "bmp", "image/bmp", lambda item, **_: b"BM")
    try:
        yield
    finally:
        encoders.unregister_encoder("smell", "txt")
        encoders.unregister_encoder("image", "bmp")


def test_a_registered_kind_and_format_are_what_every_renderer_offers(smell_and_bmp: None) -> None:
    assert encoders.formats("smell") == ("txt",)
    assert encoders.encode(Smell(data="rain"), "txt") == b"rain"  # type: ignore[arg-type]
    # The file store serves what the registry declares, for any kind.
    assert encoders.media_types()["txt"] == "text/plain" and encoders.media_types()["bmp"] == "image/bmp"
    # The images routes and jobs take the registry's image formats.
    assert proto.ImageGenerationRequest(prompt="x", output_format="bmp").output_format == "bmp"
    assert proto.GenerateConfig(output_format="bmp").output_format == "bmp"
    assert encoders.formats("image")[-1] == "bmp"


def test_the_openapi_schema_lists_the_registered_image_formats(smell_and_bmp: None) -> None:
    schema = proto.ImageGenerationRequest.model_json_schema()["properties"]["output_format"]
    assert schema["enum"] == ["png", "jpeg", "webp", "bmp"] and schema["default"] == "png"


def test_a_format_not_registered_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="png"):
        proto.ImageGenerationRequest(prompt="x", output_format="bmp")
    assert "bmp" not in encoders.media_types()


# --------------------------------------------------------------------------- what callers read


def delivered(stage_id: int, payload: Payload, *, finished: bool = True, stage_finished: bool = True) -> EngineOutput:
    return EngineOutput(
        request_id="r", stage_id=stage_id, finished=finished, stage_finished=stage_finished, payload=payload
    )


def test_images_are_pil_images_made_once_from_the_media() -> None:
    out = OmniRequestOutput(request_id="r", stage_id=-1)
    apply_output(out, delivered(1, Payload(media=[ImageItem(data=picture(), seed=4)], metrics=StageMetrics(seed=4))))
    assert out.finished and [m.seed for m in out.media] == [4]
    (image,) = out.images
    assert image.size == (40, 24) and image.mode == "RGB"
    assert out.images[0] is image and out.snapshot().images[0] is image  # made once per output
    assert out.outputs_by_stage[1].images[0] is image


def test_progress_and_stage_done_are_typed() -> None:
    out = OmniRequestOutput(request_id="r", stage_id=-1)
    apply_output(out, delivered(0, Payload(progress=Progress(step=2, steps=5)), finished=False, stage_finished=False))
    assert out.progress == RequestProgress(stage_id=0, step=2, steps=5) and not out.outputs_by_stage
    done = Payload(stage_done=True, metrics=StageMetrics(execution_ms=3.0))
    apply_output(out, delivered(0, done, finished=False, stage_finished=False))
    assert out.progress == RequestProgress(stage_id=0, stage_done=True) and out.metrics == {"execution_ms": 3.0}
    apply_output(out, delivered(1, Payload(text="done")))
    assert out.progress is None and out.text == "done" and out.images == []


def test_stage_metrics_are_a_struct_made_and_read_in_one_place() -> None:
    reported = {"seed": 3, "execution_ms": 2.5, "batch_size": 1.5, "tokens_per_s": 9.0, "time_to_first_step_ms": None}
    metrics = StageMetrics.of(reported)
    assert metrics.seed == 3 and metrics.execution_ms == 2.5 and metrics.time_to_first_step_ms is None
    # A key it does not declare, or a value its field cannot decode, rides in ``extra`` as it is.
    assert metrics.batch_size is None and metrics.extra == {"batch_size": 1.5, "tokens_per_s": 9.0}
    out = roundtrip(StageOutput(request_id="r", payload=Payload(metrics=metrics)))
    assert out.payload.metrics == metrics
    assert metrics.as_dict() == {"seed": 3, "execution_ms": 2.5, "batch_size": 1.5, "tokens_per_s": 9.0}


# --------------------------------------------------------------------------- videos


def clip(frames: int = 9, height: int = 32, width: int = 48) -> np.ndarray:
    """Frames that differ from each other (a moving gradient), so a decoder cannot merge them."""
    base = picture(height, width).astype(np.int32)
    return np.stack([((base + 17 * f) % 256).astype(np.uint8) for f in range(frames)])


def decode_mp4(data: bytes) -> tuple[list[np.ndarray], float, str, str]:
    """What a player reads back: the frames, the frame rate, the codec and the pixel format."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        rate = stream.average_rate
        assert rate is not None
        return frames, float(rate), stream.codec_context.name, str(stream.codec_context.pix_fmt)


def test_a_video_item_travels_tagged_with_its_frames_as_a_frame() -> None:
    frames = clip()
    msg = StageOutput(request_id="r", payload=Payload(media=[VideoItem(data=frames, fps=8, seed=2)]))
    (item,) = roundtrip(msg).payload.media
    assert isinstance(item, VideoItem) and item.kind == "video" and (item.fps, item.seed) == (8, 2)
    assert (item.num_frames, item.height, item.width) == (9, 32, 48)
    assert item.frames.dtype == np.uint8 and np.array_equal(item.frames, frames)
    assert msgspec.msgpack.decode(Encoder().encode(VideoItem(data=frames[:1], fps=1))[0])[0] == "video"


def test_video_items_round_like_images_and_number_seeds_per_video() -> None:
    floats = np.stack([np.full((5, 4, 6, 3), 0.5, np.float32), np.full((5, 4, 6, 3), 1.0, np.float32)])
    items = video_items(floats, fps=12, seed=10)
    assert [(i.seed, i.fps) for i in items] == [(10, 12), (11, 12)]
    assert items[0].frames.shape == (5, 4, 6, 3) and int(items[0].frames[0, 0, 0, 0]) == 128
    assert items_of([*items, ImageItem(data=picture())], "video") == items


def test_mp4_is_h264_that_decodes_to_the_same_frames_size_and_rate() -> None:
    frames = clip()
    data = encoders.encode(VideoItem(data=frames, fps=8), "mp4")
    assert encoders.media_type("video", "mp4") == "video/mp4"
    decoded, fps, codec, pix_fmt = decode_mp4(data)
    assert (len(decoded), fps, codec, pix_fmt) == (9, 8.0, "h264", "yuv420p")
    assert all(f.shape == (32, 48, 3) for f in decoded)
    # Lossy, but close: yuv420p halves the colour resolution; crf 18 keeps the rest.
    assert np.abs(decoded[0].astype(int) - frames[0].astype(int)).mean() < 12


def test_an_odd_size_is_refused_with_the_reason() -> None:
    with pytest.raises(InvalidRequestError, match="even width and height, got 47x32"):
        encoders.encode(VideoItem(data=clip(width=47), fps=8), "mp4")


def test_the_poster_frame_is_the_first_frame_as_png() -> None:
    frames = clip()
    poster = Image.open(io.BytesIO(encoders.encode(VideoItem(data=frames, fps=8), "png")))
    assert poster.format == "PNG" and np.array_equal(np.asarray(poster), frames[0])
    assert "png" in encoders.formats("video") and "mp4" in encoders.formats("video")


def test_encode_all_counts_every_frame_of_a_video() -> None:
    # 9 x 192 x 192 pixels: past the inline budget, so encoded in a worker thread.
    items = [VideoItem(data=clip(9, 192, 192), fps=4), VideoItem(data=clip(5, 16, 16), fps=2)]
    blobs = asyncio.run(encoders.encode_all(items, "mp4"))
    assert [len(decode_mp4(b)[0]) for b in blobs] == [9, 5]


def test_videos_are_the_video_items_and_save_by_suffix(tmp_path: Path) -> None:
    out = OmniRequestOutput(request_id="r", stage_id=-1)
    video = VideoItem(data=clip(), fps=8, seed=1)
    apply_output(out, delivered(0, Payload(media=[video], metrics=StageMetrics(seed=1))))
    assert out.videos == [video] and out.images == [] and out.outputs_by_stage[0].videos == [video]
    out.videos[0].save(tmp_path / "boat.mp4")
    out.videos[0].save(tmp_path / "boat.png")
    assert len(decode_mp4((tmp_path / "boat.mp4").read_bytes())[0]) == 9
    assert Image.open(tmp_path / "boat.png").size == (48, 32)
    with pytest.raises(KeyError, match="no 'gif' encoder for video items"):
        video.save(tmp_path / "boat.gif")
    with pytest.raises(ValueError, match="suffix"):
        video.save(tmp_path / "boat")


# --------------------------------------------------------------------------- audio


def tone(channels: int = 2, n: int = 22_050, rate: int = 22_050) -> np.ndarray:
    """``channels x n`` float32: a different sine per channel, at half scale."""
    t = np.arange(n) / rate
    return np.stack([0.5 * np.sin(2 * np.pi * 220 * (c + 1) * t) for c in range(channels)]).astype(np.float32)


def decode_audio(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """``channels x n`` float32 and the sample rate, decoded by a library other than the one that
    wrote the bytes where there is one (FFmpeg for MP3 and AAC; soundfile for the rest: FFmpeg's
    Opus decoder always outputs 48 kHz, whatever rate the file holds)."""
    if fmt in ("wav", "flac", "opus"):
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return samples.T, int(rate)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray() for f in container.decode(stream)]
        rate = int(stream.codec_context.sample_rate)
    planes = np.concatenate(frames, axis=1)  # planar float: channels x n
    return planes.astype(np.float32), rate


def test_an_audio_item_travels_tagged_with_its_samples_as_a_frame() -> None:
    samples = tone()
    msg = StageOutput(request_id="r", payload=Payload(media=[AudioItem(data=samples, sample_rate=22_050, seed=4)]))
    (item,) = roundtrip(msg).payload.media
    assert isinstance(item, AudioItem) and item.kind == "audio" and (item.sample_rate, item.seed) == (22_050, 4)
    assert (item.channels, item.num_samples, item.duration_s) == (2, 22_050, 1.0)
    assert item.samples.dtype == np.float32 and np.array_equal(item.samples, samples)
    assert msgspec.msgpack.decode(Encoder().encode(AudioItem(data=samples[:1], sample_rate=8000))[0])[0] == "audio"


def test_audio_items_are_clipped_float32_and_number_seeds_per_clip() -> None:
    floats = np.stack([np.full((1, 8), 2.0), np.full((1, 8), -0.25)])  # float64, one past full scale
    items = audio_items(floats, sample_rate=16_000, seed=7)
    assert [(i.seed, i.sample_rate, i.channels, i.num_samples) for i in items] == [(7, 16_000, 1, 8), (8, 16_000, 1, 8)]
    assert items[0].samples.dtype == np.float32 and items[0].samples.max() == 1.0 and items[1].samples[0, 0] == -0.25
    assert items_of([*items, ImageItem(data=picture())], "audio") == items


#: Samples a lossy codec may add at the ends of a clip (AAC's priming and frame padding).
CODEC_PADDING = {"mp3": 1152 * 2, "aac": 1024 * 3, "opus": 960}


@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("fmt", ["wav", "flac", "opus", "mp3", "aac"])
def test_every_audio_format_decodes_back_to_its_rate_channels_and_length(fmt: str, channels: int) -> None:
    samples = tone(channels)
    data = encoders.encode(AudioItem(data=samples, sample_rate=22_050), fmt)
    decoded, rate = decode_audio(data, fmt)
    # Opus codes at 8/12/16/24/48 kHz only: 22.05 kHz is resampled up to 24 kHz.
    expected_rate = 24_000 if fmt == "opus" else 22_050
    expected_n = samples.shape[1] * expected_rate // 22_050
    assert (rate, decoded.shape[0]) == (expected_rate, channels)
    assert expected_n <= decoded.shape[1] <= expected_n + CODEC_PADDING.get(fmt, 0)
    if fmt in ("wav", "flac"):  # 16-bit: within one step of the source
        assert np.abs(decoded - samples).max() <= 1 / 32767 + 1e-6
    else:  # lossy, but the same loudness (a broken encoder makes silence or noise)
        assert abs(float(np.sqrt(np.mean(decoded**2))) - float(np.sqrt(np.mean(samples**2)))) < 0.05


def test_pcm_is_raw_interleaved_16_bit_little_endian() -> None:
    samples = tone(2, n=100)
    data = encoders.encode(AudioItem(data=samples, sample_rate=24_000), "pcm")
    pcm = np.frombuffer(data, dtype="<i2").reshape(-1, 2).T
    assert pcm.shape == (2, 100) and np.abs(pcm / 32767 - samples).max() <= 1 / 32767


def test_audio_media_types_are_what_openai_sends() -> None:
    assert {f: encoders.media_type("audio", f) for f in encoders.formats("audio")} == {
        "wav": "audio/wav",
        "flac": "audio/flac",
        "opus": "audio/ogg",
        "mp3": "audio/mpeg",
        "aac": "audio/aac",
        "pcm": "audio/pcm",
    }


def test_a_clip_that_is_not_channels_by_samples_is_refused() -> None:
    for bad in (np.zeros(8, np.float32), np.zeros((2, 0), np.float32), np.zeros((1, 2, 3), np.float32)):
        with pytest.raises(InvalidRequestError, match=r"shape \(channels, n\)"):
            encoders.encode(AudioItem(data=bad, sample_rate=8000), "wav")
    with pytest.raises(InvalidRequestError, match="mono or stereo"):
        encoders.encode(AudioItem(data=np.zeros((3, 64), np.float32), sample_rate=8000), "mp3")


def test_encode_all_counts_audio_samples_and_keeps_order() -> None:
    # Two seconds of stereo: past the inline budget, so encoded in a worker thread.
    items = [AudioItem(data=tone(2, n=44_100), sample_rate=22_050), AudioItem(data=tone(1, n=50), sample_rate=8000)]
    assert not encoders._inline(items) and encoders._inline(items[1:])
    blobs = asyncio.run(encoders.encode_all(items, "wav"))
    assert [decode_audio(b, "wav")[0].shape for b in blobs] == [(2, 44_100), (1, 50)]


def test_audios_are_the_audio_items_and_save_by_suffix(tmp_path: Path) -> None:
    out = OmniRequestOutput(request_id="r", stage_id=-1)
    clip_ = AudioItem(data=tone(1), sample_rate=22_050, seed=1)
    apply_output(out, delivered(0, Payload(media=[clip_], metrics=StageMetrics(seed=1))))
    assert out.audios == [clip_] and out.videos == [] and out.outputs_by_stage[0].audios == [clip_]
    for suffix in ("wav", "flac", "ogg", "mp3"):
        out.audios[0].save(tmp_path / f"rain.{suffix}")
    assert soundfile.info(str(tmp_path / "rain.wav")).samplerate == 22_050
    assert soundfile.info(str(tmp_path / "rain.ogg")).subtype == "OPUS"
    with pytest.raises(KeyError, match="no 'gif' encoder for audio items"):
        clip_.save(tmp_path / "rain.gif")
