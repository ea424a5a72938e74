"""What each bundled model can do, worked out once from its config (no model loaded), and what
its READY constraints add; the refusal of a task it cannot do names the model and what it serves."""

from __future__ import annotations

import pytest
from omni_runtime.entrypoints.async_omni import load_resolved
from omni_runtime.entrypoints.capabilities import ModelCapabilities, UnsupportedTaskError

from omni_runtime.messages import StageConstraints

pytestmark = pytest.mark.unit

IMAGE_TASKS = ("text2image", "image_edit", "image_variation", "chat")


@pytest.mark.parametrize(
    ("config", "tasks", "kinds"),
    [
        ("tiny-sd", IMAGE_TASKS, ("image",)),
        ("tiny-sd-split", IMAGE_TASKS, ("image",)),
        ("tiny-wan", ("text2video", "image2video", "chat"), ("video",)),
        ("tiny-stable-audio", ("text2audio", "chat"), ("audio",)),
        ("tiny-tts", ("text2speech", "chat"), ("audio",)),
        ("tiny-omni-speech", ("text2speech", "chat"), ("audio", "text")),
        ("tiny-qwen-omni", ("text2speech", "chat"), ("audio", "text")),
        ("tiny-omni-voice", ("text2speech", "chat"), ("audio", "text")),
        ("echo", ("chat",), ("text",)),
    ],
)
def test_tasks_and_kinds_of_each_bundled_model(config: str, tasks: tuple[str, ...], kinds: tuple[str, ...]) -> None:
    resolved = load_resolved(config, {})
    caps = ModelCapabilities.of(resolved)
    assert (caps.tasks, caps.kinds) == (tasks, kinds)
    finals = {s.stage_id for s in resolved.stages if s.config.final_output}
    assert set(caps.stages.values()) <= finals  # each task is served by a final stage
    assert caps.generate_tasks() == [t for t in tasks if t not in ("image_edit", "image_variation", "chat")]


def test_chunked_speech_and_what_a_load_adds() -> None:
    assert ModelCapabilities.of(load_resolved("tiny-omni-speech-chunked", {})).chunked_speech
    caps = ModelCapabilities.of(load_resolved("tiny-tts", {}))
    assert not caps.chunked_speech and caps.voices == ()
    loaded = caps.loaded(
        {0: StageConstraints(voices=("b", "a"), cache_types=("mag",), lora=True, frames_step=4, max_frames=81)},
        1024,
    )
    assert (loaded.voices, loaded.cache_types, loaded.lora, loaded.max_input_pixels) == (
        ("a", "b"),
        ("mag",),
        True,
        1024,
    )
    assert (loaded.frames_step, loaded.max_frames, loaded.tasks) == (4, 81, caps.tasks)


def test_a_task_it_cannot_do_names_the_model_and_what_it_serves() -> None:
    caps = ModelCapabilities.of(load_resolved("tiny-sd", {}))
    assert caps.require("sd", "text2image") == caps.stage("text2image")
    with pytest.raises(UnsupportedTaskError) as err:
        caps.require("sd", "text2speech")
    assert str(err.value) == (
        "the model `sd` cannot do `text2speech`; it serves `text2image`, `image_edit`, `image_variation`, `chat`"
    )
    assert err.value.code == "no_speech"
