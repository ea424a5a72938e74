"""Input images of HTTP requests: multipart uploads and ``data:`` URLs, decoded with Pillow in the
gateway (never on a stage: the engine gets raw uint8 arrays).

Bounded before any pixel is decoded: the body limit of the server (413), then the image's
declared size against :data:`MAX_UPLOAD_PIXELS`, read from its header (a decompression bomb
never gets decoded), and Pillow's own bomb check. Anything Pillow cannot decode (not an image,
a truncated PNG...) is a 400 naming the field. Remote URLs are never fetched.

Runs on the server's event loop; decoding itself runs in a worker thread (:func:`decode_async`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.params import MAX_IMAGE_PIXELS

#: Most pixels an uploaded image may declare (as the engine's own limit on input images).
MAX_UPLOAD_PIXELS = MAX_IMAGE_PIXELS
T = TypeVar("T")
_DATA_URL = re.compile(r"^data:(image/[a-z0-9.+-]+)?(;[a-z0-9=._-]+)*;base64,", re.IGNORECASE)


@dataclass
class InputImage:
    """A decoded input: RGB pixels, and the mask its transparency makes (None if opaque)."""

    rgb: np.ndarray
    #: (width, height) as uploaded, before any resize.
    size: tuple[int, int]
    #: 255 where the image is fully transparent (the region to edit, as OpenAI's edits take it).
    alpha_mask: np.ndarray | None


def decode_image(data: bytes, param: str, size: tuple[int, int] | None = None) -> InputImage:
    """Decode an uploaded image (any format Pillow reads); ``size`` (width, height) resizes it.

    Raises InvalidRequestError naming ``param`` for what is not a whole, bounded image.
    """
    image = _open(data, param)
    uploaded = image.size
    alpha = None
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        a = np.asarray(image.convert("RGBA"))[:, :, 3]
        if (a == 0).any():
            alpha = np.where(a == 0, 255, 0).astype(np.uint8)
    rgb = image.convert("RGB")
    if size is not None and rgb.size != size:
        from PIL import Image

        rgb = rgb.resize(size, Image.Resampling.LANCZOS)
        if alpha is not None:
            alpha = np.asarray(Image.fromarray(alpha).resize(size, Image.Resampling.NEAREST))
    return InputImage(np.asarray(rgb, dtype=np.uint8), uploaded, alpha)


def decode_mask(
    data: bytes, param: str, image_size: tuple[int, int], size: tuple[int, int] | None = None
) -> np.ndarray:
    """A mask upload as uint8 HxW, 255 = edit: its transparent pixels if it has an alpha channel
    (OpenAI's convention), else its luminance (white = edit, diffusers' convention). It must have
    the size of the image it masks (``image_size``, before any resize to ``size``)."""
    from PIL import Image

    image = _open(data, param)
    if image.size != image_size:
        raise InvalidRequestError(
            f"`{param}` is {image.size[0]}x{image.size[1]}, but the image is {image_size[0]}x{image_size[1]}: "
            "a mask has the size of its image",
            param=param,
        )
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        a = np.asarray(image.convert("RGBA"))[:, :, 3]
        mask = np.where(a == 0, 255, 0).astype(np.uint8)
    else:
        mask = np.asarray(image.convert("L"), dtype=np.uint8)
    if size is not None and image.size != size:
        mask = np.asarray(Image.fromarray(mask).resize(size, Image.Resampling.NEAREST))
    return mask


def _open(data: bytes, param: str) -> Any:
    """The opened, fully loaded PIL image (PIL is imported lazily: only servers that decode need it)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidRequestError(f"`{param}` is empty: upload an image file (PNG, JPEG, WebP...)", param=param)
    try:
        with warnings.catch_warnings():
            # Pillow warns (and decodes anyway) between its limit and twice it: refuse instead.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size  # from the header: nothing decoded yet
            if width * height > MAX_UPLOAD_PIXELS or width < 1 or height < 1:
                raise InvalidRequestError(
                    f"`{param}` declares {width}x{height} pixels; the limit is {MAX_UPLOAD_PIXELS} pixels",
                    param=param,
                )
            if getattr(image, "n_frames", 1) > 1:
                image.seek(0)  # an animation: its first frame
            image.load()
    except InvalidRequestError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise InvalidRequestError(f"`{param}` is not an image this server can decode: {e}", param=param) from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError, TypeError) as e:
        # Truncated or corrupt data (Pillow raises OSError, SyntaxError or ValueError by format).
        raise InvalidRequestError(f"`{param}` could not be decoded ({type(e).__name__}: {e})", param=param) from None
    return image


