"""``POST /v1/videos``: text to video, or image to video with ``input_reference``."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from omni_runtime.bounds import MAX_PROMPT_CHARS
from omni_runtime.bounds import pydantic as bounds

from .common import NotBool, Priority, Seed, SloMs, Timeout, _Request, _SizedRequest, seconds_of


class VideoReference(_Request):
    """OpenAI's JSON ``input_reference`` object: ``image_url`` as a data URL. A ``file_id`` is
    refused (this server keeps no uploaded files to refer to)."""

    image_url: str | None = None
    file_id: str | None = Field(None, max_length=256)


class VideoCreateRequest(_SizedRequest):
    """``POST /v1/videos`` (JSON or a form; text to video, or image to video with
    ``input_reference``): OpenAI's fields and the extensions
    (``extra_body`` of the openai client). ``seconds`` becomes a frame count (docs/http_api.md,
    "Videos"): with ``num_frames`` too, both must name the same count."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None
    #: Seconds of video, as a string (``"4"``); OpenAI's field.
    seconds: str | None = Field(None, max_length=16)
    #: ``WxH``; unset: the stage's default size.
    size: str | None = None
    num_frames: Annotated[int, Field(**bounds("num_frames")), NotBool] | None = None
    fps: Annotated[int, Field(**bounds("fps")), NotBool] | None = None
    negative_prompt: Annotated[str, Field(**bounds("negative_prompt"))] | None = None
    num_inference_steps: Annotated[int, Field(**bounds("num_inference_steps")), NotBool] | None = None
    guidance_scale: Annotated[float, Field(**bounds("guidance_scale")), NotBool] | None = None
    seed: Seed | None = None
    timeout: Timeout | None = None
    slo_ms: SloMs | None = None
    priority: Priority = 0
    #: The first frame (image to video): OpenAI's reference object in JSON; a multipart upload
    #: (the openai client's file) is read by the route and never reaches this model.
    input_reference: VideoReference | None = None

    @field_validator("seconds")
    @classmethod
    def _check_seconds(cls, value: str | None) -> str | None:
        if value is not None:
            seconds_of(value)
        return value
