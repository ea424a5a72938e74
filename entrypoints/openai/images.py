"""The images routes (``/v1/images/generations``, ``edits``, ``variations``), their shared steps
and the input image of a chat request: admission checks, validation of the ``n`` engine requests,
running them together and answering in the images API's shape. Runs on the server's event loop."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omni_runtime.exceptions import InvalidRequestError

from ..async_omni import ValidRequest
from ..tasks import IMAGES, TASKS, FileSink, Task
from ..tasks.inputs import input_image
from . import protocol as proto
from .body import BodyRoute
from .dependencies import AUTH, JSON_BODY, MULTIPART_BODY, EditModel, ImageModel, State, VariationModel
from .responses import json_with_id
from .state import ModelHandle, ServerState
from .uploads import image_params, read_image_form

T = TypeVar("T")
#: The task table (entrypoints/tasks/fields.py) of these routes, and their tasks.
SURFACE = "images"
GENERATION, EDIT, VARIATION = TASKS["text2image"], TASKS["image_edit"], TASKS["image_variation"]


async def gather_or_abort(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """All results, or the first error with the other requests aborted (cancelling ``generate``
    aborts its request)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def check_n(model: ModelHandle, n: int) -> None:
    """Refuse an images request of more images than the model's admission limit."""
    max_pending = model.engine.health().max_pending
    if n > max_pending:
        # A 429 would invite retries that can never succeed.
        raise InvalidRequestError(
            f"n={n} images exceed this server's admission limit of {max_pending} requests", param="n"
        )


def validate_images(
    model: ModelHandle, task: Task, prompt: str, params: dict[str, Any], n: int, seed: int | None
) -> list[ValidRequest]:
    """Each of the ``n`` requests of an images call of ``task``, validated before any of them is
    admitted; image ``i`` gets ``seed + i``. Errors name the request field as the task's table
    maps it (``size``, ``mask``)."""
    omni = model.engine

    def per_image(i: int) -> list[dict | None]:
        return task.sampling_params(omni, params, image=None if seed is None else {"seed": seed + i})

    try:
        return [omni.validate(prompt, per_image(i), modalities=[task.kind]) for i in range(n)]
    except InvalidRequestError as e:
        task.fields[SURFACE].rename(e)
        raise


async def run_images(
    state: ServerState,
    model: ModelHandle,
    request: Request,
    valid: list[ValidRequest],
    body: proto.ImageGenerationRequest | proto.ImageEditForm | proto.ImageVariationForm,
) -> tuple[dict[str, Any], str]:
    """Run validated image requests together: the response body in the images API's shape, and
    the id of the call (``X-Request-Id``)."""
    n = len(valid)
    base = f"img-{uuid.uuid4().hex}"
    ids = [f"{base}-{i}" for i in range(n)]
    outs = await state.until_disconnect(
        request, ids, gather_or_abort([state.collect(model, valid[i], ids[i]) for i in range(n)])
    )
    sink = FileSink(state.files.put, state.public_url or str(request.base_url).rstrip("/"))
    rendered = await IMAGES.render(
        outs, body.output_format, sink if body.response_format == "url" else None, quality=body.output_compression
    )
    data = [proto.ImageData(seed=e["seed"], url=e.get("url"), b64_json=e.get("b64_json")) for e in rendered["images"]]
    state.metrics.series(state.metrics.images, model.name).inc(len(data))
    resp = proto.ImageGenerationResponse(data=data, output_format=body.output_format, size=rendered["size"])
    return resp.model_dump(exclude_none=True), base


async def chat_image(model: ModelHandle, body: proto.ChatCompletionRequest) -> dict[str, Any] | None:
    """The input image of a chat request (an ``image_url`` data URL part of the last user
    message) as diffusion params, or None. Remote URLs are refused, never fetched."""
    urls = body.image_urls()
    if not urls:
        return None
    if len(urls) > 1:
        raise InvalidRequestError(f"one input image per request; got {len(urls)} image_url parts", param=urls[1][1])
    url, where = urls[0]
    return await input_image(model, url, where)


router = APIRouter(prefix="/v1/images", dependencies=[AUTH], route_class=BodyRoute)


@router.post("/generations", dependencies=[JSON_BODY])
async def create_images(
    body: proto.ImageGenerationRequest, request: Request, state: State, model: ImageModel
) -> JSONResponse:
    check_n(model, body.n)
    params = GENERATION.fields[SURFACE].params(body)
    valid = validate_images(model, GENERATION, body.prompt, params, body.n, body.seed)
    return json_with_id(await run_images(state, model, request, valid, body))


@router.post("/edits", dependencies=[MULTIPART_BODY])
async def edit_images(request: Request, state: State, model: EditModel) -> JSONResponse:
    body, files = await read_image_form(request, proto.ImageEditForm)
    check_n(model, body.n)
    # Without a mask, the image's own transparent pixels are the region to edit (as OpenAI's
    # edits take it); an opaque image without a mask is redrawn as a whole (img2img).
    limit = model.engine.max_input_pixels()
    fields = EDIT.fields[SURFACE]
    params = await image_params(body, files, body.strength, alpha_as_mask=True, limit=limit, fields=fields)
    valid = validate_images(model, EDIT, body.prompt, params, body.n, body.seed)
    return json_with_id(await run_images(state, model, request, valid, body))


@router.post("/variations", dependencies=[MULTIPART_BODY])
async def image_variations(request: Request, state: State, model: VariationModel) -> JSONResponse:
    body, files = await read_image_form(request, proto.ImageVariationForm)
    check_n(model, body.n)
    strength = body.strength if body.strength is not None else proto.VARIATION_STRENGTH
    limit = model.engine.max_input_pixels()
    fields = VARIATION.fields[SURFACE]
    params = await image_params(body, files, strength, alpha_as_mask=False, limit=limit, fields=fields)
    valid = validate_images(model, VARIATION, "", params, body.n, body.seed)
    return json_with_id(await run_images(state, model, request, valid, body))
