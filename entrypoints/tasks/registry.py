"""The task registry: every task a route, a job or the CLI asks a model for, once, with what it
makes, what a model needs to serve it, its field tables per surface and how its result is
rendered. ``ModelCapabilities`` works out which tasks a model serves from it, the routes and the
jobs check and build requests from it, and ``omni-runtime generate`` picks its task and writes
its files from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from omni_runtime.bounds import MAX_SPEECH_CHARS

from ..openai.fields import FieldMap
from . import fields as f
from .render import AUDIO, IMAGES, MESSAGE, VIDEOS, MediaRenderer, MessageRenderer

if TYPE_CHECKING:
    from ..async_omni import AsyncOmni

#: Every task's name, in registry order (a route's model dependency is typed with it).
TaskName = Literal[
    "text2image",
    "image_edit",
    "image_variation",
    "text2video",
    "image2video",
    "text2audio",
    "text2speech",
    "chat",
]
#: What a task needs a model's final stages to have: an image, video, diffusion audio or speech
#: stage (``ModelCapabilities.of`` finds each); a task that needs none is served by any final stage.
Capability = Literal["image", "video", "audio", "speech"]
CAPABILITIES: tuple[str, ...] = get_args(Capability)


@dataclass(frozen=True)
class Task:
    """One task (see the module docstring)."""

    name: TaskName
    #: The media kind it makes (``text`` for chat, whose images and audio are parts of its message).
    kind: str
    #: The final stage it needs (:data:`Capability`); None: any final stage.
    capability: Capability | None
    #: Its file format when a request names none.
    format: str
    #: How its result is rendered.
    renderer: MediaRenderer | MessageRenderer
    #: Its request fields ↔ engine params, by surface (fields.py).
    fields: Mapping[str, FieldMap] = field(default_factory=dict)
    #: Whether it needs an input image (and so a model whose stages take one: ``image_input``).
    needs_image: bool = False
    #: Whether ``POST /v1/generate`` takes it (a job's ``task``).
    job: bool = False
    #: Which stages its fields go to: those that take image params, or every stage that has the
    #: param (a speech stage's, a chat's).
    params: Literal["image", "shared"] = "image"
    #: The longest prompt it takes (None: the engine's limit).
    max_prompt: int | None = None

    def sampling_params(
        self, omni: AsyncOmni, params: dict[str, Any], *, image: dict[str, Any] | None = None,
        shared: dict[str, Any] | None = None,
    ) -> list[dict[str, Any] | None]:  # fmt: skip
        """The per-stage params of a request: ``params`` (its fields) where :attr:`params` says,
        ``image`` (a decoded input) to the stages that take image params, ``shared`` to every
        stage that has the param."""
        if self.params == "image":
            return omni.sampling_params(image={**params, **(image or {})}, shared=shared)
        return omni.sampling_params(image=image, shared={**params, **(shared or {})})


def _diffusion(name: TaskName, kind: str, capability: Capability, **kwargs: Any) -> Task:
    renderer = {"image": IMAGES, "video": VIDEOS, "audio": AUDIO}[kind]
    return Task(name, kind, capability, renderer.default_format, renderer, **kwargs)


_JOB = {"generate": f.GENERATE_DIFFUSION, "cli": f.CLI_DIFFUSION}

#: The registry, in this order everywhere (``ModelCapabilities.tasks``, ``/v1/models``).
TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        _diffusion("text2image", "image", "image", fields={"images": f.IMAGE_GENERATION, **_JOB}, job=True),
        _diffusion("image_edit", "image", "image", fields={"images": f.IMAGE_INPUT}, needs_image=True),
        _diffusion("image_variation", "image", "image", fields={"images": f.IMAGE_INPUT}, needs_image=True),
        _diffusion("text2video", "video", "video", fields=_JOB, job=True),
        _diffusion("image2video", "video", "video", fields=_JOB, needs_image=True, job=True),
        _diffusion("text2audio", "audio", "audio", fields=_JOB, job=True),
        Task(
            "text2speech",
            "audio",
            "speech",
            AUDIO.default_format,
            AUDIO,
            fields={"speech": f.SPEECH, "generate": f.GENERATE_SPEECH, "cli": f.CLI_SPEECH, "realtime": f.REALTIME},
            job=True,
            params="shared",
            max_prompt=MAX_SPEECH_CHARS,
        ),
        Task(
            "chat",
            "text",
            None,
            MESSAGE.default_format,
            MESSAGE,
            fields={"chat": f.CHAT, "realtime": f.REALTIME},
            params="shared",
        ),
    )
}
#: Every task's name (tests/entrypoints/test_tasks.py checks it is the registry's, in order).
TASK_NAMES: tuple[TaskName, ...] = get_args(TaskName)
#: The tasks ``POST /v1/generate`` takes.
JOB_TASKS: tuple[str, ...] = tuple(name for name, t in TASKS.items() if t.job)


def task(name: str) -> Task:
    """The task ``name``; KeyError naming the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"no task {name!r}; the tasks are {', '.join(TASKS)}") from None


def kind_of(name: str | None) -> str | None:
    """The media kind task ``name`` makes (None for an unknown name)."""
    found = TASKS.get(name or "")
    return found.kind if found else None
