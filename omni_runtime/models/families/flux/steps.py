"""The Flux step loop (step execution; see ``omni_runtime.stage.runners.diffusion_steps``)."""

from __future__ import annotations

import copy

import numpy as np
import torch

from omni_runtime.stage.runners.diffusion_steps import StepFamily, StepState, repeat_rows


class FluxFamily(StepFamily):
    """FLUX.1: packed 2x2 latent tokens with positions, CLIP pooled + T5, guidance as a model input
    (no classifier-free guidance: a per-sample guidance value instead), shifted flow-matching sigmas."""

    pipelines = ("FluxPipeline",)
    scales_input = False
    step_kwargs = False
    begin_index = True

    def uses_cfg(self, guidance: float) -> bool:
        return False

    def encode(self, states: list[StepState]) -> None:
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=[s.prompt for s in states],
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.defaults.get("max_sequence_length", 512),
        )
        guided = self.pipe.transformer.config.guidance_embeds
        for i, s in enumerate(states):
            s.cond.update(embeds=repeat_rows(embeds, i, s.rows), pooled=repeat_rows(pooled, i, s.rows))
            if guided:
                s.cond["guidance"] = torch.full([s.rows], s.guidance, device=self.device, dtype=torch.float32)
            s.shared["txt_ids"] = text_ids

    def latent_channels(self) -> int:
        return self.pipe.transformer.config.in_channels // 4

    def prepare(self, state: StepState) -> None:
        # Flux makes the (packed) noise first: the shift of its sigmas depends on the token count.
        state.latents, state.shared["img_ids"] = self.noise(state)
        scheduler = self.pipe.scheduler
        n = state.num_inference_steps
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
        mu = self.module.calculate_shift(
            state.latents.shape[1],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        self.module.retrieve_timesteps(scheduler, n, self.device, sigmas=sigmas, mu=mu)
        state.scheduler = copy.deepcopy(scheduler)
        state.scheduler.set_begin_index(0)
        state.timesteps = state.scheduler.timesteps

    def call_denoiser(self, x, t, cond, states):
        shared = states[0].shared  # positions: equal for every request of one size
        return self.pipe.transformer(
            hidden_states=x,
            timestep=t.to(x.dtype) / 1000,
            guidance=cond.get("guidance"),
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["embeds"],
            txt_ids=shared["txt_ids"],
            img_ids=shared["img_ids"],
            return_dict=False,
        )[0]

    def to_image(self, latents, states):
        vae = self.pipe.vae
        s = states[0]
        latents = self.pipe._unpack_latents(latents, s.height, s.width, self.pipe.vae_scale_factor)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0]
