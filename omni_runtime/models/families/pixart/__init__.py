"""PixArt-Sigma: T5 text encoder, DiT transformer (patch size 2)."""

from omni_runtime.models.families import FamilySpec, register

SPEC = register(
    FamilySpec(
        name="pixart",
        pipelines=("PixArtSigmaPipeline",),
        denoiser="PixArtTransformer2DModel",
        builders={"tiny-pixart": "omni_runtime.models.families.pixart.tiny:build_tiny_pixart"},
        tiny="tiny-pixart",
        native_size=64,
        size_multiple=8,
        steps="omni_runtime.models.families.pixart.steps:PixArtFamily",
        callback="legacy",  # PixArtSigmaPipeline takes callback / callback_steps, not callback_on_step_end
        image_forms={"image": None, "mask": None},
        golden=(0.31, 0.4692, 0.398, 0.3727, 0.5344, 0.4348, 0.4299, 0.4553, 0.497),
    )
)
