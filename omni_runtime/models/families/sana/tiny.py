"""``builtin:tiny-sana``: a Sana pipeline with random (seeded) weights, built offline.

A linear-attention DiT (``SanaTransformer2DModel``) over a deep-compression autoencoder
(``AutoencoderDC``) with Sana's 32x spatial compression, a decoder-only Gemma 2 text encoder with
a byte-fallback BPE tokenizer in Gemma's layout, and the flow-matching DPM-Solver++ that Sana
ships with. Native size 128 px: transformer sample size 4 latents, patch 1, VAE scale factor 32.

Two of the pipeline's defaults do not fit a tiny model, which is why the runner reads sizes from
the model: ``height``/``width`` default to 1024 in the call signature whatever the model, and
resolution binning only knows the real models' sample sizes (16 to 128).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_runtime.models.components import gemma_tokenizer, save_pipeline, seeded

LATENT_CHANNELS = 4
GEMMA_WIDTH = 16
GEMMA: dict[str, Any] = dict(
    hidden_size=GEMMA_WIDTH,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    # Rotary positions: a longer context costs nothing, and Sana prepends a long instruction.
    max_position_embeddings=8192,
    sliding_window=256,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
TRANSFORMER: dict[str, Any] = dict(
    sample_size=4,
    patch_size=1,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    num_layers=2,
    num_attention_heads=2,
    attention_head_dim=8,
    num_cross_attention_heads=2,
    cross_attention_head_dim=8,
    cross_attention_dim=16,
    caption_channels=GEMMA_WIDTH,
)
#: Six levels, five 2x downsamplings: the 32x compression of Sana's DC-AE, with few channels.
VAE: dict[str, Any] = dict(
    in_channels=3,
    latent_channels=LATENT_CHANNELS,
    attention_head_dim=4,
    encoder_block_types=("ResBlock",) * 4 + ("EfficientViTBlock",) * 2,
    decoder_block_types=("ResBlock",) * 4 + ("EfficientViTBlock",) * 2,
    encoder_block_out_channels=(8, 8, 16, 16, 32, 32),
    decoder_block_out_channels=(8, 8, 16, 16, 32, 32),
    encoder_layers_per_block=(1, 1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1, 1, 1),
    encoder_qkv_multiscales=((), (), (), (), (5,), (5,)),
    decoder_qkv_multiscales=((), (), (), (), (5,), (5,)),
    decoder_norm_types="rms_norm",
    decoder_act_fns="silu",
    scaling_factor=0.41407,
)
SCHEDULER: dict[str, Any] = dict(
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
    algorithm_type="dpmsolver++",
    solver_order=2,
)
SEED = 0


def build_tiny_sana(path: Path) -> None:
    """Write ``tiny-sana`` (128 px native, VAE scale 32) into the empty directory ``path``."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = gemma_tokenizer()
    gemma_config = Gemma2Config(vocab_size=len(tokenizer), **GEMMA)
    pipe = SanaPipeline(
        transformer=seeded(SEED, lambda: SanaTransformer2DModel(**TRANSFORMER)),
        vae=seeded(SEED, lambda: AutoencoderDC(**VAE)),
        text_encoder=seeded(SEED, lambda: Gemma2Model(gemma_config)),
        tokenizer=tokenizer,
        scheduler=DPMSolverMultistepScheduler(**SCHEDULER),
    )
    save_pipeline(pipe, path)
