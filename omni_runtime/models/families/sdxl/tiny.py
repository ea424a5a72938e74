"""``builtin:tiny-sdxl``: a Stable Diffusion XL pipeline with random (seeded) weights, built offline.

What makes it SDXL rather than SD: two CLIP text encoders whose hidden states are concatenated for
cross-attention (``CLIPTextModel`` + ``CLIPTextModelWithProjection``, the second one's pooled,
projected output feeding the UNet's "text_time" embedding together with the six size/crop
conditions), linear attention projections, and an Euler scheduler. Native size 64 px (UNet sample
size 32, VAE scale factor 2), like ``tiny-sd``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_runtime.models.components import clip_tokenizer, save_pipeline, seeded
from omni_runtime.models.families.sd.tiny import TEXT_ENCODER, TINY_VAE

#: Text encoder 2's projection width; the UNet's added embedding takes it plus 6 size conditions.
PROJECTION_DIM = 32
TIME_EMBED_DIM = 8
UNET: dict[str, Any] = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    sample_size=32,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=TIME_EMBED_DIM,
    transformer_layers_per_block=(1, 2),
    # The two encoders' hidden states side by side: 32 + 32.
    cross_attention_dim=2 * TEXT_ENCODER["hidden_size"],
    projection_class_embeddings_input_dim=6 * TIME_EMBED_DIM + PROJECTION_DIM,
    norm_num_groups=32,
)
SCHEDULER: dict[str, Any] = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    timestep_spacing="leading",
    steps_offset=1,
)
SEED = 0


def build_tiny_sdxl(path: Path) -> None:
    """Write ``tiny-sdxl`` (64 px native, VAE scale 2) into the empty directory ``path``."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    text_config = CLIPTextConfig(**{**TEXT_ENCODER, "projection_dim": PROJECTION_DIM})
    pipe = StableDiffusionXLPipeline(
        vae=seeded(SEED, lambda: AutoencoderKL(**TINY_VAE)),
        text_encoder=seeded(SEED, lambda: CLIPTextModel(text_config)),
        text_encoder_2=seeded(SEED + 1, lambda: CLIPTextModelWithProjection(text_config)),
        tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(),
        unet=seeded(SEED, lambda: UNet2DConditionModel(**UNET)),
        scheduler=EulerDiscreteScheduler(**SCHEDULER),
        # No invisible watermark: it needs a package this runtime does not carry, and a tiny
        # model's noise images have nothing to mark.
        add_watermarker=False,
    )
    save_pipeline(pipe, path, clip_tokenizers=("tokenizer", "tokenizer_2"))
