"""The task registry: every task has a kind, fields and a renderer; the capabilities and the job
tasks list exactly the registry's tasks; and the renderers give every surface the same entries."""

from __future__ import annotations

import base64
import io
import json
from typing import get_args

import numpy as np
import pytest
from omni_runtime.entrypoints.capabilities import ModelCapabilities, UnsupportedTaskError
from omni_runtime.entrypoints.openai.protocol import GenerateRequest
from omni_runtime.entrypoints.tasks import (
    AUDIO,
    CAPABILITIES,
    IMAGES,
    JOB_TASKS,
    MESSAGE,
    RENDERERS,
    TASK_NAMES,
    TASKS,
    VIDEOS,
    FileSink,
    MediaRenderer,
    kind_of,
    task,
)
from omni_runtime.entrypoints.tasks.render import PCM_CHUNK_SAMPLES, result_files
from PIL import Image

from omni_runtime import encoders
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.media import AudioItem, ImageItem, VideoItem
from omni_runtime.outputs import OmniRequestOutput, StageResult

pytestmark = pytest.mark.unit

#: The surface each task is asked for on (a job task on /v1/generate too).
SURFACES = {
    "text2image": {"images", "generate", "cli"},
    "image_edit": {"images"},
    "image_variation": {"images"},
    "text2video": {"generate", "cli"},
    "image2video": {"generate", "cli"},
    "text2audio": {"generate", "cli"},
    "text2speech": {"speech", "generate", "cli", "realtime"},
    "chat": {"chat", "realtime"},
}


def test_every_task_has_a_kind_fields_a_format_and_a_renderer_of_its_kind() -> None:
    assert tuple(TASKS) == TASK_NAMES and set(SURFACES) == set(TASKS)
    for name, t in TASKS.items():
        assert t.name == name and task(name) is t
        assert set(t.fields) == SURFACES[name], name
        assert all(m.names() for m in t.fields.values()), name
        assert t.renderer.kind == t.kind == kind_of(name)
        assert t.capability is None or t.capability in CAPABILITIES
        formats = encoders.formats("audio" if t.kind == "text" else t.kind)
        assert t.format in formats and t.format == t.renderer.default_format
        if t.kind != "text":
            assert t.renderer is RENDERERS[t.kind] and t.job == (name in JOB_TASKS)
    assert TASKS["chat"].renderer is MESSAGE and TASKS["chat"].capability is None
    with pytest.raises(KeyError, match="text2image"):
        task("image2audio")


def test_capabilities_and_job_tasks_list_exactly_the_registry() -> None:
    tasks_type = ModelCapabilities.__annotations__["tasks"]
    assert "TaskName" in str(tasks_type)
    # A job's ``task`` (the HTTP schema) is every job task of the registry.
    assert get_args(GenerateRequest.model_fields["task"].annotation) == JOB_TASKS
    assert JOB_TASKS == ("text2image", "text2video", "image2video", "text2audio", "text2speech")
    # Each task's refusal names the capability it needs.
    for name, t in TASKS.items():
        code = UnsupportedTaskError("m", name, ()).code
        assert code == (f"no_{t.capability}" if t.capability else "unsupported_task")
    assert UnsupportedTaskError("m", "text2speech", ()).code == "no_speech"


def _output(*results: StageResult) -> OmniRequestOutput:
    media = [m for r in results for m in r.media]
    return OmniRequestOutput("r", results[-1].stage_id, True, media, outputs_by_stage={r.stage_id: r for r in results})


def _image(seed: int | None = None) -> ImageItem:
    return ImageItem(data=np.full((8, 12, 3), 200, np.uint8), seed=seed)


class _Store:
    def __init__(self) -> None:
        self.files: dict[str, tuple[str, bytes]] = {}

    async def put(self, blob: bytes, media_type: str) -> str:
        file_id = f"file-{len(self.files)}"
        self.files[file_id] = (media_type, blob)
        return file_id


async def test_an_image_entry_is_inline_or_stored_with_its_seed() -> None:
    # Its own seed, else the seed its stage reported.
    outs = [_output(StageResult(0, media=[_image(7)])), _output(StageResult(0, media=[_image()], metrics={"seed": 9}))]
    inline = await IMAGES.render(outs, "jpeg", None, quality=50)
    assert [e["seed"] for e in inline["images"]] == [7, 9] and inline["size"] == "12x8"
    assert Image.open(io.BytesIO(base64.b64decode(inline["images"][0]["b64_json"]))).format == "JPEG"
    store = _Store()
    stored = await IMAGES.render(outs[:1], "png", FileSink(store.put, "http://gw"))
    (entry,) = stored["images"]
    assert entry == {"seed": 7, "url": "http://gw/v1/files/file-0", "file_id": "file-0"}
    assert store.files["file-0"][0] == "image/png" and stored["output_format"] == "png"
    assert result_files(stored) == (IMAGES, [entry]) and result_files({}) == (None, [])


async def test_a_video_is_stored_with_its_poster_and_never_inline() -> None:
    video = VideoItem(data=np.zeros((3, 16, 16, 3), np.uint8), fps=8, seed=1)
    store = _Store()
    result = await VIDEOS.render([_output(StageResult(0, media=[video]))], "mp4", FileSink(store.put, "http://gw"))
    (entry,) = result["videos"]
    assert (entry["num_frames"], entry["fps"], entry["seed"], result["size"]) == (3, 8, 1, "16x16")
    assert store.files[entry["file_id"]][0] == "video/mp4"
    assert store.files[entry["thumbnail_file_id"]][0] == "image/png"
    assert VIDEOS.takes("jpeg") and VIDEOS.output_format("webp") == "mp4" and not VIDEOS.inline
    with pytest.raises(ValueError, match="never inline"):
        await VIDEOS.render([_output(StageResult(0, media=[video]))], "mp4", None)


async def test_audio_pieces_and_entries() -> None:
    clip = AudioItem(data=np.zeros((1, PCM_CHUNK_SAMPLES + 10), np.float32), sample_rate=16_000, seed=3)
    pcm = [p async for p in AUDIO.pieces(clip, "pcm")]
    assert [len(p) for p in pcm] == [2 * PCM_CHUNK_SAMPLES, 20]
    empty = AudioItem(data=np.zeros((1, 0), np.float32), sample_rate=16_000)
    with pytest.raises(InvalidRequestError):  # speech and chat alike: no clip is no audio to send
        await MESSAGE.audio_pieces([empty], "pcm")
    wav = b"".join([p async for p in AUDIO.pieces(clip, "wav", 100)])
    assert wav == encoders.encode(clip, "wav")
    result = await AUDIO.render([_output(StageResult(0, media=[clip]))], "wav", None, quality=10)
    (entry,) = result["audios"]
    assert entry["seed"] == 3 and entry["sample_rate"] == 16_000 and entry["channels"] == 1
    assert result["media_type"] == "audio/wav" and json.dumps(result)
    assert len(await MESSAGE.audio_pieces([clip], "pcm")) == 2
    (part,) = await MESSAGE.image_parts([_image()])
    assert part["image_url"]["url"].startswith("data:image/png;base64,")


def test_the_cli_writes_each_item_as_a_file(tmp_path) -> None:
    renderer: MediaRenderer = TASKS["text2image"].renderer  # type: ignore[assignment]
    paths = renderer.write([_image(), _image()], tmp_path, "image-000", "png")
    assert paths == [str(tmp_path / "image-000.png"), str(tmp_path / "image-000-1.png")]
    assert Image.open(paths[1]).size == (12, 8)
