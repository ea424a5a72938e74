"""The PixArt-Sigma step loop (step execution; see ``omni_runtime.stage.runners.diffusion_steps``)."""

from __future__ import annotations

from typing import Any

from omni_runtime.stage.runners.diffusion_steps import StepFamily, StepState, negative_prompts, repeat_rows


class PixArtFamily(StepFamily):
    """PixArt-Sigma: T5 embeddings with attention masks, adaLN-single DiT, learned sigma halves."""

    pipelines = ("PixArtSigmaPipeline",)

    def encode_kwargs(self) -> dict[str, Any]:
        return {"clean_caption": False, "max_sequence_length": self.defaults.get("max_sequence_length", 300)}

    def encode(self, states: list[StepState]) -> None:
        cfg = states[0].cfg
        embeds, mask, negative, negative_mask = self.pipe.encode_prompt(
            [s.prompt for s in states],
            cfg,
            negative_prompt=negative_prompts(states) if cfg else "",
            num_images_per_prompt=1,
            device=self.device,
            **self.encode_kwargs(),
        )
        for i, s in enumerate(states):
            s.cond.update(embeds=repeat_rows(embeds, i, s.rows), mask=repeat_rows(mask, i, s.rows))
            if cfg:
                s.uncond.update(embeds=repeat_rows(negative, i, s.rows), mask=repeat_rows(negative_mask, i, s.rows))

    def call_denoiser(self, x, t, cond, states):
        return self.pipe.transformer(
            x,
            encoder_hidden_states=cond["embeds"],
            encoder_attention_mask=cond["mask"],
            timestep=t,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
            return_dict=False,
        )[0]

    def finish_prediction(self, pred):
        # A model that also predicts its variance returns twice the latent channels: keep the noise.
        if self.pipe.transformer.config.out_channels // 2 == self.latent_channels():
            return pred.chunk(2, dim=1)[0]
        return pred
