"""``POST /v1/generate`` over the registry: a job's request checked and built for its task
(:func:`validate_job`), and its result rendered by the task's renderer (:func:`job_result`).
The job manager (entrypoints/openai/job_manager.py) runs jobs; this is what it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.outputs import OmniRequestOutput

from ..async_omni import ValidRequest
from ..openai.fields import FieldMap
from ..openai.protocol import ApiError, GenerateRequest
from .fields import GENERATE_SHARED
from .inputs import input_image, require
from .registry import JOB_TASKS, TASKS, Task
from .render import FileSink, MediaRenderer

if TYPE_CHECKING:
    from ..openai.state import ModelHandle

SURFACE = "generate"
#: The field that carries a job's input image.
IMAGE_FIELD = "inputs.image"


def job_fields(task: Task) -> FieldMap:
    """Every field of a job of ``task``: its own and the shared ones (what an error is renamed by)."""
    return task.fields[SURFACE] | GENERATE_SHARED


def _taken_by(name: str) -> list[str]:
    """The job tasks whose fields include ``name``."""
    return [t for t in JOB_TASKS if name in TASKS[t].fields[SURFACE].names()]


def _refuse(task: Task, name: str) -> ApiError:
    others = ", ".join(f"`{t}`" for t in _taken_by(name))
    return ApiError(400, f"task `{task.name}` takes no `{name}`; it is for {others}", param=name, code="invalid_value")


def renderer_of(task: Task) -> MediaRenderer:
    """The renderer of a job task (each makes media)."""
    if not isinstance(task.renderer, MediaRenderer):
        raise TypeError(f"task `{task.name}` is no job task")
    return task.renderer


async def validate_job(model: ModelHandle, body: GenerateRequest) -> ValidRequest:
    """The job checked as its task has it, on ``model``: a task the model cannot do, a format of
    another kind, a field of another task (``inputs.voice`` on an image task, the diffusion ones
    on ``text2speech``), an input image missing where the task needs one or given where it takes
    none, and whatever the engine refuses: each a 400 naming the request field."""
    task = TASKS[body.task]
    require(model, task.name)
    renderer = renderer_of(task)
    fmt = body.config.output_format
    if fmt is not None and not renderer.takes(fmt):
        message = f"task `{task.name}` makes {task.kind}; `config.output_format` is one of {list(renderer.formats())}"
        raise ApiError(400, message, param="config.output_format", code="invalid_value")
    own = task.fields[SURFACE]
    for name in (n for t in JOB_TASKS for n in TASKS[t].fields[SURFACE].given(body)):
        if name not in own.names():
            raise _refuse(task, name)
    prompt = body.inputs.prompt
    if task.max_prompt is not None and len(prompt) > task.max_prompt:
        message = f"the prompt is {len(prompt)} characters; task `{task.name}` takes at most {task.max_prompt}"
        raise ApiError(400, message, param="inputs.prompt", code="invalid_value")
    try:
        image = await _input_image(model, task, body)
        params = task.sampling_params(model.engine, own.params(body), image=image, shared=GENERATE_SHARED.params(body))
        return model.engine.validate(prompt, params, modalities=[task.kind])
    except InvalidRequestError as e:
        raise job_fields(task).rename(e) from None


async def _input_image(model: ModelHandle, task: Task, body: GenerateRequest) -> dict[str, Any]:
    """``inputs.image`` decoded (resized to ``inputs.size`` if given), or nothing: required by a
    task that needs an image, refused by the others."""
    url = body.inputs.image
    if task.needs_image and url is None:
        message = f"task `{task.name}` needs `{IMAGE_FIELD}` (a data URL of the first frame)"
        raise InvalidRequestError(message, param=IMAGE_FIELD)
    if url is None:
        return {}
    if not task.needs_image:
        takers = ", ".join(f"`{t}`" for t in JOB_TASKS if TASKS[t].needs_image)
        raise InvalidRequestError(f"task `{task.name}` takes no `{IMAGE_FIELD}`; it is for {takers}", param=IMAGE_FIELD)
    return await input_image(model, url, IMAGE_FIELD, body.inputs.dimensions())


async def job_result(task: Task, out: OmniRequestOutput, body: GenerateRequest, sink: FileSink) -> dict[str, Any]:
    """The job's result: each item in the format asked for (or the task's), stored in ``sink``
    (``response_format: url``, and every video) or inline."""
    renderer = renderer_of(task)
    fmt = renderer.output_format(body.config.output_format or task.format)
    stored = body.response_format == "url" or not renderer.inline
    return await renderer.render([out], fmt, sink if stored else None, quality=body.config.output_compression)
