"""The SD3 step loop (step execution; see ``omni_runtime.stage.runners.diffusion_steps``)."""

from __future__ import annotations

import copy

from omni_runtime.stage.runners.diffusion_steps import StepFamily, StepState, negative_prompts, repeat_rows


class StableDiffusion3Family(StepFamily):
    """SD3: an MMDiT on flow matching; two CLIPs and T5; timesteps shifted by image size if configured."""

    pipelines = ("StableDiffusion3Pipeline",)
    scales_input = False
    step_kwargs = False

    def encode(self, states: list[StepState]) -> None:
        cfg = states[0].cfg
        embeds, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt=[s.prompt for s in states],
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=cfg,
            negative_prompt=negative_prompts(states) if cfg else None,
            max_sequence_length=self.defaults.get("max_sequence_length", 256),
        )
        for i, s in enumerate(states):
            s.cond.update(embeds=repeat_rows(embeds, i, s.rows), pooled=repeat_rows(pooled, i, s.rows))
            if cfg:
                s.uncond.update(embeds=repeat_rows(negative, i, s.rows), pooled=repeat_rows(negative_pooled, i, s.rows))

    def prepare(self, state: StepState) -> None:
        # SD3 makes the noise first: a dynamic shift of the timesteps depends on its size.
        self.make_latents(state)
        scheduler = self.pipe.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            assert state.latents is not None  # made just above
            _, _, h, w = state.latents.shape
            patch = self.pipe.transformer.config.patch_size
            kwargs["mu"] = self.module.calculate_shift(
                (h // patch) * (w // patch),
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        self.module.retrieve_timesteps(scheduler, state.num_inference_steps, self.device, **kwargs)
        state.scheduler = copy.deepcopy(scheduler)
        state.timesteps = state.scheduler.timesteps

    def call_denoiser(self, x, t, cond, states):
        return self.pipe.transformer(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=cond["embeds"],
            pooled_projections=cond["pooled"],
            return_dict=False,
        )[0]

    def to_image(self, latents, states):
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0]
