"""The videos routes (``/v1/videos``, OpenAI's shape): a video is a job of task ``text2video``, or
``image2video`` when the request has an ``input_reference`` (job_manager.py runs it, the job store
keeps it, a cancel stops it), seen through OpenAI's video object. Runs on the server's event loop.

``seconds`` becomes a frame count: ``fps`` (the request's, else :data:`DEFAULT_FPS`) times the
seconds, rounded to the nearest count the model makes (``step * k + 1`` frames, so that
``(num_frames - 1) / fps`` is the length). Given with ``num_frames``, both must name the same count.

``input_reference`` is the first frame: a multipart file part (as ``client.videos.create`` uploads
it), or OpenAI's reference object with an ``image_url`` data URL (JSON, or the form's
``input_reference[image_url]``). It travels in the job as a data URL (so a job another gateway
takes over still has it) and is decoded and bounded as the images routes' uploads are.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from omni_runtime.bounds import MAX_FRAMES
from omni_runtime.exceptions import InvalidRequestError

from ..jobs.record import JobRecord
from ..tasks import TASKS, kind_of
from ..tasks.generate import job_fields
from .body import BodyRoute
from .dependencies import AUTH, JSON_OR_MULTIPART_BODY, Jobs, State, VideoModel
from .fields import FieldMap
from .job_manager import JobManager
from .protocol import ApiError, GenerateRequest, VideoCreateRequest, VideoReference, seconds_of
from .responses import SafeJSONResponse
from .state import ModelHandle
from .uploads import read_form

#: The playback rate ``seconds`` is counted at when a request names no ``fps`` (Wan's rate).
DEFAULT_FPS = 16
#: Most videos one list page holds.
MAX_LIST = 100
#: The job store's index that ``GET /v1/videos`` lists (the kind of every video task).
VIDEO_KIND = "video"

#: ``POST /v1/videos`` field -> the ``/v1/generate`` field it becomes (and back, in errors).
VIDEO_FIELDS = FieldMap(
    {
        "prompt": "inputs.prompt",
        "size": "inputs.size",
        "negative_prompt": "inputs.negative_prompt",
        "num_inference_steps": "inputs.num_inference_steps",
        "guidance_scale": "inputs.guidance_scale",
        "seed": "inputs.seed",
        "timeout": "config.timeout",
        "slo_ms": "config.slo_ms",
        "priority": "priority",
    },
    computed={
        "num_frames": "inputs.num_frames",
        "fps": "inputs.fps",
        "seconds": "inputs.num_frames",
        "input_reference": "inputs.image",
    },
)
#: Engine param (as a ``/v1/generate`` error names it) -> the ``/v1/generate`` field.
_JOB_FIELDS = job_fields(TASKS["text2video"])
#: Job status -> video status.
_STATUS = {"queued": "queued", "running": "in_progress", "completed": "completed", "failed": "failed"}
#: The first frame's field: a file part of a form, or a reference object.
REFERENCE = "input_reference"


def frames_for(seconds: float, fps: int, step: int) -> int:
    """The frame count nearest to ``seconds`` at ``fps`` that a model of frame step ``step``
    makes (``step * k + 1``, at least one step)."""
    return step * max(1, round(seconds * fps / step)) + 1


def _generate_request(body: VideoCreateRequest, model: ModelHandle) -> GenerateRequest:
    frames, fps = body.num_frames, body.fps
    if body.seconds is not None:
        fps = fps or DEFAULT_FPS
        wanted = frames_for(seconds_of(body.seconds), fps, model.capabilities.frames_step or 1)
        if frames is not None and frames != wanted:
            raise InvalidRequestError(
                f"seconds={body.seconds} at {fps} fps is {wanted} frames, but num_frames is {frames}: "
                "give one of them, or both naming the same count",
                param="seconds",
            )
        if wanted > MAX_FRAMES:
            raise InvalidRequestError(
                f"seconds={body.seconds} at {fps} fps is {wanted} frames, more than the {MAX_FRAMES} "
                "any video may have",
                param="seconds",
            )
        frames = wanted
    inputs = {
        "prompt": body.prompt,
        "negative_prompt": body.negative_prompt,
        "size": body.size,
        "num_inference_steps": body.num_inference_steps,
        "guidance_scale": body.guidance_scale,
        "seed": body.seed,
        "num_frames": frames,
        "fps": fps,
        "image": _reference_image(body.input_reference),
    }
    return GenerateRequest.model_validate(
        {
            "task": "text2video" if inputs["image"] is None else "image2video",
            "model": model.name,
            "inputs": inputs,
            "config": {"timeout": body.timeout, "slo_ms": body.slo_ms},
            "priority": body.priority,
        }
    )


def _reference_image(reference: VideoReference | None) -> str | None:
    """The data URL of the first frame, or None (text to video)."""
    if reference is None:
        return None
    if reference.file_id is not None or reference.image_url is None:
        raise InvalidRequestError(
            f"`{REFERENCE}`: this server keeps no files to refer to by file_id; upload the image as the "
            f"`{REFERENCE}` file, or give `{REFERENCE}.image_url` as a data URL",
            param=REFERENCE,
        )
    return reference.image_url


def _form_data(fields: dict[str, str], files: dict[str, bytes]) -> dict[str, Any]:
    """A form's fields as the JSON body they stand for: the ``input_reference`` file becomes a
    reference object with its bytes as a data URL, ``input_reference[key]`` fields its keys."""
    prefix = REFERENCE + "["
    data: dict[str, Any] = {k: v for k, v in fields.items() if not k.startswith(prefix)}
    nested = {k[len(prefix) : -1]: v for k, v in fields.items() if k.startswith(prefix) and k.endswith("]")}
    if len(nested) != sum(k.startswith(prefix) for k in fields):
        raise InvalidRequestError(f"`{REFERENCE}`: expected `{REFERENCE}[image_url]` fields", param=REFERENCE)
    if REFERENCE in files:
        if nested:
            raise InvalidRequestError(f"`{REFERENCE}` is given as a file and as fields: give one", param=REFERENCE)
        # No media type: the decoder tells the format from the image's header, whatever a client claims.
        nested = {"image_url": "data:;base64," + base64.b64encode(files[REFERENCE]).decode()}
    if nested:
        data[REFERENCE] = nested
    return data


def _video_field(param: str | None) -> str | None:
    """The ``/v1/videos`` field behind an error's param (an engine param or a ``/v1/generate`` field)."""
    job_field = _JOB_FIELDS.field(param)
    for name, target in (*VIDEO_FIELDS.fields.items(), *VIDEO_FIELDS.computed.items()):
        if target == job_field:
            return name
    return param


