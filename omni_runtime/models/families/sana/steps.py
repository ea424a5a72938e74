"""The Sana step loop (step execution; see ``omni_runtime.stage.runners.diffusion_steps``)."""

from __future__ import annotations

from typing import Any

import torch

from omni_runtime.models.families.pixart.steps import PixArtFamily
from omni_runtime.stage.runners.diffusion_steps import StepState


class SanaFamily(PixArtFamily):
    """Sana: PixArt's loop on a linear-attention DiT (Gemma embeddings with Sana's instruction
    prefix, scaled timesteps, float32 latents and predictions), decoded by a DC-AE."""

    pipelines = ("SanaPipeline",)
    scales_input = False

    def encode_kwargs(self) -> dict[str, Any]:
        return {**super().encode_kwargs(), "complex_human_instruction": self.defaults.get("complex_human_instruction")}

    def latent_dtype(self, state: StepState) -> torch.dtype:
        return torch.float32

    def call_denoiser(self, x, t, cond, states):
        transformer = self.pipe.transformer
        dtype = transformer.dtype
        return transformer(
            x.to(dtype=dtype),
            encoder_hidden_states=cond["embeds"].to(dtype=dtype),
            encoder_attention_mask=cond["mask"],
            timestep=t * transformer.config.timestep_scale,
            return_dict=False,
        )[0].float()
