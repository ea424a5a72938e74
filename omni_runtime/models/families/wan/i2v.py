"""Wan image-to-video: the ``image`` form of a Wan model, its first frame given.

Diffusers' ``WanImageToVideoPipeline`` takes the first frame in one of two ways, by the model:

- Wan 2.2 TI2V (``expand_timesteps``): the image's latent *replaces* the first latent frame, which
  stays clean through denoising (its timestep is 0); the transformer's input is the latents
  alone, so a text-to-video model serves it with no other weights.
- Wan 2.1 I2V: the image's latent (with a first-frame mask) is *concatenated* to the latents on
  channels (``in_channels = 2 x z_dim + 4``), plus CLIP image embeddings where the transformer has
  an ``image_dim``.

:class:`WanFirstFrameToVideoPipeline` picks the way a loaded model's channels allow, and refuses
(``ValueError``, so the form is reported missing at load with the reason) a model that fits
neither, instead of failing every request later. Its ``__call__`` takes one image, not a list:
the runner runs its requests one pipeline call each (``single_image``).
"""

from __future__ import annotations

from typing import Any

from diffusers import WanImageToVideoPipeline

#: Latent channels of the first-frame mask the Wan 2.1 way concatenates (the VAE's 4x time
#: compression: one mask channel per packed frame).
MASK_CHANNELS = 4


class WanFirstFrameToVideoPipeline(WanImageToVideoPipeline):
    """``WanImageToVideoPipeline`` with the first-frame conditioning the model's channels take."""

    #: Its ``__call__`` takes one PIL image or tensor (``check_inputs``), never a list.
    single_image = True

    def __init__(
        self,
        tokenizer: Any,
        text_encoder: Any,
        vae: Any,
        scheduler: Any,
        image_processor: Any = None,
        image_encoder: Any = None,
        transformer: Any = None,
        transformer_2: Any = None,
        boundary_ratio: float | None = None,
        expand_timesteps: bool = False,
    ) -> None:
        # The parent's parameters, spelt out: from_pipe reads the component names from them.
        super().__init__(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=vae,
            scheduler=scheduler,
            image_processor=image_processor,
            image_encoder=image_encoder,
            transformer=transformer,
            transformer_2=transformer_2,
            boundary_ratio=boundary_ratio,
            expand_timesteps=expand_timesteps,
        )
        transformer = self.transformer if self.transformer is not None else self.transformer_2
        channels = int(transformer.config.in_channels)
        latent = int(self.vae.config.z_dim)
        if channels == latent:
            self.register_to_config(expand_timesteps=True)
        elif channels == 2 * latent + MASK_CHANNELS and not self.config.expand_timesteps:
            if transformer.config.image_dim is not None and self.image_encoder is None:
                raise ValueError("its transformer takes CLIP image embeddings (image_dim) but it has no image_encoder")
        else:
            raise ValueError(
                f"its transformer takes {channels} input channels: a first frame needs {latent} (Wan 2.2 TI2V) or "
                f"{2 * latent + MASK_CHANNELS} (Wan 2.1 I2V)"
            )