def video_object(job: dict[str, Any]) -> dict[str, Any]:
    """A job record (its public view and its request) as OpenAI's video object."""
    request = job.get("request") or {}
    inputs = request.get("inputs") or {}
    result = job.get("result") or {}
    videos = result.get("videos") or [{}]
    frames = videos[0].get("num_frames") or inputs.get("num_frames")
    fps = videos[0].get("fps") or inputs.get("fps")
    status = _STATUS.get(job["status"], "failed")
    step = job.get("progress") or {}
    progress = 100 if status == "completed" else 0
    if status != "completed" and step.get("steps"):
        progress = min(99, int(100 * step["step"] / step["steps"]))
    error = job.get("error")
    if job["status"] == "cancelled":
        error = {"code": "cancelled", "message": "the video was cancelled before it finished"}
    return {
        "id": job["job_id"],
        "object": "video",
        "status": status,
        "progress": progress,
        "model": job.get("model"),
        "prompt": inputs.get("prompt"),
        "created_at": int(job.get("created_at") or 0),
        "completed_at": int(job["finished_at"]) if status == "completed" and job.get("finished_at") else None,
        "size": result.get("size") or inputs.get("size"),
        "seconds": f"{(frames - 1) / fps:g}" if frames and fps else None,
        "num_frames": frames,
        "fps": fps,
        "seed": videos[0].get("seed", inputs.get("seed")),
        "error": error,
    }


async def _video_job(manager: JobManager, video_id: str) -> dict[str, Any]:
    """The job behind ``video_id``, or a 404 when it is no video."""
    record = await manager.get_record(video_id)
    if kind_of(record.task) != VIDEO_KIND:
        raise _not_found(video_id)
    return record.public() | {"request": record.request}


def _not_found(video_id: str) -> ApiError:
    message = f"video `{video_id[:64]}` does not exist, was deleted or has expired"
    return ApiError(404, message, param="video_id", code="not_found")


def _file_ids(result: dict[str, Any] | None) -> list[str]:
    """The file store ids of a video job's result: each video's MP4 and its poster."""
    videos = (result or {}).get("videos") or []
    return [v[key] for v in videos for key in ("file_id", "thumbnail_file_id") if v.get(key)]


