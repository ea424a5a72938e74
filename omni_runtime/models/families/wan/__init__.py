"""Wan text-to-video and image-to-video: UMT5 text encoder, a video DiT (patches of 1 x 2 x 2
latents), and a causal 3D VAE that compresses space 8x and time 4x. A model serves a request with
an ``image`` (the first frame) through :mod:`omni_runtime.models.families.wan.i2v`."""

from __future__ import annotations

from typing import Any

from omni_runtime.models.families import FamilySpec, register
from omni_runtime.stage.runners.sizes import SizeLimits


def wan_limits(pipe: Any) -> SizeLimits:
    """Sizes are multiples of the VAE's spatial factor x the transformer's patch size (8 x 2 = 16
    for Wan 2.1); frame counts are ``4k + 1`` (the VAE keeps the first frame and packs each 4 after
    it into one latent frame), at most as many latent frames as the transformer's rotary table."""
    spatial = int(pipe.vae_scale_factor_spatial)
    temporal = int(pipe.vae_scale_factor_temporal)
    config = pipe.transformer.config
    _, patch_h, patch_w = (int(p) for p in config.patch_size)
    patch = max(patch_h, patch_w)
    rope = getattr(config, "rope_max_seq_len", None)
    table = f"the {type(pipe.transformer).__name__} rotary table of {rope} positions"
    return SizeLimits(
        multiple=spatial * patch,
        # Each axis of patches takes positions from the same rotary table: a side past it fails
        # inside the transformer (32 x 1024 with a 32-position table).
        max_side=int(rope) * spatial * patch if rope else None,
        max_side_reason=f"{table} per axis x {spatial * patch} pixels a patch" if rope else None,
        reason=f"the VAE spatial factor {spatial} x the {type(pipe.transformer).__name__} patch size {patch}",
        # Wan's transformer config states no trained size; the requests' default comes from the
        # stage's default_sampling_params.
        native=(None, None),
        frames_step=temporal,
        frames_reason=f"the VAE compresses time {temporal}x after the first frame",
        max_frames=(int(rope) - 1) * temporal + 1 if rope else None,
    )


SPEC = register(
    FamilySpec(
        name="wan",
        pipelines=("WanPipeline",),
        denoiser="WanTransformer3DModel",
        # Image-to-video: the request's image is the first frame (see the wan.i2v module).
        image_forms={"image": "omni_runtime.models.families.wan.i2v:WanFirstFrameToVideoPipeline", "mask": None},
        output="video",
        builders={"tiny-wan": "omni_runtime.models.families.wan.tiny:build_tiny_wan"},
        tiny="tiny-wan",
        native_size=32,
        size_multiple=16,
        size_floor=16,
        limits="omni_runtime.models.families.wan:wan_limits",
        callback="on_step_end",
        steps="omni_runtime.models.families.wan.steps:WanFamily",
        fps=16,
        golden=(0.4979, 0.5333, 0.5681, 0.5316, 0.5251, 0.5104, 0.568, 0.5841, 0.5486),
    )
)
