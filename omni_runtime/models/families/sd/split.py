"""Stable Diffusion as three stages: text encoder, denoiser, VAE decoder.

Each runner loads only its own part of a diffusers Stable Diffusion directory and runs in its
own stage worker, so each batches on its own terms: the text encoder fuses any prompts, the
denoiser fuses requests of equal size, steps and guidance, the decoder fuses equal latent shapes.
Between them travel tensors, by name, through the default input mapping of the orchestrator:

* encoder -> ``prompt_embeds`` ``[1, seq, dim]`` and, for classifier-free guidance,
  ``negative_prompt_embeds`` (the negative prompt's, or ``""``'s), computed by the pipeline's own
  ``encode_prompt``;
* denoiser -> ``latents`` ``[k, c, h, w]`` (k = ``num_images_per_prompt``) and ``seed``;
* decoder -> uint8 images (or float ``images`` for ``output_type: np``), decoded like the pipeline.

Every runner takes :class:`~omni_runtime.params.DiffusionSamplingParams`, so one params object
given to ``generate`` reaches all three stages, and each reads its own fields: the encoder
``negative_prompt`` (and ``guidance_scale``, only to skip the negative embeddings when it is <= 1),
the denoiser the seed, size, steps, guidance and ``num_images_per_prompt``, the decoder
``output_type``. With the same seed and params the images equal the one-stage ``diffusion``
runner's within float tolerance: the same generators, the same noise, the same calls.

torch and diffusers are imported inside the methods: the caller's process imports this module
for the params class alone and need not load torch for that.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import InvalidRequestError, RequestAbortedError, StageAsleepError
from omni_runtime.media import image_items
from omni_runtime.messages import StageConstraints
from omni_runtime.models.builtin import resolve_model
from omni_runtime.params import FALLBACK_MAX_PIXELS, DiffusionSamplingParams, in_force
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner
from omni_runtime.stage.runners.sizes import NATIVE_AREA_FACTOR
from omni_runtime.stage.runners.step_limits import step_constraints

if TYPE_CHECKING:
    import torch


def _as_tensor(value: Any, device: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An upstream array (numpy, possibly a read-only view of a frame, or torch) as a tensor."""
    import numpy as np
    import torch

    tensor = value if torch.is_tensor(value) else torch.from_numpy(np.array(value))
    return tensor.to(device=device, dtype=dtype)


#: Diffusion requests as the three stages get them.
Request = RunnerRequest[DiffusionSamplingParams]


def _needs_guidance(params: DiffusionSamplingParams) -> bool:
    """Whether classifier-free guidance is on, as the pipeline decides it (unset: its default 7.5)."""
    scale = params.guidance_scale
    return scale is None or float(scale) > 1.0


def _aborted(batch: list[Request]) -> list[RunnerOutput]:
    return [RunnerOutput(error=RequestAbortedError(f"request {r.request_id} was aborted")) for r in batch]


def vae_scale_factor(model_dir: str) -> int:
    """The VAE's downsampling factor, from its config alone (no weights), as the pipeline computes it."""
    from diffusers import AutoencoderKL

    config = AutoencoderKL.load_config(model_dir, subfolder="vae", local_files_only=True)
    return 2 ** (len(config["block_out_channels"]) - 1)


class _SplitRunner(StageRunner):
    """What the three share: the model directory, dtype, and sleep/wake by dropping the modules."""

    params_cls = DiffusionSamplingParams
    needs_model = True
    #: Attributes holding loaded modules; ``sleep`` drops them and ``wake_up`` reloads.
    _module_attrs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self._model_dir = ""

    @classmethod
    def preload(cls, stage: StageConfig) -> None:
        from omni_runtime.stage.runners.torch_common import import_model_libraries  # lazy: imports torch

        import_model_libraries(diffusers=True)

    def load(self) -> None:
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        # A stage process has no terminal to draw on: loading bars are only noise in server logs.
        diffusers_logging.disable_progress_bar()
        transformers_logging.disable_progress_bar()
        assert self.stage.model is not None  # needs_model: checked when the config is resolved
        self._model_dir = resolve_model(self.stage.model)
        self._load_modules()

    def _load_modules(self) -> None:
        raise NotImplementedError

    @property
    def _dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.stage.engine_args.dtype)

    def _check_awake(self) -> None:
        if any(getattr(self, name) is None for name in self._module_attrs):
            raise StageAsleepError(f"stage {self.stage.stage_id} is asleep; call wake_up first")

    def sleep(self) -> dict[str, Any]:
        from omni_runtime.stage.runners.torch_common import release_memory  # lazy: imports torch

        for name in self._module_attrs:
            setattr(self, name, None)
        return release_memory()

    def wake_up(self) -> dict[str, Any]:
        if all(getattr(self, name) is not None for name in self._module_attrs):
            return {"reloaded": False}
        self._load_modules()
        return {"reloaded": True}


