"""Builders of the ``builtin:tiny-sd`` and ``builtin:small-sd`` models.

Both are Stable Diffusion pipelines with random (seeded) weights and a hand-written CLIP BPE
vocabulary, so they are made without any download and two builds are byte-identical. They are
written with ``save_pretrained`` and afterwards loaded like any real model, through
``DiffusionPipeline.from_pretrained``.

* ``tiny-sd``: a 1.4M-parameter UNet and a VAE with scale factor 2 (native size 64 px).
* ``small-sd``: a 17.6M-parameter UNet and a VAE with scale factor 8 like real SD (native 256 px).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from omni_runtime.models.components import save_pipeline, write_clip_vocab

TINY_UNET: dict[str, Any] = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    sample_size=32,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=32,
    norm_num_groups=32,
)
TINY_VAE: dict[str, Any] = dict(
    block_out_channels=(32, 64),
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=64,
)
SMALL_UNET: dict[str, Any] = dict(
    block_out_channels=(64, 128, 256),
    layers_per_block=2,
    sample_size=32,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=32,
)
SMALL_VAE: dict[str, Any] = dict(
    block_out_channels=(32, 64, 64, 64),
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=256,
)
TEXT_ENCODER: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=5,
    layer_norm_eps=1e-5,
    max_position_embeddings=77,
    projection_dim=32,
    vocab_size=522,
    bos_token_id=520,
    eos_token_id=521,
    pad_token_id=521,
)
SCHEDULER: dict[str, Any] = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
)
SEED = 0


def _build(path: Path, unet_config: dict[str, Any], vae_config: dict[str, Any]) -> None:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    path = Path(path)
    # Each component is seeded on its own, so a change to one leaves the others' weights alone;
    # fork_rng keeps the caller's global random state as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        unet = UNet2DConditionModel(**unet_config)
        torch.manual_seed(SEED)
        vae = AutoencoderKL(**vae_config)
        torch.manual_seed(SEED)
        text_encoder = CLIPTextModel(CLIPTextConfig(**TEXT_ENCODER))
    with tempfile.TemporaryDirectory() as vocab_dir:
        write_clip_vocab(Path(vocab_dir))
        tokenizer = CLIPTokenizer.from_pretrained(vocab_dir, model_max_length=77, local_files_only=True)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(**SCHEDULER),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    save_pipeline(pipe, path, clip_tokenizers=("tokenizer",))


def build_tiny_sd(path: Path) -> None:
    """Write ``tiny-sd`` (64 px native, VAE scale 2) into the empty directory ``path``."""
    _build(path, TINY_UNET, TINY_VAE)


def build_small_sd(path: Path) -> None:
    """Write ``small-sd`` (256 px native, VAE scale 8) into the empty directory ``path``."""
    _build(path, SMALL_UNET, SMALL_VAE)
