"""The images routes (``/v1/images/generations``, ``edits``, ``variations``), their shared steps
and the input image of a chat request: admission checks, validation of the ``n`` engine requests,
running them together and answering in the images API's shape. Runs on the server's event loop."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omni_runtime import encoders
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.media import ImageItem, items_of

from ..async_omni import AsyncOmni, ValidRequest
from . import protocol as proto
from .body import BodyRoute
from .dependencies import AUTH, JSON_BODY, MULTIPART_BODY, EditModel, ImageModel, State, VariationModel
from .fields import FieldMap
from .responses import json_with_id
from .state import ModelHandle, ServerState
from .uploads import Upload, decode_async, decode_data_url, decode_image, image_params, read_image_form

T = TypeVar("T")

#: ``/v1/images/generations``: request field -> engine param (and back, in errors). The seed is
#: the route's own: image ``i`` gets ``seed + i``.
GENERATION_FIELDS = FieldMap(
    {
        "negative_prompt": "negative_prompt",
        "num_inference_steps": "num_inference_steps",
        "guidance_scale": "guidance_scale",
        "timeout": "timeout",
        "slo_ms": "slo_ms",
        "lora": "lora",
        "priority": "priority",
        "cache": "cache",
        "size": ("width", "height"),
    },
    read={"lora": lambda body: body.lora.params() if body.lora else None, "size": lambda body: body.dimensions()},
    computed={"seed": "seed"},
)
#: ``/v1/images/edits`` and ``variations`` (multipart forms): the image, its mask and ``size``
#: (which resizes the upload) are decoded by the route (uploads.image_params).
INPUT_IMAGE_FIELDS = FieldMap(
    {
        "negative_prompt": "negative_prompt",
        "num_inference_steps": "num_inference_steps",
        "guidance_scale": "guidance_scale",
        "timeout": "timeout",
        "slo_ms": "slo_ms",
        "cache": "cache",
    },
    computed={
        "image": "image",
        "mask": "mask_image",
        "strength": "strength",
        "seed": "seed",
        "size": ("width", "height"),
    },
)


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
    omni: AsyncOmni, prompt: str, image: dict[str, Any], n: int, seed: int | None, fields: FieldMap
) -> list[ValidRequest]:
    """Each of the ``n`` requests of an images call, validated before any of them is admitted;
    image ``i`` gets ``seed + i``. Errors name the request field as ``fields`` maps it (``size``,
    ``mask``)."""

    def params(i: int) -> list[dict | None]:
        extra = {} if seed is None else {"seed": seed + i}
        return omni.sampling_params(image=image | extra)

    try:
        return [omni.validate(prompt, params(i), modalities=["image"]) for i in range(n)]
    except InvalidRequestError as e:
        fields.rename(e)
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
    images = [(img, out) for out in outs for img in items_of(out.media, "image") if isinstance(img, ImageItem)]
    fmt = body.output_format
    encoded = await encoders.encode_all([img for img, _ in images], fmt, quality=body.output_compression)
    data = []
    image_stage = model.capabilities.stage("text2image")
    assert image_stage is not None  # the route's model dependency refuses a model without one
    for (img, out), blob in zip(images, encoded, strict=True):
        seed = out.outputs_by_stage.get(image_stage)
        item = proto.ImageData(seed=seed.metrics.get("seed") if seed else None)
        if body.response_format == "url":
            file_id = await state.files.put(blob, encoders.media_type(img.kind, fmt))
            item.url = f"{state.public_url or str(request.base_url).rstrip('/')}/v1/files/{file_id}"
        else:
            item.b64_json = base64.b64encode(blob).decode()
        data.append(item)
    state.metrics.images.inc(len(data))
    size_text = f"{images[0][0].width}x{images[0][0].height}" if images else None
    resp = proto.ImageGenerationResponse(data=data, output_format=body.output_format, size=size_text)
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
    if not model.capabilities.image_input:
        raise InvalidRequestError(f"the model `{model.name}` takes no input image", param=where)
    limit = model.engine.max_input_pixels()
    decoded = await decode_async(decode_image, Upload(decode_data_url(url, where), where, limit))
    return {"image": decoded.rgb}


router = APIRouter(prefix="/v1/images", dependencies=[AUTH], route_class=BodyRoute)


@router.post("/generations", dependencies=[JSON_BODY])
async def create_images(
    body: proto.ImageGenerationRequest, request: Request, state: State, model: ImageModel
) -> JSONResponse:
    check_n(model, body.n)
    image = GENERATION_FIELDS.params(body)
    valid = validate_images(model.engine, body.prompt, image, body.n, body.seed, GENERATION_FIELDS)
    return json_with_id(await run_images(state, model, request, valid, body))


@router.post("/edits", dependencies=[MULTIPART_BODY])
async def edit_images(request: Request, state: State, model: EditModel) -> JSONResponse:
    body, files = await read_image_form(request, proto.ImageEditForm)
    check_n(model, body.n)
    # Without a mask, the image's own transparent pixels are the region to edit (as OpenAI's
    # edits take it); an opaque image without a mask is redrawn as a whole (img2img).
    limit = model.engine.max_input_pixels()
    params = await image_params(body, files, body.strength, alpha_as_mask=True, limit=limit, fields=INPUT_IMAGE_FIELDS)
    valid = validate_images(model.engine, body.prompt, params, body.n, body.seed, INPUT_IMAGE_FIELDS)
    return json_with_id(await run_images(state, model, request, valid, body))


@router.post("/variations", dependencies=[MULTIPART_BODY])
async def image_variations(request: Request, state: State, model: VariationModel) -> JSONResponse:
    body, files = await read_image_form(request, proto.ImageVariationForm)
    check_n(model, body.n)
    strength = body.strength if body.strength is not None else proto.VARIATION_STRENGTH
    limit = model.engine.max_input_pixels()
    params = await image_params(body, files, strength, alpha_as_mask=False, limit=limit, fields=INPUT_IMAGE_FIELDS)
    valid = validate_images(model.engine, "", params, body.n, body.seed, INPUT_IMAGE_FIELDS)
    return json_with_id(await run_images(state, model, request, valid, body))
