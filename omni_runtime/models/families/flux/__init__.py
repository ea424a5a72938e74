"""Flux: CLIP + T5, packed 2x2 latents, guidance-distilled transformer."""

from omni_runtime.models.families import FamilySpec, register

SPEC = register(
    FamilySpec(
        name="flux",
        pipelines=("FluxPipeline",),
        denoiser="FluxTransformer2DModel",
        builders={"tiny-flux": "omni_runtime.models.families.flux.tiny:build_tiny_flux"},
        tiny="tiny-flux",
        native_size=64,
        size_multiple=8,
        latent_packing=2,  # 2x2 latents per transformer token
        steps="omni_runtime.models.families.flux.steps:FluxFamily",
        image_forms={"image": "FluxImg2ImgPipeline", "mask": "FluxInpaintPipeline"},
        golden=(0.6983, 0.5327, 0.5878, 0.4745, 0.3867, 0.435, 0.435, 0.4386, 0.4298),
    )
)
