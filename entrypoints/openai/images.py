"""The images routes' shared steps (generations, edits, variations) and the input image of a chat
request: admission checks, validation of the ``n`` engine requests, running them together and
answering in the images API's shape. Runs on the server's event loop."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from omni_runtime.exceptions import InvalidRequestError

from ..async_omni import AsyncOmni, ValidRequest
from . import protocol as proto
from .files import MEDIA_TYPES, encode_images
from .protocol import ApiError
from .uploads import HTTP_FIELDS, Upload, decode_async, decode_data_url, decode_image

if TYPE_CHECKING:
    from .server import ServerState

T = TypeVar("T")


async def gather_or_abort(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """All results, or the first error with the other requests aborted (cancelling ``generate``
    aborts its request)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def images_engine(state: ServerState, model: str | None, n: int) -> AsyncOmni:
    """The engine for an images request of ``n`` images, or the error that refuses it."""
    omni = state.check_request(model)
    if state.image_stage is None:
        raise ApiError(400, f"the model `{state.model_name}` has no image output", param="model", code="no_image")
    max_pending = omni.health().max_pending
    if n > max_pending:
        # A 429 would invite retries that can never succeed.
        raise InvalidRequestError(
            f"n={n} images exceed this server's admission limit of {max_pending} requests", param="n"
        )
    return omni


def validate_images(
    omni: AsyncOmni, prompt: str, image: dict[str, Any], n: int, seed: int | None
) -> list[ValidRequest]:
    """Each of the ``n`` requests of an images call, validated before any of them is admitted;
    image ``i`` gets ``seed + i``. Errors name the HTTP field (``size``, ``mask``)."""

    def params(i: int) -> list[dict | None]:
        extra = {} if seed is None else {"seed": seed + i}
        return omni.sampling_params(image=image | extra)

    try:
        return [omni.validate(prompt, params(i), modalities=["image"]) for i in range(n)]
    except InvalidRequestError as e:
        e.param = HTTP_FIELDS.get(e.param, e.param)
        raise


async def run_images(
    state: ServerState,
    omni: AsyncOmni,
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
        request, ids, gather_or_abort([state.collect(omni, valid[i], ids[i]) for i in range(n)])
    )
    images = [(img, out) for out in outs for img in out.images]
    encoded = await encode_images([img for img, _ in images], body.output_format, body.output_compression)
    data = []
    for (_, out), blob in zip(images, encoded, strict=True):
        seed = out.outputs_by_stage.get(state.image_stage)
        item = proto.ImageData(seed=seed.metrics.get("seed") if seed else None)
        if body.response_format == "url":
            file_id = await state.files.put(blob, MEDIA_TYPES[body.output_format])
            item.url = f"{state.public_url or str(request.base_url).rstrip('/')}/v1/files/{file_id}"
        else:
            item.b64_json = base64.b64encode(blob).decode()
        data.append(item)
    state.metrics.images.inc(len(data))
    size_text = f"{images[0][0].width}x{images[0][0].height}" if images else None
    resp = proto.ImageGenerationResponse(data=data, output_format=body.output_format, size=size_text)
    return resp.model_dump(exclude_none=True), base


async def chat_image(state: ServerState, body: proto.ChatCompletionRequest) -> dict[str, Any] | None:
    """The input image of a chat request (an ``image_url`` data URL part of the last user
    message) as diffusion params, or None. Remote URLs are refused, never fetched."""
    urls = body.image_urls()
    if not urls:
        return None
    if len(urls) > 1:
        raise InvalidRequestError(f"one input image per request; got {len(urls)} image_url parts", param=urls[1][1])
    url, where = urls[0]
    if not any(stage.takes_image_params for stage in state.resolved.stages):
        raise InvalidRequestError(f"the model `{state.model_name}` takes no input image", param=where)
    limit = state.started.max_input_pixels()
    decoded = await decode_async(decode_image, Upload(decode_data_url(url, where), where, limit))
    return {"image": decoded.rgb}
