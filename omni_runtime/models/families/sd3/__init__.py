"""Stable Diffusion 3: CLIP x 2 + T5, MMDiT transformer (patch size 2), flow matching."""

from omni_runtime.models.families import FamilySpec, register

SPEC = register(
    FamilySpec(
        name="sd3",
        pipelines=("StableDiffusion3Pipeline",),
        denoiser="SD3Transformer2DModel",
        builders={"tiny-sd3": "omni_runtime.models.families.sd3.tiny:build_tiny_sd3"},
        tiny="tiny-sd3",
        native_size=64,
        size_multiple=8,
        # The MMDiT crops its positions from a table of pos_embed_max_size patches per side: a side
        # past it fails in the model (tiny-sd3: 64 patches x 2 x VAE factor 2 = 256 px; SD3
        # Medium: 192 x 2 x 8 = 3072 px).
        position_table="pos_embed_max_size",
        steps="omni_runtime.models.families.sd3.steps:StableDiffusion3Family",
        image_forms={"image": "StableDiffusion3Img2ImgPipeline", "mask": "StableDiffusion3InpaintPipeline"},
        form_channels={"StableDiffusion3InpaintPipeline": (16, 33)},
        golden=(0.6015, 0.5518, 0.5159, 0.6161, 0.4558, 0.4299, 0.5955, 0.4978, 0.4808),
    )
)
