"""``/v1/images/*``: generations (JSON), edits and variations (multipart forms), and their answer."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from omni_runtime.bounds import MAX_PROMPT_CHARS
from omni_runtime.bounds import pydantic as bounds

from .common import ImageFormat, LoraSpec, Priority, Seed, SloMs, StepCacheField, Timeout, _SizedRequest

#: Most images one images request may ask for (each is its own engine request).
MAX_IMAGES = 10


class _ImagesRequest(_SizedRequest):
    """What every images route takes: how many, what size, how returned, and the image params."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: ImageFormat = "png"
    #: JPEG / WebP quality (0-100).
    output_compression: int | None = Field(None, ge=0, le=100)
    # Extensions (``extra_body`` of the openai client) beyond here.
    negative_prompt: Annotated[str, Field(**bounds("negative_prompt"))] | None = None
    num_inference_steps: Annotated[int, Field(**bounds("num_inference_steps"))] | None = None
    guidance_scale: Annotated[float, Field(**bounds("guidance_scale"))] | None = None
    #: Seed of the first image; image i gets ``seed + i``.
    seed: Seed | None = None
    timeout: Timeout | None = None
    slo_ms: SloMs | None = None
    cache: StepCacheField | None = None


class ImageGenerationRequest(_ImagesRequest):
    """``POST /v1/images/generations``."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    #: ``WxH``; ``auto`` or unset uses the stage's default size.
    size: str | None = None
    #: A registered LoRA adapter and its scale (an extension).
    lora: LoraSpec | None = None
    priority: Priority | None = None
    # Sent by OpenAI callers; no meaning for this runtime.
    user: str | None = Field(None, max_length=256)
    quality: str | None = Field(None, max_length=32)
    style: str | None = Field(None, max_length=32)
    background: str | None = Field(None, max_length=32)
    moderation: str | None = Field(None, max_length=32)
    #: Image streaming is not offered: only ``false`` is accepted.
    stream: Literal[False] | None = None


class _ImageInputForm(_ImagesRequest):
    """Fields shared by the multipart image-input routes (edits, variations), parsed from form
    values (strings, converted as pydantic's lax mode does). The files (``image``, ``mask``) are
    read separately."""

    #: ``WxH``: the input is resized to it; ``auto`` or unset keeps the input's size.
    size: str | None = None
    #: How far the input is noised (0 < strength <= 1); unset: the pipeline's default for edits,
    #: :data:`VARIATION_STRENGTH` for variations.
    strength: Annotated[float, Field(**bounds("strength"))] | None = None
    # Sent by OpenAI callers; no meaning for this runtime.
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)


class ImageEditForm(_ImageInputForm):
    """``POST /v1/images/edits`` (multipart/form-data, as ``client.images.edit`` sends it)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    # Sent by OpenAI callers; no meaning for this runtime.
    background: str | None = Field(None, max_length=32)
    input_fidelity: str | None = Field(None, max_length=32)
    quality: str | None = Field(None, max_length=32)
    partial_images: int | None = Field(None, ge=0, le=3)
    #: Image streaming is not offered: only ``false`` is accepted.
    stream: Literal[False] | None = None


class ImageVariationForm(_ImageInputForm):
    """``POST /v1/images/variations`` (multipart/form-data, as ``client.images.create_variation``
    sends it): no prompt; the input is redrawn with :data:`VARIATION_STRENGTH` unless ``strength``
    is given."""


#: How far a variation departs from its input unless the request says (img2img ``strength``).
VARIATION_STRENGTH = 0.75


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None
    seed: int | None = None


class ImageGenerationResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageData]
    output_format: str | None = None
    size: str | None = None
