"""``builtin:tiny-sd3``: a Stable Diffusion 3 pipeline with random (seeded) weights, built offline.

An MMDiT (``SD3Transformer2DModel``: text and image tokens in one joint attention) over a VAE
with SD3's shift/scale latent normalisation, three text encoders (two CLIPs with projection, whose
pooled outputs are concatenated, and a T5 encoder whose states the CLIP states are padded to), and
the rectified-flow ``FlowMatchEulerDiscreteScheduler``. Native size 64 px: transformer sample
size 32 latents, patch 2, VAE scale factor 2 (so sizes go in multiples of 4, 8 with the runner).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_runtime.models.components import clip_tokenizer, save_pipeline, seeded, t5_tokenizer, tiny_t5_encoder
from omni_runtime.models.families.sd.tiny import TEXT_ENCODER

CLIP_PROJECTION_DIM = 32
#: T5's width is the joint attention width; the two CLIPs' 32 + 32 states are zero-padded up to it.
T5_WIDTH = 64
T5_ENCODER: dict[str, Any] = tiny_t5_encoder(d_model=T5_WIDTH, d_ff=64)
TRANSFORMER: dict[str, Any] = dict(
    sample_size=32,
    patch_size=2,
    in_channels=4,
    out_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=T5_WIDTH,
    caption_projection_dim=32,
    pooled_projection_dim=2 * CLIP_PROJECTION_DIM,
    # Positional embeddings cover up to 64x64 patches (256 px), so sizes above native still work.
    pos_embed_max_size=64,
)
#: SD3's VAE has no quant convs and normalises latents with a shift as well as a scale.
VAE: dict[str, Any] = dict(
    block_out_channels=(32, 64),
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=64,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.0609,
    scaling_factor=1.5035,
)
SCHEDULER: dict[str, Any] = dict(shift=3.0)
SEED = 0


def build_tiny_sd3(path: Path) -> None:
    """Write ``tiny-sd3`` (64 px native) into the empty directory ``path``."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_config = CLIPTextConfig(**{**TEXT_ENCODER, "projection_dim": CLIP_PROJECTION_DIM})
    tokenizer_3 = t5_tokenizer()
    t5_config = T5Config(vocab_size=len(tokenizer_3), **T5_ENCODER)
    pipe = StableDiffusion3Pipeline(
        transformer=seeded(SEED, lambda: SD3Transformer2DModel(**TRANSFORMER)),
        vae=seeded(SEED, lambda: AutoencoderKL(**VAE)),
        text_encoder=seeded(SEED, lambda: CLIPTextModelWithProjection(clip_config)),
        text_encoder_2=seeded(SEED + 1, lambda: CLIPTextModelWithProjection(clip_config)),
        text_encoder_3=seeded(SEED, lambda: T5EncoderModel(t5_config)),
        tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(),
        tokenizer_3=tokenizer_3,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )
    save_pipeline(pipe, path, clip_tokenizers=("tokenizer", "tokenizer_2"))
