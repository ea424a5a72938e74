"""``builtin:tiny-wan``: a Wan 2.1 text-to-video pipeline with random (seeded) weights, built offline.

A video DiT (``WanTransformer3DModel``: patches of 1 frame x 2 x 2 latents, cross-attention to
UMT5 states) over the Wan causal 3D VAE (8x spatial, 4x temporal compression), with a UMT5
encoder and the flow-matching UniPC scheduler Wan ships with. Native size 32 px: a video of
``4k + 1`` frames is ``k + 1`` latent frames of 4 x 4 latents. A 9-frame 32 x 32 video with a
few steps takes about a second on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_runtime.models.components import save_pipeline, seeded, t5_tokenizer, tiny_t5_encoder

#: UMT5 is T5 with per-layer relative attention biases; the tiny one shares T5's tokenizer layout.
UMT5_ENCODER: dict[str, Any] = tiny_t5_encoder()
Z_DIM = 4
TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=Z_DIM,
    out_channels=Z_DIM,
    text_dim=UMT5_ENCODER["d_model"],
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
VAE: dict[str, Any] = dict(
    base_dim=8,
    z_dim=Z_DIM,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.0] * Z_DIM,
    latents_std=[1.0] * Z_DIM,
)
#: Wan's own scheduler: UniPC over flow-matching sigmas, shifted (Wan 2.1 uses shift 3 at 480p).
SCHEDULER: dict[str, Any] = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
#: Text tokens the pipeline pads prompts to (Wan's default is 512; the tiny one needs few).
MAX_SEQUENCE_LENGTH = 32
SEED = 0


def build_tiny_wan(path: Path) -> None:
    """Write ``tiny-wan`` (32 px native, frames 4k + 1) into the empty directory ``path``."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(model_max_length=MAX_SEQUENCE_LENGTH)
    config = UMT5Config(vocab_size=len(tokenizer), **UMT5_ENCODER)
    pipe = WanPipeline(
        transformer=seeded(SEED, lambda: WanTransformer3DModel(**TRANSFORMER)),
        vae=seeded(SEED, lambda: AutoencoderKLWan(**VAE)),
        text_encoder=seeded(SEED, lambda: UMT5EncoderModel(config)),
        tokenizer=tokenizer,
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
    )
    save_pipeline(pipe, path)
