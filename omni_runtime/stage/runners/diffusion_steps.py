"""Denoising one step at a time, per pipeline family, for step-level continuous batching.

The diffusion runner's step mode keeps one :class:`StepState` per request (its prompt embeddings,
latents, generators, its own scheduler instance and timesteps) and runs a step for a set of requests of
one compatibility key as one batched denoiser call with a timestep per sample. This module knows how
each supported family does that. It uses the pipelines' own pieces: ``encode_prompt``,
``prepare_latents``, the module's ``retrieve_timesteps`` / ``calculate_shift``, the scheduler's
``set_timesteps`` / ``scale_model_input`` / ``step``, the VAE and the image processor. The loop itself
is written here: what a pipeline's ``__call__`` does per step, for one request, is done per sample.

Supported: ``StableDiffusionPipeline`` (SD 1.x/2.x), ``StableDiffusionXLPipeline``,
``StableDiffusion3Pipeline``, ``FluxPipeline``, ``PixArtSigmaPipeline`` and ``SanaPipeline``;
:func:`step_family` says why anything else is not.

Runs in the stage worker's forward thread, inside ``torch.inference_mode``.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch


@dataclass(eq=False)
class StepState:
    """One request's denoising state between steps."""

    request_id: str
    prompt: str
    negative_prompt: str | None
    seed: int
    #: Images of this request (``num_images_per_prompt``): its rows in every batched tensor.
    rows: int
    guidance: float
    #: Classifier-free guidance (the denoiser also sees the unconditional input).
    cfg: bool
    height: int
    width: int
    num_inference_steps: int
    output_type: str
    generators: list[torch.Generator]
    #: Batched along dim 0 with other requests' (``rows`` rows each); ``uncond`` only with cfg.
    cond: dict[str, torch.Tensor] = field(default_factory=dict)
    uncond: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Equal for every request of one key (positions), passed once per call.
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    scheduler: Any = None
    timesteps: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    extra_step_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Steps taken.
    index: int = 0
    #: img2img: the input image (uint8 HxWx3) and strength (None: the img2img pipeline's default).
    image: Any = None
    strength: float | None = None
    #: The request's LoRA adapter (its params' ``lora``), active whenever it is encoded or steps.
    lora: dict[str, Any] | None = None

    @property
    def steps(self) -> int:
        return 0 if self.timesteps is None else len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.index >= self.steps


