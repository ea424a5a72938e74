"""Stable Diffusion 1.x / 2.x: CLIP text encoder, UNet, 8x VAE."""

from omni_runtime.models.families import FamilySpec, register
from omni_runtime.params import DiffusionSamplingParams
from omni_runtime.stage.runners.stage_types import StageType

_SPLIT = "omni_runtime.models.families.sd.split"

SPEC = register(
    FamilySpec(
        name="sd",
        pipelines=("StableDiffusionPipeline",),
        denoiser="UNet2DConditionModel",
        builders={
            "tiny-sd": "omni_runtime.models.families.sd.tiny:build_tiny_sd",
            "small-sd": "omni_runtime.models.families.sd.tiny:build_small_sd",
        },
        tiny="tiny-sd",
        native_size=64,
        size_multiple=8,
        steps="omni_runtime.models.families.sd.steps:StableDiffusionFamily",
        image_forms={"image": "StableDiffusionImg2ImgPipeline", "mask": "StableDiffusionInpaintPipeline"},
        # Stable Diffusion as three stages (stage_configs/tiny-sd-split.yaml, docs/multistage.md).
        stage_types={
            "sd_text_encoder": StageType(f"{_SPLIT}:SDTextEncoderRunner", DiffusionSamplingParams, needs_model=True),
            "sd_denoise": StageType(f"{_SPLIT}:SDDenoiseRunner", DiffusionSamplingParams, needs_model=True),
            "sd_vae_decode": StageType(f"{_SPLIT}:SDVaeDecodeRunner", DiffusionSamplingParams, needs_model=True),
        },
        golden=(0.4971, 0.5633, 0.4595, 0.4977, 0.5626, 0.4547, 0.5192, 0.4796, 0.4832),
    )
)
