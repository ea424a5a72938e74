"""``POST /v1/generate``: a job's task, inputs and delivery."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from omni_runtime.bounds import MAX_PROMPT_CHARS
from omni_runtime.bounds import pydantic as bounds

from .common import JobFormat, Priority, Seed, SloMs, StepCacheField, Timeout, _Request, _SizedRequest, parse_size


class GenerateInputs(_SizedRequest):
    """What to generate: ``inputs`` of ``POST /v1/generate`` (task ``text2image``)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    negative_prompt: Annotated[str, Field(**bounds("negative_prompt"))] | None = None
    #: ``WxH``; or ``width`` and ``height``; unset: the stage's default size.
    size: str | None = None
    width: Annotated[int, Field(**bounds("width"))] | None = None
    height: Annotated[int, Field(**bounds("height"))] | None = None
    num_inference_steps: Annotated[int, Field(**bounds("num_inference_steps"))] | None = None
    guidance_scale: Annotated[float, Field(**bounds("guidance_scale"))] | None = None
    seed: Seed | None = None
    #: Frames and playback rate of a video (task ``text2video``); an image model refuses them.
    num_frames: Annotated[int, Field(**bounds("num_frames"))] | None = None
    fps: Annotated[int, Field(**bounds("fps"))] | None = None
    #: The first frame of task ``image2video``: a ``data:image/...;base64,`` URL (remote URLs are
    #: refused, never fetched), decoded and bounded as the images routes' uploads are.
    image: str | None = None
    #: Length of each clip, seconds (task ``text2audio``: the model's ``audio_end_in_s``).
    seconds: Annotated[float, Field(**bounds("audio_end_in_s"))] | None = None
    #: Where each clip starts, seconds (task ``text2audio``).
    audio_start_in_s: Annotated[float, Field(**bounds("audio_start_in_s"))] | None = None
    #: Clips to make (task ``text2audio``).
    num_waveforms_per_prompt: Annotated[int, Field(**bounds("num_waveforms_per_prompt"))] | None = None
    #: The speaker (task ``text2speech``): the model's own name or an OpenAI voice name.
    voice: Annotated[str, Field(**bounds("voice"))] | None = None
    #: How fast to speak (task ``text2speech``).
    speed: Annotated[float, Field(**bounds("speed"))] | None = None
    #: Step caching of a diffusion task (as ``cache`` on the images routes).
    cache: StepCacheField | None = None

    @model_validator(mode="after")
    def _one_size(self) -> GenerateInputs:
        if self.size is not None and (self.width is not None or self.height is not None):
            raise ValueError("give either size or width and height, not both")
        if (self.width is None) != (self.height is None):
            raise ValueError("width and height go together")
        return self

    def dimensions(self) -> tuple[int, int] | None:
        if self.size is not None:
            return parse_size(self.size)
        return None if self.width is None or self.height is None else (self.width, self.height)


class GenerateConfig(_Request):
    """How to run and deliver it: ``config`` of ``POST /v1/generate``."""

    #: Unset: ``png`` for an image task, ``wav`` for an audio task (a video is always MP4).
    output_format: JobFormat | None = None
    output_compression: int | None = Field(None, ge=0, le=100)
    #: The engine's deadline for the generation (seconds), as ``timeout`` on the other routes.
    timeout: Timeout | None = None
    slo_ms: SloMs | None = None


class GenerateRequest(_Request):
    """``POST /v1/generate``: a job. ``async_run`` (the default) answers at once with the queued job;
    ``async_run: false`` waits for the job to end and answers with the same shape."""

    task: Literal["text2image", "text2video", "image2video", "text2audio", "text2speech"]
    model: str | None = None
    inputs: GenerateInputs
    config: GenerateConfig = Field(default_factory=GenerateConfig)
    async_run: bool = True
    #: Higher is served first (docs/configuration.md, "Priority"); default 0.
    priority: Priority = 0
    response_format: Literal["url", "b64_json"] = "url"
