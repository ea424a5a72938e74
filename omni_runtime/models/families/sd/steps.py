"""The SD 1.x / 2.x step loop (step execution; see ``omni_runtime.stage.runners.diffusion_steps``)."""

from __future__ import annotations

import copy
import inspect

from omni_runtime.stage.runners.diffusion_steps import StepFamily, StepState, negative_prompts, repeat_rows


class StableDiffusionFamily(StepFamily):
    """SD 1.x / 2.x: CLIP embeddings, a UNet, scheduler-scaled inputs, the safety checker if any."""

    pipelines = ("StableDiffusionPipeline",)

    def unsupported(self) -> str | None:
        if self.pipe.unet.config.time_cond_proj_dim is not None:
            return "the UNet takes a guidance embedding (time_cond_proj_dim), which this loop does not make"
        return None

    def encode(self, states: list[StepState]) -> None:
        cfg = states[0].cfg
        embeds, negative = self.pipe.encode_prompt(
            [s.prompt for s in states], self.device, 1, cfg, negative_prompt=negative_prompts(states) if cfg else None
        )
        for i, s in enumerate(states):
            s.cond["embeds"] = repeat_rows(embeds, i, s.rows)
            if cfg:
                s.uncond["embeds"] = repeat_rows(negative, i, s.rows)

    def call_denoiser(self, x, t, cond, states):
        return self.pipe.unet(x, t, encoder_hidden_states=cond["embeds"], return_dict=False)[0]

    takes_images = True
    #: The input image goes into the latents (``prepare``), never into the prompt's encoding.
    encode_reads_image = False

    def prepare(self, state: StepState) -> None:
        if state.image is None:
            super().prepare(state)
            return
        # img2img, as StableDiffusionImg2ImgPipeline's call does it for this request's rows: the
        # schedule's tail from the strength's timestep, and the encoded image noised to its first
        # timestep, with this request's generators (one per row: encoding samples, then noise).
        from PIL import Image

        img2img = self.image_pipe
        if img2img is None:
            raise ValueError(f"{type(self.pipe).__name__} has no img2img form to run an image request")
        strength = state.strength
        if strength is None:
            strength = inspect.signature(type(img2img).__call__).parameters["strength"].default
        image = img2img.image_processor.preprocess([Image.fromarray(state.image)] * state.rows)
        self.module.retrieve_timesteps(img2img.scheduler, state.num_inference_steps, self.device)
        timesteps, _ = img2img.get_timesteps(state.num_inference_steps, strength, self.device)
        if len(timesteps) == 0:
            raise ValueError(f"strength {strength} x {state.num_inference_steps} steps leaves no denoising step")
        state.latents = img2img.prepare_latents(
            image, timesteps[:1].repeat(state.rows), state.rows, 1, self.latent_dtype(state), self.device,
            state.generators,
        )  # fmt: skip
        state.scheduler = copy.deepcopy(img2img.scheduler)
        state.timesteps = timesteps
        if hasattr(self.pipe, "prepare_extra_step_kwargs"):
            state.extra_step_kwargs = self.pipe.prepare_extra_step_kwargs(state.generators, self.defaults.get("eta"))

    def postprocess(self, image, states):
        nsfw = None
        if getattr(self.pipe, "safety_checker", None) is not None:
            image, nsfw = self.pipe.run_safety_checker(image, self.device, states[0].cond["embeds"].dtype)
        denormalize = None if nsfw is None else [not flagged for flagged in nsfw]
        return self.pipe.image_processor.postprocess(image, output_type="np", do_denormalize=denormalize)
