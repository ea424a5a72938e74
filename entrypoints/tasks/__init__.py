"""The tasks (text2image, image_edit, image_variation, text2video, image2video, text2audio,
text2speech, chat): one :class:`Task` each in the registry (registry.py), with its field tables
(fields.py) and its renderer (render.py); the routes, the jobs (generate.py: a job's checks and
result) and the CLI adapt them. Importing this package loads neither FastAPI nor the server."""

from __future__ import annotations

from .registry import CAPABILITIES, JOB_TASKS, TASK_NAMES, TASKS, Capability, Task, TaskName, kind_of, task
from .render import AUDIO, IMAGES, MESSAGE, RENDERERS, VIDEOS, FileSink, MediaRenderer, MessageRenderer

__all__ = [
    "AUDIO",
    "CAPABILITIES",
    "IMAGES",
    "JOB_TASKS",
    "MESSAGE",
    "RENDERERS",
    "TASKS",
    "TASK_NAMES",
    "VIDEOS",
    "Capability",
    "FileSink",
    "MediaRenderer",
    "MessageRenderer",
    "Task",
    "TaskName",
    "kind_of",
    "task",
]
