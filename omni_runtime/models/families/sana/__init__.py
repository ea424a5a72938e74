"""Sana: Gemma 2 text encoder, linear-attention DiT, 32x DC-AE autoencoder."""

from omni_runtime.models.families import FamilySpec, register

SPEC = register(
    FamilySpec(
        name="sana",
        pipelines=("SanaPipeline",),
        denoiser="SanaTransformer2DModel",
        builders={"tiny-sana": "omni_runtime.models.families.sana.tiny:build_tiny_sana"},
        tiny="tiny-sana",
        native_size=128,
        size_multiple=32,
        size_floor=32,  # SanaPipeline.check_inputs takes multiples of 32 only, whatever the VAE
        steps="omni_runtime.models.families.sana.steps:SanaFamily",
        image_forms={"image": None, "mask": None},
        golden=(0.4587, 0.4685, 0.4737, 0.5805, 0.5212, 0.4951, 0.5155, 0.486, 0.5234),
    )
)
