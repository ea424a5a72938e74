"""``builtin:tiny-ltx``: an LTX-Video 0.9 text-to-video pipeline with random (seeded) weights, built offline.

A video DiT (``LTXVideoTransformer3DModel``: one token per latent pixel, cross-attention to T5
states) over LTX's 3D VAE, here compressing space and time 8x each (the real one packs 4 x 4
pixels into each of its 128 channels first: 32x in space), a tiny T5 encoder and the
flow-matching Euler scheduler LTX ships with. Native size 32 px: a video of ``8k + 1`` frames is
``k + 1`` latent frames of 4 x 4 latents. A 9-frame 32 x 32 video in a few steps takes well under
a second on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_runtime.models.components import save_pipeline, seeded, t5_tokenizer, tiny_t5_encoder

T5_ENCODER: dict[str, Any] = tiny_t5_encoder()
LATENT_CHANNELS = 8
#: Three of four levels scale space and time by 2 each, and no pixel patching: 8x in both.
VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=LATENT_CHANNELS,
    block_out_channels=(8, 8, 8, 8),
    decoder_block_out_channels=(8, 8, 8, 8),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True, False),
    decoder_spatio_temporal_scaling=(True, True, True, False),
    decoder_inject_noise=(False, False, False, False, False),
    upsample_residual=(False, False, False, False),
    upsample_factor=(1, 1, 1, 1),
    timestep_conditioning=False,
    patch_size=1,
    patch_size_t=1,
    encoder_causal=True,
    decoder_causal=False,
)
TRANSFORMER: dict[str, Any] = dict(
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    num_layers=2,
    caption_channels=T5_ENCODER["d_model"],
)
#: Text tokens the pipeline pads prompts to (LTX's default is 128; the tiny one needs few).
MAX_SEQUENCE_LENGTH = 32
SEED = 0


def build_tiny_ltx(path: Path) -> None:
    """Write ``tiny-ltx`` (32 px native, frames 8k + 1) into the empty directory ``path``."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    tokenizer = t5_tokenizer(model_max_length=MAX_SEQUENCE_LENGTH)
    config = T5Config(vocab_size=len(tokenizer), **T5_ENCODER)
    pipe = LTXPipeline(
        transformer=seeded(SEED, lambda: LTXVideoTransformer3DModel(**TRANSFORMER)),
        vae=seeded(SEED, lambda: AutoencoderKLLTXVideo(**VAE)),
        text_encoder=seeded(SEED, lambda: T5EncoderModel(config)),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    save_pipeline(pipe, path)
