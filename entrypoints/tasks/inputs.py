"""What every surface checks of a request's task and input image the same way: the model serves
the task (a 400 naming ``model`` with the refusal's code), and an input image given as a data
URL (a job's ``inputs.image``, a chat message's ``image_url``) is decoded and bounded as the
images routes' uploads are. Runs on the server's event loop (decoding in the upload pool)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from omni_runtime.exceptions import InvalidRequestError

from ..capabilities import ModelCapabilities, UnsupportedTaskError
from ..openai.protocol import ApiError
from ..openai.uploads import Upload, decode_async, decode_data_url, decode_image

if TYPE_CHECKING:
    from ..openai.state import ModelHandle


class Named(Protocol):
    """A served model or a request's handle on one."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> ModelCapabilities: ...


def require(model: Named, task: str) -> int | None:
    """The stage of ``model`` that serves ``task`` (None for chat), or a 400 naming ``model``
    whose code says what it lacks (``no_image``, ``no_video``, ``no_audio``, ``no_speech``)."""
    try:
        return model.capabilities.require(model.name, task)
    except UnsupportedTaskError as e:
        raise ApiError(400, str(e), param="model", code=e.code) from None


async def input_image(model: ModelHandle, url: str, param: str, size: tuple[int, int] | None = None) -> dict[str, Any]:
    """``{"image": rgb}`` of the data URL ``url`` (resized to ``size`` when given); a model that
    takes no input image is a 400 naming ``param`` before anything is decoded."""
    if not model.capabilities.image_input:
        raise InvalidRequestError(f"the model `{model.name}` takes no input image", param=param)
    upload = Upload(decode_data_url(url, param), param, model.engine.max_input_pixels(), size)
    return {"image": (await decode_async(decode_image, upload)).rgb}