class SDTextEncoderRunner(_SplitRunner):
    """Stage 1 of 3: tokenizer + text encoder -> ``prompt_embeds`` (+ ``negative_prompt_embeds``).

    Lives in its stage worker; ``execute`` runs in the worker's executor thread. Any prompts fuse
    (batch key ``()``): negative prompts are per request, and ``""`` stands for none, as in the
    pipeline.
    """

    _module_attrs = ("_pipe",)

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self._pipe: Any = None

    def _load_modules(self) -> None:
        from diffusers import StableDiffusionPipeline
        from transformers import CLIPTextModel, CLIPTokenizer

        tokenizer = CLIPTokenizer.from_pretrained(self._model_dir, subfolder="tokenizer", local_files_only=True)
        text_encoder = CLIPTextModel.from_pretrained(
            self._model_dir, subfolder="text_encoder", dtype=self._dtype, local_files_only=True
        ).to(self.device)
        # A pipeline holding only these two, so the embeddings come from the pipeline's own
        # encode_prompt (truncation, attention mask, "" for no negative prompt) and cannot drift.
        self._pipe = StableDiffusionPipeline(
            vae=None,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=None,
            scheduler=None,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    def execute(self, batch: list[Request], ctx: ExecuteContext) -> list[RunnerOutput]:
        import torch

        self._check_awake()
        if all(ctx.is_aborted(r.request_id) for r in batch):
            return _aborted(batch)
        # 1) Negative embeddings only for requests that will use guidance; one encoder call serves all.
        guided = [_needs_guidance(r.params) for r in batch]
        prompts = [r.prompt for r in batch]
        negatives = [r.params.negative_prompt or "" for r in batch]

        # 2) The forward: prompts and negative prompts, each as one batch, like the pipeline.
        start = time.perf_counter()
        with torch.inference_mode():
            embeds, negative_embeds = self._pipe.encode_prompt(
                prompts, torch.device(self.device), 1, any(guided), negative_prompt=negatives if any(guided) else None
            )
        elapsed_ms = (time.perf_counter() - start) * 1e3

        # 3) Split back, one [1, seq, dim] per request.
        outputs = []
        for i, wants_negative in enumerate(guided):
            tensors = {"prompt_embeds": embeds[i : i + 1].cpu()}
            if wants_negative:
                tensors["negative_prompt_embeds"] = negative_embeds[i : i + 1].cpu()
            outputs.append(
                RunnerOutput(tensors=tensors, metrics={"batch_size": len(batch), "execution_ms": elapsed_ms})
            )
        return outputs


class SDDenoiseRunner(_SplitRunner):
    """Stage 2 of 3: UNet + scheduler, from embeddings to ``latents``.

    Lives in its stage worker; ``execute`` runs in the worker's executor thread. It runs the
    pipeline itself without text encoder and VAE (``output_type="latent"``), with one generator
    per image seeded like the ``diffusion`` runner's, so its noise is the one-stage pipeline's.
    """

    _module_attrs = ("_pipe",)

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self._pipe: Any = None
        self._scale = 8
        self._native_size: tuple[int | None, int | None] = (None, None)
        self._call_defaults: dict[str, Any] = {}
        self._step_limits = StageConstraints()

    def _load_modules(self) -> None:
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(
            self._model_dir,
            text_encoder=None,
            tokenizer=None,
            vae=None,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
            dtype=self._dtype,
            local_files_only=True,
        )
        # Without a VAE the pipeline assumes a scale factor of 8; the latent shape needs the real one.
        self._scale = vae_scale_factor(self._model_dir)
        pipe.vae_scale_factor = self._scale
        pipe = pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        sample = pipe.unet.config.sample_size
        size = tuple(sample) if isinstance(sample, list | tuple) else (sample, sample)
        self._native_size = (int(size[0]) * self._scale, int(size[1]) * self._scale)
        signature = inspect.signature(type(pipe).__call__)
        self._call_defaults = {
            name: p.default for name, p in signature.parameters.items() if p.default is not inspect.Parameter.empty
        }
        # The step counts the scheduler runs (DDIM / PNDM: 999 of the 1,000 requests may ask for).
        self._step_limits = step_constraints(pipe.scheduler)
        self._pipe = pipe

    def constraints(self) -> StageConstraints:
        # The SD pipelines reject sizes that are not multiples of 8, whatever the VAE; the default
        # limit is 4 x the native area, as for the one-stage runner.
        height, width = self._native_size
        native: tuple[int, int] | None = None
        default = FALLBACK_MAX_PIXELS
        if height and width:
            native, default = (height, width), NATIVE_AREA_FACTOR * height * width
        return msgspec.structs.replace(
            self._step_limits,
            size_multiple=math.lcm(8, self._scale),
            max_pixels=self.stage.engine_args.max_pixels or default,
            native_size=native,
        )

    def batch_key(self, request: Request) -> Hashable:
        """Shape- and guidance-sensitive params, defaults resolved, and the embeddings' shape."""
        p, inputs = request.params, request.inputs
        embeds = inputs.get("prompt_embeds")
        if embeds is None:
            raise InvalidRequestError(
                f"stage {self.stage.stage_id} needs `prompt_embeds` from an upstream text-encoder stage"
            )
        guidance = self._guidance(p)
        negative = inputs.get("negative_prompt_embeds")
        if guidance > 1.0 and negative is None:
            raise InvalidRequestError(
                f"guidance_scale {guidance} needs `negative_prompt_embeds`, and the text-encoder stage made "
                "none: give the encoder the same guidance_scale (or none)"
            )
        return (
            p.height or self._native_size[0],
            p.width or self._native_size[1],
            p.num_inference_steps or self._call_defaults.get("num_inference_steps"),
            guidance,
            p.per_prompt,
            tuple(embeds.shape[1:]),
        )

    def _guidance(self, p: DiffusionSamplingParams) -> float:
        """The request's guidance scale, else the pipeline's."""
        scale = p.guidance_scale
        return float((self._call_defaults.get("guidance_scale") if scale is None else scale) or 0.0)

    def execute(self, batch: list[Request], ctx: ExecuteContext) -> list[RunnerOutput]:
        import torch

        # lazy: imports torch
        from omni_runtime.stage.runners.torch_common import WaveAborted, image_generators, request_seeds

        self._check_awake()
        ids = [r.request_id for r in batch]
        if all(ctx.is_aborted(rid) for rid in ids):
            return _aborted(batch)
        first = batch[0].params  # equal batch keys: the shape params of one stand for all
        per_prompt = first.per_prompt
        guided = self._guidance(first) > 1.0

        # 1) Seeds: the request's own, or a fresh one reported back so the image can be redone.
        seeds = request_seeds(batch)

        # 2) One generator per image, seeded exactly as the one-stage diffusion runner seeds it.
        generators = image_generators(seeds, per_prompt, self.device)

        # 3) The batch's embeddings, request after request, as the pipeline stacks its prompts.
        dtype = self._pipe.unet.dtype
        kwargs: dict[str, Any] = {
            "prompt_embeds": torch.cat([_as_tensor(r.inputs["prompt_embeds"], self.device, dtype) for r in batch]),
            "generator": generators,
            "num_images_per_prompt": per_prompt,
            "height": first.height,
            "width": first.width,
            "num_inference_steps": first.num_inference_steps,
            "guidance_scale": first.guidance_scale,
            "output_type": "latent",
        }
        if guided:
            kwargs["negative_prompt_embeds"] = torch.cat(
                [_as_tensor(r.inputs["negative_prompt_embeds"], self.device, dtype) for r in batch]
            )
        kwargs = {k: v for k, v in kwargs.items() if v is not None}

        # 4) Abort while running: leave the loop only when no one is waiting for this wave.
        def on_step_end(pipe: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
            if all(ctx.is_aborted(rid) for rid in ids):
                raise WaveAborted
            return callback_kwargs

        kwargs["callback_on_step_end"] = on_step_end

        # 5) The forward, timed alone.
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                latents = self._pipe(**kwargs).images
        except WaveAborted:
            return _aborted(batch)
        elapsed_ms = (time.perf_counter() - start) * 1e3

        # 6) Split back per request, k consecutive latents each; the seed goes along so the final
        #    stage can report it.
        outputs = []
        for i, seed in enumerate(seeds):
            part = latents[i * per_prompt : (i + 1) * per_prompt].cpu()
            outputs.append(
                RunnerOutput(
                    tensors={"latents": part, "seed": torch.tensor([seed], dtype=torch.int64)},
                    metrics={"seed": seed, "batch_size": len(batch), "execution_ms": elapsed_ms},
                )
            )
        return outputs


class SDVaeDecodeRunner(_SplitRunner):
    """Stage 3 of 3: VAE decoder, from ``latents`` to images.

    Lives in its stage worker; ``execute`` runs in the worker's executor thread. Latents of equal
    shape fuse, whatever their prompts and seeds.
    """

    _module_attrs = ("_vae",)

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self._vae: Any = None
        self._image_processor: Any = None

    def _load_modules(self) -> None:
        from diffusers import AutoencoderKL
        from diffusers.image_processor import VaeImageProcessor

        vae = AutoencoderKL.from_pretrained(self._model_dir, subfolder="vae", dtype=self._dtype, local_files_only=True)
        self._vae = vae.to(self.device)
        self._image_processor = VaeImageProcessor(vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1))

    def batch_key(self, request: Request) -> Hashable:
        latents = request.inputs.get("latents")
        if latents is None:
            raise InvalidRequestError(f"stage {self.stage.stage_id} needs `latents` from an upstream denoiser stage")
        return (in_force(request.params.output_type), tuple(latents.shape[1:]))

    def execute(self, batch: list[Request], ctx: ExecuteContext) -> list[RunnerOutput]:
        import numpy as np
        import torch

        self._check_awake()
        if all(ctx.is_aborted(r.request_id) for r in batch):
            return _aborted(batch)
        output_type = in_force(batch[0].params.output_type)
        latents = [_as_tensor(r.inputs["latents"], self.device, self._vae.dtype) for r in batch]

        # 1) Decode all images of the wave at once, scaled back and post-processed as the pipeline
        #    does; "latent" asks for no decoding at all.
        start = time.perf_counter()
        if output_type == "latent":
            decoded = None
        else:
            with torch.inference_mode():
                images = self._vae.decode(torch.cat(latents) / self._vae.config.scaling_factor, return_dict=False)[0]
                decoded = self._image_processor.postprocess(
                    images, output_type="np", do_denormalize=[True] * images.shape[0]
                )
        elapsed_ms = (time.perf_counter() - start) * 1e3

        # 2) Split back per request; uint8 images are made as the diffusion runner makes them.
        outputs, offset = [], 0
        for r, lat in zip(batch, latents, strict=True):
            metrics: dict[str, float | int] = {"batch_size": len(batch), "execution_ms": elapsed_ms}
            seed = r.inputs.get("seed")
            if seed is not None:
                metrics["seed"] = int(np.asarray(seed).reshape(-1)[0])
            out = RunnerOutput(metrics=metrics)
            if decoded is None:
                # float() first: numpy has no bfloat16.
                out.tensors["latents"] = lat.float().cpu().numpy()
            else:
                floats = np.asarray(decoded[offset : offset + lat.shape[0]], dtype=np.float32)
                if output_type == "np":
                    out.tensors["images"] = floats
                else:
                    out.media.extend(image_items(floats, seed=metrics.get("seed")))
            offset += lat.shape[0]
            outputs.append(out)
        return outputs
