"""Input images of HTTP requests: multipart uploads and ``data:`` URLs, decoded with Pillow in the
gateway (never on a stage: the engine gets raw uint8 arrays).

Bounded before any pixel is decoded: the body limit of the server (413), then the image's
header: its format must be one of :data:`INPUT_FORMATS` (Pillow's other decoders never see an
upload), and the size it declares must fit the model (the smallest ``max_pixels`` of the stages
that take images, from their READY message) or, when the request resizes the input, the upload
limit :data:`MAX_UPLOAD_PIXELS`. Anything Pillow raises while reading or converting an upload (not
an image, a truncated PNG, an odd mode) is the client's: a 400 naming the field. Remote URLs are
never fetched.

Decoding runs in a small pool of its own (:data:`DECODE_THREADS` threads), so at most that many
images are in memory being decoded at once, whatever the number of requests; after a large
decode the freed memory is handed back to the system.

Runs on the server's event loop; decoding itself runs in the pool (:func:`decode_async`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import ctypes
import ctypes.util
import io
import re
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.params import MAX_IMAGE_PIXELS

from .fields import FieldMap

#: Most pixels an uploaded image may declare when the request resizes it (``size``); without a
#: resize the model's own limit applies, which is never more.
MAX_UPLOAD_PIXELS = MAX_IMAGE_PIXELS
#: Formats taken as input images, recognised from their header: the ones clients send photos and
#: drawings in. TIFF, DDS, PSD and the rest are refused (400) without running their decoders.
INPUT_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: Images decoded at once by this server (each may briefly need a few times its RGBA size).
DECODE_THREADS = 2
T = TypeVar("T")
_DATA_URL = re.compile(r"^data:(image/[a-z0-9.+-]+)?(;[a-z0-9=._-]+)*;base64,", re.IGNORECASE)
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_executor: ThreadPoolExecutor | None = None


def _load_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_malloc_trim = _load_trim()


@dataclass
class InputImage:
    """A decoded input: RGB pixels, and the mask its transparency makes (None if opaque)."""

    rgb: np.ndarray
    #: (width, height) as uploaded, before any resize.
    size: tuple[int, int]
    #: 255 where the image is fully transparent (the region to edit, as OpenAI's edits take it).
    alpha_mask: np.ndarray | None


@dataclass(frozen=True)
class Upload:
    """An upload to decode, and what bounds it: ``limit`` is the model's pixel limit
    (:meth:`AsyncOmni.max_input_pixels`); ``size`` (width, height) the resize the request asks."""

    data: bytes
    param: str
    limit: int = MAX_UPLOAD_PIXELS
    size: tuple[int, int] | None = None


def decode_image(upload: Upload) -> InputImage:
    """Decode an uploaded image (one of :data:`INPUT_FORMATS`), resized to ``upload.size`` if given.

    Raises InvalidRequestError naming ``upload.param`` for what is not a whole, bounded image.
    """
    with _decoding(upload.param):
        image = _open(upload)
        return _to_input(_load(image), upload.size)


def decode_image_and_mask(image: Upload, mask: Upload) -> tuple[InputImage, np.ndarray]:
    """An edit's image and mask: both headers are checked before either is decoded."""
    with _decoding(image.param):
        opened = _open(image)
    with _decoding(mask.param):
        opened_mask = _open(mask)
        if opened_mask.size != opened.size:
            w, h = opened_mask.size
            raise InvalidRequestError(
                f"`{mask.param}` is {w}x{h}, but the image is {opened.size[0]}x{opened.size[1]}: "
                "a mask has the size of its image",
                param=mask.param,
            )
    with _decoding(image.param):
        decoded = _to_input(_load(opened), image.size)
    with _decoding(mask.param):
        return decoded, _to_mask(_load(opened_mask), image.size)


