"""The split Stable Diffusion runners' former home, kept so that configs naming
``omni_runtime.stage.runners.sd_split:<Class>`` keep working; they live in the SD family's package
(:mod:`omni_runtime.models.families.sd.split`) and are the builtin stage types ``sd_text_encoder``,
``sd_denoise`` and ``sd_vae_decode``."""

from omni_runtime.models.families.sd.split import (
    SDDenoiseRunner,
    SDTextEncoderRunner,
    SDVaeDecodeRunner,
    vae_scale_factor,
)

__all__ = ["SDDenoiseRunner", "SDTextEncoderRunner", "SDVaeDecodeRunner", "vae_scale_factor"]