class StepFamily:
    """The step loop of one pipeline family. Subclasses fill in encode / denoiser call / decode."""

    #: Pipeline class names this family runs (exact names: a subclass may change the loop).
    pipelines: ClassVar[tuple[str, ...]] = ()
    #: Whether the pipeline scales the denoiser input through the scheduler at each step.
    scales_input: ClassVar[bool] = True
    #: Whether the pipeline passes ``generator``/``eta`` to ``scheduler.step``.
    step_kwargs: ClassVar[bool] = True
    #: Whether the pipeline pins the scheduler's begin index to 0 before its loop.
    begin_index: ClassVar[bool] = False
    #: Whether this loop runs img2img requests (``StepState.image``) given an ``image_pipe``.
    takes_images: ClassVar[bool] = False

    def __init__(self, pipe: Any, call_defaults: dict[str, Any], device: str) -> None:
        self.pipe = pipe
        self.defaults = call_defaults
        self.device = torch.device(device)
        self.module = importlib.import_module(type(pipe).__module__)
        #: The img2img form of ``pipe`` (shared components), set by the runner where it has one.
        self.image_pipe: Any = None

    # ------------------------------------------------------------------ what subclasses provide

    def unsupported(self) -> str | None:
        """Why this loaded pipeline cannot run step by step here, or None."""
        return None

    def uses_cfg(self, guidance: float) -> bool:
        return guidance > 1.0

    def encode(self, states: list[StepState]) -> None:
        """Fill ``cond`` / ``uncond`` of ``states`` (one guidance mode) with one encoder call."""
        raise NotImplementedError

    def call_denoiser(
        self, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], states: list[StepState]
    ) -> torch.Tensor:
        """One denoiser call on a batch (unconditional rows first under cfg), timesteps per sample."""
        raise NotImplementedError

    def to_image(self, latents: torch.Tensor, states: list[StepState]) -> torch.Tensor:
        """Latents of one size -> images in the VAE's output range (NCHW)."""
        vae = self.pipe.vae
        return vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]

    # ------------------------------------------------------------------ shared

    def latent_dtype(self, state: StepState) -> torch.dtype:
        return state.cond["embeds"].dtype

    def set_timesteps(self, state: StepState) -> None:
        """Set the pipeline's scheduler for this request (``retrieve_timesteps``, as its call does)."""
        self.module.retrieve_timesteps(self.pipe.scheduler, state.num_inference_steps, self.device)

    def make_latents(self, state: StepState) -> None:
        state.latents = self.noise(state)

    def noise(self, state: StepState) -> Any:
        """What the pipeline's own ``prepare_latents`` makes for this request (its generators)."""
        return self.pipe.prepare_latents(
            state.rows,
            self.latent_channels(),
            state.height,
            state.width,
            self.latent_dtype(state),
            self.device,
            state.generators,
        )

    def latent_channels(self) -> int:
        return self.denoiser().config.in_channels

    def denoiser(self) -> Any:
        return self.pipe.unet if getattr(self.pipe, "unet", None) is not None else self.pipe.transformer

    def prepare(self, state: StepState) -> None:
        """Timesteps, initial noise and a scheduler of its own, in the pipeline's order: the noise
        scale (``init_noise_sigma``) can depend on the timesteps just set."""
        # 1) The pipeline's scheduler is the template: set for this request, then copied, so
        #    multistep state and step indices stay per request.
        self.set_timesteps(state)
        # 2) The initial noise, from this request's generators (one per image).
        self.make_latents(state)
        state.scheduler = copy.deepcopy(self.pipe.scheduler)
        if self.begin_index and hasattr(state.scheduler, "set_begin_index"):
            state.scheduler.set_begin_index(0)
        state.timesteps = state.scheduler.timesteps
        if self.step_kwargs and hasattr(self.pipe, "prepare_extra_step_kwargs"):
            state.extra_step_kwargs = self.pipe.prepare_extra_step_kwargs(state.generators, self.defaults.get("eta"))

    def denoise(self, states: list[StepState]) -> list[torch.Tensor]:
        """One batched denoiser call for ``states`` (one key), each at its own timestep; returns each
        request's guided prediction."""
        cfg = states[0].cfg
        # 1) Inputs per sample: latents (scaled by each request's scheduler) and timesteps.
        inputs, times = [], []
        for s in states:
            t = s.timesteps[s.index]
            inputs.append(s.scheduler.scale_model_input(s.latents, t) if self.scales_input else s.latents)
            times.append(t.expand(s.rows))
        x, t = torch.cat(inputs), torch.cat(times)
        cond = {name: torch.cat([s.cond[name] for s in states]) for name in states[0].cond}
        # 2) Classifier-free guidance: the unconditional half first, as the pipelines order it.
        if cfg:
            x, t = torch.cat([x, x]), torch.cat([t, t])
            cond = {
                name: torch.cat([torch.cat([s.uncond[name] for s in states]), value]) for name, value in cond.items()
            }
        out = self.call_denoiser(x, t, cond, states)
        # 3) Split back per request and guide each with its own scale.
        preds = []
        half = out.shape[0] // 2
        offset = 0
        for s in states:
            rows = slice(offset, offset + s.rows)
            if cfg:
                uncond = out[rows]
                text = out[half + offset : half + offset + s.rows]
                pred = uncond + s.guidance * (text - uncond)
            else:
                pred = out[rows]
            preds.append(self.finish_prediction(pred))
            offset += s.rows
        return preds

    def finish_prediction(self, pred: torch.Tensor) -> torch.Tensor:
        return pred

    def advance(self, state: StepState, pred: torch.Tensor) -> None:
        """The request's scheduler takes the step: x_t -> x_t-1."""
        t = state.timesteps[state.index]
        state.latents = state.scheduler.step(pred, t, state.latents, **state.extra_step_kwargs, return_dict=False)[0]
        state.index += 1

    def decode(self, states: list[StepState]) -> list[np.ndarray]:
        """Images of finished requests of one size, batched: floats in [0, 1], NHWC, per request."""
        latents = torch.cat([s.latents for s in states])
        image = self.to_image(latents, states)
        floats = self.postprocess(image, states)
        out, offset = [], 0
        for s in states:
            out.append(floats[offset : offset + s.rows])
            offset += s.rows
        return out

    def postprocess(self, image: torch.Tensor, states: list[StepState]) -> np.ndarray:
        return self.pipe.image_processor.postprocess(image, output_type="np")