@contextlib.contextmanager
def _decoding(param: str) -> Iterator[None]:
    """Whatever Pillow raises on an upload (each decoder has its own exception classes, some as
    odd as NotImplementedError) is the client's: a 400 naming ``param``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # Pillow warns (and decodes anyway) between its limit and twice it: refuse instead.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except InvalidRequestError:
        raise
    except UnidentifiedImageError:
        raise InvalidRequestError(
            f"`{param}` is not an image this server can decode (formats taken: {', '.join(INPUT_FORMATS)})",
            param=param,
        ) from None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        message = f"`{param}` is over the pixel limit (a decompression bomb): {e}"
        raise InvalidRequestError(message, param=param) from None
    except Exception as e:  # a decoder's failure on client data, whatever its class
        raise InvalidRequestError(f"`{param}` could not be decoded ({type(e).__name__}: {e})", param=param) from None


def _open(upload: Upload) -> Any:
    """The image as its header describes it, nothing decoded yet, after the checks on its format
    and on the size it declares."""
    from PIL import Image

    param = upload.param
    if not upload.data:
        raise InvalidRequestError(f"`{param}` is empty: upload an image file (PNG, JPEG, WebP...)", param=param)
    image = Image.open(io.BytesIO(upload.data), formats=INPUT_FORMATS)
    width, height = image.size
    if upload.size is None:
        limit, whose = upload.limit, "this model's limit"
    else:
        # Resized before use: the target is bounded by the model's limit, the upload by the upload limit.
        tw, th = upload.size
        if tw * th > upload.limit:
            message = f"`size` {tw}x{th} is over this model's limit of {upload.limit} pixels"
            raise InvalidRequestError(message, param="size")
        limit, whose = MAX_UPLOAD_PIXELS, "the upload limit"
    if width < 1 or height < 1 or width * height > limit:
        raise InvalidRequestError(
            f"`{param}` declares {width}x{height} pixels; {whose} is {limit} pixels per input image "
            "(refused before decoding)",
            param=param,
        )
    return image


def _load(image: Any) -> Any:
    if getattr(image, "n_frames", 1) > 1:
        image.seek(0)  # an animation: its first frame
    image.load()
    return image


def _normalised(image: Any) -> Any:
    """``image`` as RGB or RGBA (RGBA when it has transparency), whatever its mode."""
    from PIL import Image

    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        # 16-bit (or wider) samples: scaled to 8 bits, not clipped to white.
        wide = np.asarray(image, dtype=np.float64)
        scale = 1.0 if image.mode == "F" else 257.0
        image = Image.fromarray(np.clip(wide / scale, 0, 255).astype(np.uint8), "L")
    transparent = image.mode in _ALPHA_MODES or (image.mode == "P" and "transparency" in image.info)
    return image.convert("RGBA" if transparent else "RGB")


def _to_input(image: Any, size: tuple[int, int] | None) -> InputImage:
    from PIL import Image

    uploaded = image.size
    image = _normalised(image)
    alpha = None
    if image.mode == "RGBA":
        a = np.asarray(image.getchannel("A"))
        if (a == 0).any():
            alpha = np.where(a == 0, 255, 0).astype(np.uint8)
        image = image.convert("RGB")
    if size is not None and image.size != size:
        image = image.resize(size, Image.Resampling.LANCZOS)
        if alpha is not None:
            alpha = np.asarray(Image.fromarray(alpha).resize(size, Image.Resampling.NEAREST))
    return InputImage(np.asarray(image, dtype=np.uint8), uploaded, alpha)


def _to_mask(image: Any, size: tuple[int, int] | None) -> np.ndarray:
    """A mask as uint8 HxW, 255 = edit: its transparent pixels if it has an alpha channel
    (OpenAI's convention), else its luminance (white = edit, diffusers' convention)."""
    from PIL import Image

    image = _normalised(image)
    if image.mode == "RGBA":
        mask = np.where(np.asarray(image.getchannel("A")) == 0, 255, 0).astype(np.uint8)
    else:
        mask = np.asarray(image.convert("L"), dtype=np.uint8)
    if size is not None and image.size != size:
        mask = np.asarray(Image.fromarray(mask).resize(size, Image.Resampling.NEAREST))
    return mask


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


def _trimmed(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    finally:
        if _malloc_trim is not None:
            # The decode's planes are freed by now; without this glibc keeps them for the process.
            _malloc_trim(0)


async def decode_async(fn: Callable[..., T], *args: Any) -> T:
    """Run a decoder in the decode pool, off the event loop: at most :data:`DECODE_THREADS`
    decodes hold memory at once, the rest wait their turn."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="image-decode")
    return await asyncio.get_running_loop().run_in_executor(_executor, _trimmed, fn, *args)


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

    form = await parse_form(request)
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


