"""Model directories without weights for the GPU kit (benchmarks/gpu.py): each model's published
configs written as files, loaded with ``engine_args.load_format: dummy`` (random weights built on
the GPU in seconds, nothing downloaded).

Full size (``write_models(out)``):

- ``sdxl``: Stable Diffusion XL base 1.0: the 2.6B UNet, its VAE, CLIP ViT-L and OpenCLIP bigG
  text encoders, the Euler scheduler.
- ``flux``: FLUX.1-dev: the 12B transformer (19 double-stream and 38 single-stream blocks, 3072
  wide, guidance embedding), its 16-channel VAE, CLIP ViT-L, and T5 v1.1 XXL **at 2 of its 24
  layers** (it runs once per request, not per step; its width, vocabulary and 512 tokens are as
  published, so the transformer sees the real text length).
- ``wan``: Wan 2.1 T2V 1.3B: the transformer (30 layers, 1536 wide), the Wan VAE, UMT5-XXL **at 2
  of its 24 layers** (same reason), the flow UniPC scheduler with the 480p shift.

Tokenizers are the builtins' offline tiny ones (components.clip_tokenizer / t5_tokenizer): their
ids are far below the encoders' vocabularies, so prompts encode to the published sequence lengths.
``write_models(out, tiny=True)``: the same families with the tiny builtins' configs (the CPU dry
run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_runtime.models.components import clip_tokenizer, t5_tokenizer, tiny_t5_encoder
from omni_runtime.models.families.flux import tiny as tiny_flux
from omni_runtime.models.families.sd.tiny import TEXT_ENCODER, TINY_VAE, write_clip_vocab
from omni_runtime.models.families.sdxl import tiny as tiny_sdxl
from omni_runtime.models.families.wan import tiny as tiny_wan

#: The tiny CLIP tokenizer's special ids, which a full-size CLIP encoder must use to find its
#: pooled (end-of-text) position.
CLIP_IDS = {k: TEXT_ENCODER[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
CLIP_L: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_attention_heads=12,
    num_hidden_layers=12,
    hidden_act="quick_gelu",
    projection_dim=768,
    max_position_embeddings=77,
    vocab_size=49408,
    **CLIP_IDS,
)
CLIP_BIG_G: dict[str, Any] = dict(
    CLIP_L,
    hidden_size=1280,
    intermediate_size=5120,
    num_attention_heads=20,
    num_hidden_layers=32,
    hidden_act="gelu",
    projection_dim=1280,
)
#: Encoder layers kept of T5 v1.1 XXL and UMT5-XXL (24 each).
T5_LAYERS = 2
T5_XXL: dict[str, Any] = dict(
    tiny_t5_encoder(),
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_heads=64,
    num_layers=T5_LAYERS,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    layer_norm_epsilon=1e-6,
    vocab_size=32128,
    tie_word_embeddings=False,
)
UMT5_XXL: dict[str, Any] = dict(T5_XXL, vocab_size=256384)

SDXL_UNET: dict[str, Any] = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    block_out_channels=(320, 640, 1280),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(5, 10, 20),
    transformer_layers_per_block=(1, 2, 10),
    cross_attention_dim=2048,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)
SDXL_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    latent_channels=4,
    layers_per_block=2,
    sample_size=1024,
    scaling_factor=0.13025,
    force_upcast=True,
)
FLUX_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
FLUX_VAE: dict[str, Any] = dict(
    SDXL_VAE,
    latent_channels=16,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
WAN_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
#: The Wan VAE's per-channel latent statistics, as published.
WAN_LATENTS_MEAN = """-0.7571 -0.7089 -0.9113 0.1075 -0.1745 0.9653 -0.1517 1.5508
    0.4134 -0.0715 0.5517 -0.3632 -0.1922 -0.9497 0.2503 -0.2921"""
WAN_LATENTS_STD = """2.8184 1.4541 2.3275 2.6558 1.2196 1.7708 2.6052 2.0743
    3.2687 2.1526 2.8652 1.5579 1.6382 1.1253 2.8251 1.9160"""
WAN_VAE: dict[str, Any] = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    temperal_downsample=[False, True, True],
    latents_mean=[float(x) for x in WAN_LATENTS_MEAN.split()],
    latents_std=[float(x) for x in WAN_LATENTS_STD.split()],
)


@dataclass(frozen=True)
class ModelFiles:
    """One model directory: the pipeline class, its components as ``(library, class, config)``,
    tokenizers as ``(class, make, is_clip)``, and settings of ``model_index.json``."""

    pipeline: str
    modules: dict[str, tuple[str, str, dict[str, Any]]]
    tokenizers: dict[str, tuple[str, Any, bool]]
    settings: dict[str, Any] = field(default_factory=dict)


def _families(tiny: bool) -> dict[str, ModelFiles]:
    clip = TEXT_ENCODER if tiny else CLIP_L
    # The tiny encoders' vocabulary is the tiny tokenizer's, as in their builders.
    t5_vocab = {"vocab_size": len(t5_tokenizer())}
    t5 = dict(tiny_flux.T5_ENCODER, **t5_vocab) if tiny else T5_XXL
    umt5 = dict(tiny_wan.UMT5_ENCODER, **t5_vocab) if tiny else UMT5_XXL
    wan_length = tiny_wan.MAX_SEQUENCE_LENGTH if tiny else 512
    return {
        "sdxl": ModelFiles(
            pipeline="StableDiffusionXLPipeline",
            modules={
                "unet": ("diffusers", "UNet2DConditionModel", tiny_sdxl.UNET if tiny else SDXL_UNET),
                "vae": ("diffusers", "AutoencoderKL", TINY_VAE if tiny else SDXL_VAE),
                "text_encoder": ("transformers", "CLIPTextModel", clip),
                "text_encoder_2": (
                    "transformers",
                    "CLIPTextModelWithProjection",
                    dict(TEXT_ENCODER, projection_dim=tiny_sdxl.PROJECTION_DIM) if tiny else CLIP_BIG_G,
                ),
                "scheduler": ("diffusers", "EulerDiscreteScheduler", tiny_sdxl.SCHEDULER),
            },
            tokenizers={
                "tokenizer": ("CLIPTokenizer", clip_tokenizer, True),
                "tokenizer_2": ("CLIPTokenizer", clip_tokenizer, True),
            },
            settings={"force_zeros_for_empty_prompt": True},
        ),
        "flux": ModelFiles(
            pipeline="FluxPipeline",
            modules={
                "transformer": (
                    "diffusers",
                    "FluxTransformer2DModel",
                    tiny_flux.TRANSFORMER if tiny else FLUX_TRANSFORMER,
                ),
                "vae": ("diffusers", "AutoencoderKL", tiny_flux.VAE if tiny else FLUX_VAE),
                "text_encoder": ("transformers", "CLIPTextModel", clip),
                "text_encoder_2": ("transformers", "T5EncoderModel", t5),
                "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", tiny_flux.SCHEDULER),
            },
            tokenizers={
                "tokenizer": ("CLIPTokenizer", clip_tokenizer, True),
                "tokenizer_2": ("T5Tokenizer", lambda: t5_tokenizer(512), False),
            },
        ),
        "wan": ModelFiles(
            pipeline="WanPipeline",
            modules={
                "transformer": (
                    "diffusers",
                    "WanTransformer3DModel",
                    tiny_wan.TRANSFORMER if tiny else WAN_TRANSFORMER,
                ),
                "vae": ("diffusers", "AutoencoderKLWan", tiny_wan.VAE if tiny else WAN_VAE),
                "text_encoder": ("transformers", "UMT5EncoderModel", umt5),
                "scheduler": ("diffusers", "UniPCMultistepScheduler", tiny_wan.SCHEDULER),
            },
            tokenizers={"tokenizer": ("T5Tokenizer", lambda: t5_tokenizer(wan_length), False)},
            settings={"boundary_ratio": None, "expand_timesteps": False},
        ),
    }


def write_models(out: Path, tiny: bool = False) -> dict[str, Path]:
    """Write every family's directory under ``out`` (configs and tokenizers only); name -> path."""
    import diffusers
    import transformers

    paths = {}
    for name, model in _families(tiny).items():
        root = out / name
        root.mkdir(parents=True, exist_ok=True)
        index: dict[str, Any] = {"_class_name": model.pipeline, "_diffusers_version": diffusers.__version__}
        index.update(model.settings)
        for component, (library, cls, config) in model.modules.items():
            folder = root / component
            folder.mkdir(exist_ok=True)
            index[component] = [library, cls]
            if library == "transformers":
                getattr(transformers, cls).config_class(**config).save_pretrained(folder)
            else:
                filename = "scheduler_config.json" if component == "scheduler" else "config.json"
                data = {"_class_name": cls, "_diffusers_version": diffusers.__version__, **config}
                (folder / filename).write_text(json.dumps(data, indent=2))
        for component, (cls, make, is_clip) in model.tokenizers.items():
            index[component] = ["transformers", cls]
            make().save_pretrained(root / component)
            if is_clip:  # transformers 5 writes tokenizer.json only; the slow CLIP files as the builtins have
                write_clip_vocab(root / component)
        (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        paths[name] = root
    return paths
