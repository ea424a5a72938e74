"""The Wan text-to-video step loop (step execution; see ``omni_runtime.stage.runners.diffusion_steps``).

What ``WanPipeline.__call__`` does, per sample: UMT5 prompts (and negatives under cfg) padded to
one length, float32 noise of ``B x C x F' x H' x W'`` latents, the DiT called with a timestep per
sample, the guidance combine, the flow-matching scheduler's step, and the decode of de-normalised
latents through the causal 3D VAE and the video processor. The runner keys a step by frames and
size, so the latents of one denoiser call have one shape.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_runtime.stage.runners.diffusion_steps import StepFamily, StepState, negative_prompts, repeat_rows


class WanFamily(StepFamily):
    """Wan 2.1 T2V: a video DiT on flow matching (UniPC), UMT5 text states, a causal 3D VAE."""

    pipelines = ("WanPipeline",)
    scales_input = False
    step_kwargs = False
    begin_index = True

    def unsupported(self) -> str | None:
        config = self.pipe.config
        if getattr(config, "boundary_ratio", None) is not None:
            return "a two-stage Wan 2.2 pipeline (boundary_ratio) switches transformers mid-denoise"
        if getattr(config, "expand_timesteps", False):
            return "a Wan 2.2 TI2V pipeline (expand_timesteps) takes a timestep per latent token"
        return None

    def encode(self, states: list[StepState]) -> None:
        cfg = states[0].cfg
        embeds, negative = self.pipe.encode_prompt(
            prompt=[s.prompt for s in states],
            negative_prompt=negative_prompts(states) if cfg else None,
            do_classifier_free_guidance=cfg,
            num_videos_per_prompt=1,
            max_sequence_length=self.defaults.get("max_sequence_length", 512),
            device=self.device,
        )
        dtype = self.pipe.transformer.dtype
        for i, s in enumerate(states):
            s.cond["embeds"] = repeat_rows(embeds.to(dtype), i, s.rows)
            if cfg:
                s.uncond["embeds"] = repeat_rows(negative.to(dtype), i, s.rows)

    def latent_dtype(self, state: StepState) -> torch.dtype:
        # The pipeline keeps its latents in float32 whatever the transformer's dtype.
        return torch.float32

    def set_timesteps(self, state: StepState) -> None:
        self.pipe.scheduler.set_timesteps(state.num_inference_steps, device=self.device)

    def noise(self, state: StepState) -> Any:
        if state.num_frames is None:
            raise ValueError("a Wan request needs num_frames (the stage's defaults set it)")
        return self.pipe.prepare_latents(
            state.rows,
            self.latent_channels(),
            state.height,
            state.width,
            state.num_frames,
            self.latent_dtype(state),
            self.device,
            state.generators,
        )

    def call_denoiser(
        self, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], states: list[StepState]
    ) -> torch.Tensor:
        transformer = self.pipe.transformer
        return transformer(
            hidden_states=x.to(transformer.dtype),
            timestep=t,
            encoder_hidden_states=cond["embeds"],
            return_dict=False,
        )[0]

    def to_image(self, latents: torch.Tensor, states: list[StepState]) -> torch.Tensor:
        """Latents of one shape -> videos ``B x C x F x H x W`` in [-1, 1]."""
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        # As the pipeline writes it (the inverse std, then a division): the same rounding.
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return vae.decode(latents / inv_std + mean, return_dict=False)[0]

    def postprocess(self, image: torch.Tensor, states: list[StepState]) -> Any:
        return self.pipe.video_processor.postprocess_video(image, output_type="np")