async def parse_form(request: Any) -> Any:
    """The request's multipart form (at most 4 files and 64 fields), or a 400 for a body that does
    not parse."""
    try:
        return await request.form(max_files=4, max_fields=64)
    except Exception as e:  # python-multipart's and Starlette's parse errors, whatever their class
        raise InvalidRequestError(f"malformed multipart/form-data body: {e}", param=None) from None


async def read_text_form(request: Any, refused: Mapping[str, str]) -> dict[str, str]:
    """The text fields of a multipart request that takes no file, each given once, for a pydantic
    model to validate (lax: ``"9"`` is the int 9, as in JSON). ``refused`` maps a field a route
    does not take yet (as a file part, a text field or a nested ``field[key]``) to why: a 400
    naming it, its upload never read. Any other file part is a 400 naming it.

    Raises InvalidRequestError (400) naming the field.
    """
    from starlette.datastructures import UploadFile

    form = await parse_form(request)
    try:
        fields: dict[str, str] = {}
        for key, value in form.multi_items():
            name = key.split("[", 1)[0]
            if name in refused:
                raise InvalidRequestError(f"`{name}`: {refused[name]}", param=name)
            if isinstance(value, UploadFile):
                raise InvalidRequestError(f"unknown file field `{key}`: this route takes no file", param=key)
            if key in fields:
                raise InvalidRequestError(f"`{key}` is given more than once", param=key)
            fields[key] = value
    finally:
        await form.close()
    return fields


async def read_form(request: Any, file_fields: Collection[str]) -> tuple[dict[str, str], dict[str, bytes]]:
    """The text fields of a multipart request, each given once, and its file parts, each one of
    ``file_fields`` and given at most once (read whole: the server's body limit bounds them).

    Raises InvalidRequestError (400) naming the field: an unknown file part, a file field sent as
    text, a field given twice.
    """
    from starlette.datastructures import UploadFile

    form = await parse_form(request)
    try:
        fields: dict[str, str] = {}
        files: dict[str, bytes] = {}
        for key, value in form.multi_items():
            if key in fields or key in files:
                raise InvalidRequestError(f"`{key}` is given more than once", param=key)
            if isinstance(value, UploadFile):
                if key not in file_fields:
                    raise InvalidRequestError(f"unknown file field `{key}`", param=key)
                files[key] = await value.read()
            elif key in file_fields:
                raise InvalidRequestError(
                    f"`{key}` must be a file part (multipart/form-data with a filename), not a text field", param=key
                )
            else:
                fields[key] = value
    finally:
        await form.close()
    return fields, files


async def image_params(
    form: Any, files: dict[str, bytes], strength: float | None, *, alpha_as_mask: bool, limit: int, fields: FieldMap
) -> dict[str, Any]:
    """Diffusion params of an edit / variation: the decoded image (resized to ``form.size`` if
    given), its mask (the ``mask`` file, or the image's own transparency when ``alpha_as_mask``),
    and the form's extension fields as ``fields`` maps them. ``limit``: the model's pixel limit
    on input images."""
    size = form.dimensions()
    image = Upload(files["image"], "image", limit, size)
    mask: np.ndarray | None
    if "mask" in files:
        decoded, mask = await decode_async(decode_image_and_mask, image, Upload(files["mask"], "mask", limit, size))
    else:
        decoded = await decode_async(decode_image, image)
        mask = decoded.alpha_mask if alpha_as_mask else None
    params = {"image": decoded.rgb, "mask_image": mask, "strength": strength} | fields.params(form)
    return {k: v for k, v in params.items() if v is not None}
