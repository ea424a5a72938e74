"""Each surface's request fields ↔ engine params (:class:`~entrypoints.openai.fields.FieldMap`),
one table per (task, surface); the registry (registry.py) names which task takes which. A surface
is where a request comes in: ``images`` (``/v1/images/*``), ``generate`` (``/v1/generate`` jobs,
and ``/v1/videos`` over them), ``speech`` (``/v1/audio/speech``), ``chat``
(``/v1/chat/completions``), ``realtime`` (``WS /v1/realtime``) and ``cli`` (``omni-runtime generate``'s options)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..openai.fields import FieldMap


def _lora(body: Any) -> dict[str, Any] | None:
    """A request's ``lora`` as the engine param (its adapter and scale)."""
    return body.lora.params() if body.lora else None


#: ``/v1/images/generations``: the seed is the route's own (image ``i`` gets ``seed + i``).
IMAGE_GENERATION = FieldMap(
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
    read={"lora": _lora, "size": lambda body: body.dimensions()},
    computed={"seed": "seed"},
)
#: ``/v1/images/edits`` and ``variations`` (multipart forms): the image, its mask and ``size``
#: (which resizes the upload) are decoded by the route (uploads.image_params).
IMAGE_INPUT = FieldMap(
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
#: ``POST /v1/generate``, the diffusion tasks: their fields go to the stages that take image
#: params (an image model refuses the video and audio ones itself).
GENERATE_DIFFUSION = FieldMap(
    {
        "inputs.negative_prompt": "negative_prompt",
        "inputs.num_inference_steps": "num_inference_steps",
        "inputs.guidance_scale": "guidance_scale",
        "inputs.seed": "seed",
        "inputs.size": ("width", "height"),
        "inputs.num_frames": "num_frames",
        "inputs.fps": "fps",
        "inputs.seconds": "audio_end_in_s",
        "inputs.audio_start_in_s": "audio_start_in_s",
        "inputs.num_waveforms_per_prompt": "num_waveforms_per_prompt",
        "inputs.cache": "cache",
    },
    read={"inputs.size": lambda body: body.inputs.dimensions()},
    computed={"inputs.prompt": "prompt", "inputs.image": "image"},
)
#: ``POST /v1/generate``, task ``text2speech``: its fields go to the speech stage (the prompt is
#: the text to speak).
GENERATE_SPEECH = FieldMap(
    {"inputs.voice": "voice", "inputs.speed": "speed", "inputs.seed": "seed"}, computed={"inputs.prompt": "prompt"}
)
#: ``POST /v1/generate``, every task: to every stage that has the param.
GENERATE_SHARED = FieldMap(
    {"config.timeout": "timeout", "config.slo_ms": "slo_ms", "priority": "priority"},
    read={"priority": lambda body: body.priority or None},
)
#: ``POST /v1/audio/speech``: the text is the engine's prompt.
SPEECH = FieldMap(
    {"voice": "voice", "speed": "speed", "seed": "seed"},
    read={"voice": lambda body: body.voice_name()},
    computed={"input": "prompt"},
)
#: ``POST /v1/chat/completions``: to every stage that takes the param.
CHAT = FieldMap(
    {
        "max_tokens": "max_tokens",
        "temperature": "temperature",
        "top_p": "top_p",
        "stop": "stop",
        "seed": "seed",
        "timeout": "timeout",
        "lora": "lora",
        "priority": "priority",
        "audio.voice": "voice",
    },
    read={
        "audio.voice": lambda body: body.audio.voice_name() if body.audio else None,
        "max_tokens": lambda body: body.max_completion_tokens or body.max_tokens,
        "stop": lambda body: [body.stop] if isinstance(body.stop, str) else body.stop,
        "lora": _lora,
    },
)
#: ``WS /v1/realtime``: a response's settings (over the session's) to every stage that takes them.
#: An audio turn's pcm16 goes to the speech-recognition stage as samples, at the session's input rate.
REALTIME = FieldMap(
    {
        "voice": "voice",
        "max_response_output_tokens": "max_tokens",
        "audio": "audio",
        "input_sample_rate": "sample_rate",
    },
    read={
        "max_response_output_tokens": lambda start: start.max_tokens,
        "audio": lambda start: np.frombuffer(start.audio, "<i2") if start.audio else None,
        "input_sample_rate": lambda start: start.sample_rate,
    },
)
#: ``omni-runtime generate``, the diffusion tasks: its options (argparse's names) as image params;
#: the input image and the LoRA adapter are read by the command.
CLI_DIFFUSION = FieldMap(
    {
        "steps": "num_inference_steps",
        "guidance_scale": "guidance_scale",
        "frames": "num_frames",
        "fps": "fps",
        "seconds": "audio_end_in_s",
        "size": ("width", "height"),
    },
    computed={"image": "image", "lora": "lora", "seed": "seed"},
)
#: ``omni-runtime generate``, task ``text2speech``: to the speech stage (the seed is per request).
CLI_SPEECH = FieldMap({"voice": "voice", "speed": "speed"}, computed={"seed": "seed"})