async def video_request(request: Request) -> VideoCreateRequest:
    """The body of ``POST /v1/videos``: JSON (parsed as every route's, body.py), or
    multipart/form-data with the same fields as text fields (as ``client.videos.create`` sends
    them), both validated by :class:`VideoCreateRequest` in pydantic's lax mode, so a form's
    ``"9"`` passes as JSON's 9 does (a boolean never does) and a bad value is the same 400 naming
    the field. The content type was checked by the route's guard."""
    data: Any
    if request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        data = _form_data(*await read_form(request, (REFERENCE,)))
    elif not await request.body():
        # As FastAPI answers a JSON body parameter: the errors keep its shape (``body`` in loc).
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([missing])
    else:
        data = await request.json()
    try:
        return VideoCreateRequest.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([err | {"loc": ("body", *err["loc"])} for err in e.errors()]) from None


router = APIRouter(prefix="/v1/videos", dependencies=[AUTH], route_class=BodyRoute)


def _create_body() -> dict[str, Any]:
    """``POST /v1/videos``'s body in the OpenAPI schema (the route reads the body itself, JSON or
    a form, so FastAPI cannot see it): the same fields either way."""
    schema = VideoCreateRequest.model_json_schema()
    form = schema | {"description": "The same fields as text parts of a multipart form (as the openai client sends)."}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}, "multipart/form-data": {"schema": form}},
        }
    }


@router.post("", dependencies=[JSON_OR_MULTIPART_BODY], openapi_extra=_create_body())
async def create_video(
    body: Annotated[VideoCreateRequest, Depends(video_request)],
    request: Request,
    state: State,
    manager: Jobs,
    model: VideoModel,
) -> SafeJSONResponse:
    try:
        job = _generate_request(body, model)
        record = await manager.submit(job, state.public_url or str(request.base_url).rstrip("/"), model)
    except InvalidRequestError as e:
        job_field, e.param = e.param, _video_field(e.param)
        if job_field == "inputs.image":  # the image's errors name the field as this route's clients send it
            message = str(e).replace(f"`{job_field}`", f"`{REFERENCE}`")
            e.args = (message.replace("invalid sampling param `image`", f"`{REFERENCE}`"),)
        raise
    video = video_object(record | {"request": job.model_dump(mode="json")})
    return SafeJSONResponse(video, headers={"X-Request-Id": record["job_id"]})


@router.get("")
async def list_videos(
    manager: Jobs,
    limit: int = Query(20, ge=1, le=MAX_LIST),
    after: str | None = Query(None, max_length=128),
    order: Literal["asc", "desc"] = "desc",
) -> SafeJSONResponse:
    """The job store's videos (every gateway's), newest first (``order=desc``) or oldest first;
    a page starts after the video ``after`` and holds at most ``limit``."""
    # One more than the page: whether there is a next page.
    records = await manager.store.list_kind(VIDEO_KIND, after=after, limit=limit + 1, newest_first=order == "desc")
    page = [video_object(JobRecord.from_store(r).public() | {"request": r.get("request")}) for r in records[:limit]]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(records) > limit,
    }
    return SafeJSONResponse(body)


@router.get("/{video_id}")
async def get_video(video_id: str, manager: Jobs) -> SafeJSONResponse:
    return SafeJSONResponse(video_object(await _video_job(manager, video_id)))


@router.delete("/{video_id}")
async def delete_video(video_id: str, state: State, manager: Jobs) -> SafeJSONResponse:
    """Cancel the video if it still runs, then remove its files and its job from the stores:
    from then on every gateway answers 404 for it (its record, its content, its events), as for
    a video that never was."""
    await _video_job(manager, video_id)
    ended = await manager.cancel(video_id)
    # The files first: a store that cannot be reached fails the request (503) before the job is
    # gone, so the client's retry still finds the files to remove.
    await state.files.delete(_file_ids(ended.get("result")))
    if not await manager.store.delete(VIDEO_KIND, video_id):
        raise _not_found(video_id)  # another DELETE removed it meanwhile
    return SafeJSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})


@router.get("/{video_id}/content")
async def video_content(
    video_id: str, state: State, manager: Jobs, variant: Literal["video", "thumbnail"] = "video"
) -> Response:
    job = await _video_job(manager, video_id)
    if job["status"] != "completed":
        raise ApiError(
            409, f"video `{video_id}` is {video_object(job)['status']}, not completed: it has no content",
            param="video_id", code="not_ready",
        )  # fmt: skip
    video = (job.get("result") or {}).get("videos", [{}])[0]
    file_id = video.get("thumbnail_file_id" if variant == "thumbnail" else "file_id")
    found = await state.files.get(file_id) if file_id else None
    if found is None:
        raise ApiError(404, f"the content of video `{video_id}` has expired", param="video_id", code="not_found")
    media_type, data, _ = found
    return Response(data, media_type=media_type)
