"""Stable Diffusion XL: two CLIP text encoders, UNet with added conditions."""

from omni_runtime.models.families import FamilySpec, register

SPEC = register(
    FamilySpec(
        name="sdxl",
        pipelines=("StableDiffusionXLPipeline",),
        denoiser="UNet2DConditionModel",
        builders={"tiny-sdxl": "omni_runtime.models.families.sdxl.tiny:build_tiny_sdxl"},
        tiny="tiny-sdxl",
        native_size=64,
        size_multiple=8,
        steps="omni_runtime.models.families.sdxl.steps:StableDiffusionXLFamily",
        image_forms={"image": "StableDiffusionXLImg2ImgPipeline", "mask": "StableDiffusionXLInpaintPipeline"},
        golden=(0.5723, 0.6128, 0.4885, 0.5151, 0.5918, 0.4856, 0.5533, 0.5337, 0.5115),
    )
)
