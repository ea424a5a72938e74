"""LTX-Video 0.9 text-to-video: a T5 text encoder, a video DiT over a 3D VAE that compresses space
32x and time 8x (LTX 0.9: 4 x 4 pixel patches, then three 2x levels), and flow-matching Euler."""

from __future__ import annotations

import math
from typing import Any

from omni_runtime.models.families import FamilySpec, register
from omni_runtime.stage.runners.sizes import SizeLimits

#: ``LTXPipeline.check_inputs`` refuses sizes that are not multiples of 32, whatever the VAE.
LTX_SIZE_FLOOR = 32


def ltx_limits(pipe: Any) -> SizeLimits:
    """Sizes are multiples of the VAE's spatial compression x the transformer's patch size (32 x 1
    for LTX 0.9), and of 32 in any case (the pipeline's own check); frame counts are ``8k + 1``
    (the VAE keeps the first frame and packs each 8 after it into one latent frame, for LTX 0.9).
    Its positions are computed, not tabled: no most frames of the model's own."""
    spatial = int(pipe.vae_spatial_compression_ratio)
    temporal = int(pipe.vae_temporal_compression_ratio)
    patch = int(pipe.transformer_spatial_patch_size)
    patch_t = int(pipe.transformer_temporal_patch_size)
    reason = f"the VAE spatial compression {spatial} x the {type(pipe.transformer).__name__} patch size {patch}"
    multiple = math.lcm(LTX_SIZE_FLOOR, spatial * patch)
    if multiple != spatial * patch:
        reason += f", and the pipeline takes multiples of {LTX_SIZE_FLOOR} only"
    return SizeLimits(
        multiple=multiple,
        reason=reason,
        # LTX's transformer config states no trained size; the requests' default comes from the
        # stage's default_sampling_params.
        native=(None, None),
        frames_step=temporal * patch_t,
        frames_reason=f"the VAE compresses time {temporal}x after the first frame",
    )


SPEC = register(
    FamilySpec(
        name="ltx",
        pipelines=("LTXPipeline",),
        denoiser="LTXVideoTransformer3DModel",
        output="video",
        builders={"tiny-ltx": "omni_runtime.models.families.ltx.tiny:build_tiny_ltx"},
        tiny="tiny-ltx",
        native_size=32,
        size_multiple=32,
        size_floor=LTX_SIZE_FLOOR,
        limits="omni_runtime.models.families.ltx:ltx_limits",
        callback="on_step_end",
        # LTXPipeline's own frame_rate default; the request's fps is passed as its frame_rate (the
        # transformer's rotary positions are scaled by it), so fps changes the video, not only the file.
        fps=25,
        golden=(0.693, 0.3998, 0.5863, 0.7313, 0.5924, 0.5106, 0.7424, 0.4489, 0.5592),
    )
)
