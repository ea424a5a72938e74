"""The SDXL step loop (step execution; see ``omni_runtime.stage.runners.diffusion_steps``)."""

from __future__ import annotations

import torch

from omni_runtime.stage.runners.diffusion_steps import StepFamily, StepState, negative_prompts, repeat_rows


class StableDiffusionXLFamily(StepFamily):
    """SDXL: two CLIPs (pooled embeddings), size/crop time ids, zeroed negatives for no negative prompt."""

    pipelines = ("StableDiffusionXLPipeline",)
    begin_index = True

    def unsupported(self) -> str | None:
        if self.pipe.unet.config.time_cond_proj_dim is not None:
            return "the UNet takes a guidance embedding (time_cond_proj_dim), which this loop does not make"
        vae = self.pipe.vae
        if vae.dtype == torch.float16 and vae.config.force_upcast:
            return "its float16 VAE must be upcast to decode, which this loop does not do"
        return None

    def encode(self, states: list[StepState]) -> None:
        # SDXL zeroes the unconditional embedding when there is no negative prompt, but encodes one
        # that is given: one encoder call per kind, as the request-level batches (keyed on it) do.
        cfg = states[0].cfg
        groups = [[s for s in states if bool(s.negative_prompt) == has] for has in (False, True)]
        for group in groups:
            if not group:
                continue
            negatives = negative_prompts(group) if cfg and group[0].negative_prompt else None
            embeds, negative, pooled, negative_pooled = self.pipe.encode_prompt(
                prompt=[s.prompt for s in group],
                device=self.device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=cfg,
                negative_prompt=negatives,
            )
            if self.pipe.text_encoder_2 is None:
                projection_dim = int(pooled.shape[-1])
            else:
                projection_dim = self.pipe.text_encoder_2.config.projection_dim
            for i, s in enumerate(group):
                size = (s.height, s.width)
                time_ids = self.pipe._get_add_time_ids(
                    size, (0, 0), size, dtype=embeds.dtype, text_encoder_projection_dim=projection_dim
                ).to(self.device)
                s.cond.update(embeds=repeat_rows(embeds, i, s.rows), pooled=repeat_rows(pooled, i, s.rows))
                s.cond["time_ids"] = repeat_rows(time_ids, 0, s.rows)
                if cfg:
                    s.uncond.update(
                        embeds=repeat_rows(negative, i, s.rows),
                        pooled=repeat_rows(negative_pooled, i, s.rows),
                        time_ids=s.cond["time_ids"],
                    )

    def call_denoiser(self, x, t, cond, states):
        added = {"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]}
        return self.pipe.unet(x, t, encoder_hidden_states=cond["embeds"], added_cond_kwargs=added, return_dict=False)[0]

    def to_image(self, latents, states):
        vae = self.pipe.vae
        mean = getattr(vae.config, "latents_mean", None)
        std = getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            channels = latents.shape[1]
            mean = torch.tensor(mean).view(1, channels, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, channels, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        if getattr(self.pipe, "watermark", None) is not None:
            image = self.pipe.watermark.apply_watermark(image)
        return image
