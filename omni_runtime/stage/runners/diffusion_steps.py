"""Denoising one step at a time, per pipeline family, for step-level continuous batching.

The diffusion runner's step mode keeps one :class:`StepState` per request (its prompt embeddings,
latents, generators, its own scheduler instance and timesteps) and runs a step for a set of requests of
one compatibility key as one batched denoiser call with a timestep per sample. This module holds
the shared loop; each family's ``steps.py`` (``omni_runtime/models/families/<family>/``, named by
its spec's ``steps``) says how that family encodes, calls its denoiser and decodes. They use the
pipelines' own pieces: ``encode_prompt``,
``prepare_latents``, the module's ``retrieve_timesteps`` / ``calculate_shift``, the scheduler's
``set_timesteps`` / ``scale_model_input`` / ``step``, the VAE and the image processor. The loop itself
is written here: what a pipeline's ``__call__`` does per step, for one request, is done per sample.

Supported: the pipelines of every registered family with a ``steps`` loop (the builtins: SD 1.x/2.x,
SDXL, SD3, Flux, PixArt-Sigma, Sana, Wan text-to-video); :func:`step_family` says why anything else is not.

Runs in the stage worker's forward thread, inside ``torch.inference_mode``.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from omni_runtime.models.families import families, for_pipeline
from omni_runtime.stage.runners.lora import LoraSpec
from omni_runtime.stage.runners.row_cache import RowState, RowStepCache


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
    #: The request's LoRA adapter (its params' ``lora``, pinned), active whenever it is encoded or steps.
    lora: LoraSpec = None
    #: A video request's frame count (shapes its latents) and frame rate (its items'); None for images.
    num_frames: int | None = None
    fps: int | None = None
    #: The request's own step-cache state (first block or MagCache; None: it runs uncached).
    cache: RowState | None = None
    #: The prompt cache's key of this request's encode (None: not cached), whether its encoder
    #: outputs came from the cache (None: the cache is off or does not take it), and the entries
    #: storing its own outputs evicted (``prompt_cache.py``).
    prompt_key: Hashable | None = None
    prompt_cache_hit: bool | None = None
    prompt_cache_evictions: int = 0

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
    #: Whether :meth:`encode` may read an img2img request's input image: then the image is part of
    #: the prompt cache's key. A family's own loop is assumed to; SD's (the builtin img2img loop) does not.
    encode_reads_image: ClassVar[bool] = True

    def __init__(self, pipe: Any, call_defaults: dict[str, Any], device: str) -> None:
        self.pipe = pipe
        self.defaults = call_defaults
        self.device = torch.device(device)
        self.module = importlib.import_module(type(pipe).__module__)
        #: The img2img form of ``pipe`` (shared components), set by the runner where it has one.
        self.image_pipe: Any = None
        #: Per-request first-block caching on the denoiser, set by the runner where it serves it.
        self.row_cache: RowStepCache | None = None

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
            # Set by prepare, before a request's first step.
            assert s.timesteps is not None and s.latents is not None
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
        if self.row_cache is not None and any(s.cache is not None for s in states):
            with self.row_cache.call(self._cache_groups(states, cfg), x.shape[0]):
                out = self.call_denoiser(x, t, cond, states)
        else:
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

    def _cache_groups(self, states: list[StepState], cfg: bool) -> list[tuple[RowState | None, torch.Tensor]]:
        """Each request's rows of the denoiser batch (under cfg, its unconditional and conditional rows)."""
        total = sum(s.rows for s in states)
        groups: list[tuple[RowState | None, torch.Tensor]] = []
        offset = 0
        for s in states:
            rows = list(range(offset, offset + s.rows))
            if cfg:
                rows += [total + r for r in rows]
            groups.append((s.cache, torch.tensor(rows, dtype=torch.long, device=self.device)))
            offset += s.rows
        return groups

    def finish_prediction(self, pred: torch.Tensor) -> torch.Tensor:
        return pred

    def advance(self, state: StepState, pred: torch.Tensor) -> None:
        """The request's scheduler takes the step: x_t -> x_t-1."""
        assert state.timesteps is not None  # set by prepare
        t = state.timesteps[state.index]
        state.latents = state.scheduler.step(pred, t, state.latents, **state.extra_step_kwargs, return_dict=False)[0]
        state.index += 1

    def decode(self, states: list[StepState]) -> list[np.ndarray]:
        """Images (videos: ``N x F x H x W x 3``) of finished requests of one shape, batched: floats in
        [0, 1], channels last, per request."""
        parts = []
        for s in states:
            assert s.latents is not None  # set by prepare
            parts.append(s.latents)
        latents = torch.cat(parts)
        image = self.to_image(latents, states)
        floats = self.postprocess(image, states)
        out, offset = [], 0
        for s in states:
            out.append(floats[offset : offset + s.rows])
            offset += s.rows
        return out

    def postprocess(self, image: torch.Tensor, states: list[StepState]) -> np.ndarray:
        return self.pipe.image_processor.postprocess(image, output_type="np")


def negative_prompts(states: list[StepState]) -> list[str]:
    """Negative prompts as the runner's request-level call passes them: "" for none."""
    return [s.negative_prompt or "" for s in states]


def repeat_rows(tensor: torch.Tensor, i: int, rows: int) -> torch.Tensor:
    """Prompt ``i``'s encoding repeated for each of its images, as ``num_images_per_prompt`` does."""
    part = tensor[i : i + 1]
    return part.repeat(rows, *([1] * (part.dim() - 1)))


def step_family(pipe: Any, device: str) -> tuple[StepFamily | None, str | None]:
    """The step loop for a loaded pipeline (its family's, from the family registry), or (None, why not)."""
    name = type(pipe).__name__
    spec = for_pipeline(name)
    family_cls = spec.step_class() if spec is not None else None
    if family_cls is None:
        names = ", ".join(n for f in families() if f.steps for n in f.pipelines)
        return None, f"{name} has no step loop here (step execution supports {names})"
    defaults = {
        n: p.default
        for n, p in inspect.signature(type(pipe).__call__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    family = family_cls(pipe, defaults, device)
    reason = family.unsupported()
    return (None, f"{name}: {reason}") if reason else (family, None)
