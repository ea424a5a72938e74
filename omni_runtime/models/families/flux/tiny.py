"""``builtin:tiny-flux``: a FLUX.1-style pipeline with random (seeded) weights, built offline.

A ``FluxTransformer2DModel`` (double-stream blocks, then single-stream ones, rotary position
ids) over 2x2-packed latents, with a guidance embedding as in FLUX.1-dev (``guidance_scale`` is
an input of the model, not classifier-free guidance), a CLIP encoder for the pooled vector, a T5
encoder for the token states, and a flow-matching Euler scheduler with resolution-dependent shift.

The Flux pipeline defaults to 128 latent pixels whatever the model (1024 px for the real VAE,
256 px for this one); this model's native size is its VAE's ``sample_size``, 64 px, which the
runner reads and passes. With VAE scale factor 2 and 2x2 packing, sizes go in multiples of 4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_runtime.models.components import clip_tokenizer, save_pipeline, seeded, t5_tokenizer
from omni_runtime.models.families.sd.tiny import TEXT_ENCODER
from omni_runtime.models.families.sd3.tiny import T5_ENCODER

LATENT_CHANNELS = 4
TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    # A packed latent token holds a 2x2 patch of every latent channel.
    in_channels=4 * LATENT_CHANNELS,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=T5_ENCODER["d_model"],
    pooled_projection_dim=TEXT_ENCODER["hidden_size"],
    guidance_embeds=True,
    # Rotary dims per axis (text index, row, column); they add up to attention_head_dim.
    axes_dims_rope=(4, 6, 6),
)
VAE: dict[str, Any] = dict(
    block_out_channels=(32, 64),
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    latent_channels=LATENT_CHANNELS,
    norm_num_groups=32,
    sample_size=64,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.1159,
    scaling_factor=0.3611,
)
#: FLUX.1-dev's scheduler: the shift grows with the image's token count.
SCHEDULER: dict[str, Any] = dict(
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
SEED = 0


def build_tiny_flux(path: Path) -> None:
    """Write ``tiny-flux`` (64 px native) into the empty directory ``path``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer_2 = t5_tokenizer()
    t5_config = T5Config(vocab_size=len(tokenizer_2), **T5_ENCODER)
    pipe = FluxPipeline(
        transformer=seeded(SEED, lambda: FluxTransformer2DModel(**TRANSFORMER)),
        vae=seeded(SEED, lambda: AutoencoderKL(**VAE)),
        text_encoder=seeded(SEED, lambda: CLIPTextModel(CLIPTextConfig(**TEXT_ENCODER))),
        text_encoder_2=seeded(SEED, lambda: T5EncoderModel(t5_config)),
        tokenizer=clip_tokenizer(),
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )
    save_pipeline(pipe, path, clip_tokenizers=("tokenizer",))