def _negatives(states: list[StepState]) -> list[str]:
    """Negative prompts as the runner's request-level call passes them: "" for none."""
    return [s.negative_prompt or "" for s in states]


def _rows(tensor: torch.Tensor, i: int, rows: int) -> torch.Tensor:
    """Prompt ``i``'s encoding repeated for each of its images, as ``num_images_per_prompt`` does."""
    part = tensor[i : i + 1]
    return part.repeat(rows, *([1] * (part.dim() - 1)))


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
            [s.prompt for s in states], self.device, 1, cfg, negative_prompt=_negatives(states) if cfg else None
        )
        for i, s in enumerate(states):
            s.cond["embeds"] = _rows(embeds, i, s.rows)
            if cfg:
                s.uncond["embeds"] = _rows(negative, i, s.rows)

    def call_denoiser(self, x, t, cond, states):
        return self.pipe.unet(x, t, encoder_hidden_states=cond["embeds"], return_dict=False)[0]

    takes_images = True

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
            negatives = _negatives(group) if cfg and group[0].negative_prompt else None
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
                s.cond.update(embeds=_rows(embeds, i, s.rows), pooled=_rows(pooled, i, s.rows))
                s.cond["time_ids"] = _rows(time_ids, 0, s.rows)
                if cfg:
                    s.uncond.update(
                        embeds=_rows(negative, i, s.rows),
                        pooled=_rows(negative_pooled, i, s.rows),
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
            negative_prompt=_negatives(states) if cfg else None,
            max_sequence_length=self.defaults.get("max_sequence_length", 256),
        )
        for i, s in enumerate(states):
            s.cond.update(embeds=_rows(embeds, i, s.rows), pooled=_rows(pooled, i, s.rows))
            if cfg:
                s.uncond.update(embeds=_rows(negative, i, s.rows), pooled=_rows(negative_pooled, i, s.rows))

    def prepare(self, state: StepState) -> None:
        # SD3 makes the noise first: a dynamic shift of the timesteps depends on its size.
        self.make_latents(state)
        scheduler = self.pipe.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
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
            s.cond.update(embeds=_rows(embeds, i, s.rows), pooled=_rows(pooled, i, s.rows))
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
            negative_prompt=_negatives(states) if cfg else "",
            num_images_per_prompt=1,
            device=self.device,
            **self.encode_kwargs(),
        )
        for i, s in enumerate(states):
            s.cond.update(embeds=_rows(embeds, i, s.rows), mask=_rows(mask, i, s.rows))
            if cfg:
                s.uncond.update(embeds=_rows(negative, i, s.rows), mask=_rows(negative_mask, i, s.rows))

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


FAMILIES: tuple[type[StepFamily], ...] = (
    StableDiffusionFamily,
    StableDiffusionXLFamily,
    StableDiffusion3Family,
    FluxFamily,
    PixArtFamily,
    SanaFamily,
)


def step_family(pipe: Any, device: str) -> tuple[StepFamily | None, str | None]:
    """The step loop for a loaded pipeline, or (None, why not)."""
    name = type(pipe).__name__
    family_cls = next((f for f in FAMILIES if name in f.pipelines), None)
    if family_cls is None:
        names = ", ".join(n for f in FAMILIES for n in f.pipelines)
        return None, f"{name} has no step loop here (step execution supports {names})"
    defaults = {
        n: p.default
        for n, p in inspect.signature(type(pipe).__call__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    family = family_cls(pipe, defaults, device)
    reason = family.unsupported()
    return (None, f"{name}: {reason}") if reason else (family, None)
