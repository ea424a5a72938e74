"""``builtin:tiny-pixart``: a PixArt-Sigma pipeline with random (seeded) weights, built offline.

A DiT (``PixArtTransformer2DModel``: adaLN-single timestep conditioning, cross-attention to T5
states, learned-sigma output with twice the latent channels) over a small KL VAE, with a T5
encoder and the DPM-Solver++ scheduler PixArt ships with. Native size 64 px: transformer sample
size 32 latents, patch 2, VAE scale factor 2.

PixArt's pipeline by default rewrites prompts (``clean_caption``, which needs extra packages) and
snaps sizes to its aspect-ratio buckets (``use_resolution_binning``); the runner turns both off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_runtime.models.components import save_pipeline, seeded, t5_tokenizer, tiny_t5_encoder
from omni_runtime.models.families.sd.tiny import TINY_VAE

T5_ENCODER: dict[str, Any] = tiny_t5_encoder()
TRANSFORMER: dict[str, Any] = dict(
    sample_size=32,
    num_layers=2,
    patch_size=2,
    attention_head_dim=8,
    num_attention_heads=3,
    caption_channels=T5_ENCODER["d_model"],
    in_channels=4,
    cross_attention_dim=24,
    # Mean and variance per latent channel.
    out_channels=8,
    attention_bias=True,
    activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000,
    norm_type="ada_norm_single",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
)
SCHEDULER: dict[str, Any] = dict(
    beta_start=0.0001,
    beta_end=0.02,
    beta_schedule="linear",
    algorithm_type="dpmsolver++",
    solver_order=2,
)
SEED = 0


def build_tiny_pixart(path: Path) -> None:
    """Write ``tiny-pixart`` (64 px native) into the empty directory ``path``."""
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    tokenizer = t5_tokenizer()
    t5_config = T5Config(vocab_size=len(tokenizer), **T5_ENCODER)
    pipe = PixArtSigmaPipeline(
        transformer=seeded(SEED, lambda: PixArtTransformer2DModel(**TRANSFORMER)),
        vae=seeded(SEED, lambda: AutoencoderKL(**TINY_VAE)),
        text_encoder=seeded(SEED, lambda: T5EncoderModel(t5_config)),
        tokenizer=tokenizer,
        scheduler=DPMSolverMultistepScheduler(**SCHEDULER),
    )
    save_pipeline(pipe, path)