def decode_data_url(url: str, param: str) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL; remote URLs are refused, never fetched."""
    head = url[:16].lower()
    if head.startswith(("http://", "https://", "ftp://", "file:")):
        raise InvalidRequestError(
            f"`{param}`: remote image URLs are not fetched by this server; send the image inline as a data URL "
            "(data:image/png;base64,...)",
            param=param,
        )
    m = _DATA_URL.match(url[:256])
    if not m:
        raise InvalidRequestError(f"`{param}`: expected a data URL (data:image/png;base64,...)", param=param)
    try:
        return base64.b64decode(url[m.end() :], validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"`{param}`: the data URL is not valid base64 ({e})", param=param) from None


async def decode_async(fn: Callable[..., T], *args: Any) -> T:
    """Run a decoder off the event loop (decoding a large PNG takes tens of milliseconds)."""
    return await asyncio.to_thread(fn, *args)


# --------------------------------------------------------------------------- multipart forms

#: Form parts that are files: the input image (``image``, or ``image[]`` as the openai client
#: names a list of them) and the mask.
FILE_FIELDS = {"image": "image", "image[]": "image", "mask": "mask"}


async def read_image_form(request: Any, form_cls: type[T]) -> tuple[T, dict[str, bytes]]:
    """The fields of a multipart image request, validated with ``form_cls`` (a pydantic model),
    and its files by field (``image``, ``mask``): exactly one image, at most one mask.

    Raises InvalidRequestError / RequestValidationError (400) naming the field.
    """
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError
    from starlette.datastructures import UploadFile

    try:
        form = await request.form(max_files=4, max_fields=64)
    except Exception as e:  # python-multipart's and Starlette's parse errors, whatever their class
        raise InvalidRequestError(f"malformed multipart/form-data body: {e}", param=None) from None
    try:
        fields: dict[str, str] = {}
        files: dict[str, list[bytes]] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key not in FILE_FIELDS:
                    raise InvalidRequestError(f"unknown file field `{key}`", param=key)
                files.setdefault(FILE_FIELDS[key], []).append(await value.read())
            elif key in FILE_FIELDS:
                raise InvalidRequestError(
                    f"`{key}` must be a file part (multipart/form-data with a filename), not a text field",
                    param=FILE_FIELDS[key],
                )
            elif key in fields:
                raise InvalidRequestError(f"`{key}` is given more than once", param=key)
            else:
                fields[key] = value
    finally:
        await form.close()
    try:
        body = form_cls.model_validate(fields)  # type: ignore[attr-defined]
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    images = files.get("image", [])
    if len(images) != 1:
        raise InvalidRequestError(
            f"expected exactly one `image` file, got {len(images)} (one input image per request)", param="image"
        )
    masks = files.get("mask", [])
    if len(masks) > 1:
        raise InvalidRequestError(f"expected at most one `mask` file, got {len(masks)}", param="mask")
    out = {"image": images[0]}
    if masks:
        out["mask"] = masks[0]
    return body, out


async def image_params(
    form: Any, files: dict[str, bytes], strength: float | None, *, alpha_as_mask: bool
) -> dict[str, Any]:
    """Diffusion params of an edit / variation: the decoded image (resized to ``form.size`` if
    given), its mask (the ``mask`` file, or the image's own transparency when ``alpha_as_mask``),
    and the form's extension fields."""
    size = form.dimensions()
    decoded = await decode_async(decode_image, files["image"], "image", size)
    mask = None
    if "mask" in files:
        mask = await decode_async(decode_mask, files["mask"], "mask", decoded.size, size)
    elif alpha_as_mask:
        mask = decoded.alpha_mask
    params = {
        "image": decoded.rgb,
        "mask_image": mask,
        "strength": strength,
        "negative_prompt": form.negative_prompt,
        "num_inference_steps": form.num_inference_steps,
        "guidance_scale": form.guidance_scale,
        "timeout": form.timeout,
    }
    return {k: v for k, v in params.items() if v is not None}


#: Engine param -> the HTTP field that carries it, for error messages.
HTTP_FIELDS = {"mask_image": "mask", "height": "size", "width": "size"}
