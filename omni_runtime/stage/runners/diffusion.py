"""The diffusion runner: text-to-image (and text-to-video or text-to-audio, for a video or audio
family) with any diffusers pipeline, one forward per fused batch.

It runs in the stage worker; ``execute()`` is called in the worker's executor thread. A batch
holds requests with equal :meth:`DiffusionRunner.batch_key`, so one pipeline call serves all of
them, each request with its own generators: its result does not depend on its batch-mates
(equal within float tolerance; batched kernels are not bitwise equal to batch-1 ones).

For the families of :mod:`omni_runtime.stage.runners.diffusion_steps` it can also run requests one
denoising step at a time (``step_admit`` / ``step_run`` / ``step_drop``, driven by the worker with
``engine_args.step_execution``, carried out by :mod:`~omni_runtime.stage.runners.diffusion_stepper`):
each request keeps its own state between steps, so requests join and leave a running batch at step
boundaries, with the same per-request generators and seeds. Loading the pipeline and turning what
it returns into outputs are :mod:`~omni_runtime.stage.runners.diffusion_pipeline`'s.

A request's params arrive resolved (:class:`~omni_runtime.params.DiffusionSamplingParams`, their
fallbacks filled in); what they leave unset that depends on the loaded model (its native size, its
pipeline's step count and guidance, its family's frame rate) is read here (``size_of``...).

A request's LoRA adapter (``lora``) is part of both keys, so a wave or a step batch runs with one
adapter at one scale; :mod:`omni_runtime.stage.runners.lora` loads, caches and activates them.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Hashable
from typing import Any

import msgspec
import torch

from omni_runtime.acceleration import cache_key
from omni_runtime.config import StageConfig, TorchCompile
from omni_runtime.exceptions import RequestAbortedError, RequestError, StageAsleepError
from omni_runtime.messages import StageConstraints
from omni_runtime.models.builtin import resolve_model
from omni_runtime.models.families import DEFAULT_FIXED_KWARGS, CallbackStyle, for_pipeline, import_family_modules
from omni_runtime.params import FALLBACK_MAX_PIXELS, DiffusionSamplingParams, in_force
from omni_runtime.stage.runners.acceleration import StepCacheControl, weight_bytes
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner, StepResult
from omni_runtime.stage.runners.diffusion_pipeline import (
    DEFAULT_FPS,
    StepWatch,
    accepts_batched_inputs,
    callback_style,
    decoded_output,
    index_class_name,
    load_pipeline,
    total_steps,
)
from omni_runtime.stage.runners.diffusion_pipeline import apply_engine_options as apply_engine_options
from omni_runtime.stage.runners.diffusion_stepper import DiffusionStepper
from omni_runtime.stage.runners.diffusion_steps import StepFamily, StepState, step_family
from omni_runtime.stage.runners.image_inputs import TEXT, PipelineForm, PipelineForms, image_call_kwargs, size_kwargs
from omni_runtime.stage.runners.lora import LoraAdapters
from omni_runtime.stage.runners.prompt_cache import PromptEmbeddingCache
from omni_runtime.stage.runners.sizes import NATIVE_AREA_FACTOR, derive_size_limits
from omni_runtime.stage.runners.step_limits import step_constraints
from omni_runtime.stage.runners.torch_common import (
    WaveAborted,
    image_generators,
    import_model_libraries,
    release_memory,
    request_seeds,
)

logger = logging.getLogger(__name__)

#: Diffusion requests as the runner gets them.
Request = RunnerRequest[DiffusionSamplingParams]


class DiffusionRunner(StageRunner):
    """Text-to-image runner over a diffusers pipeline loaded from a local directory.

    Lives in the stage worker process; ``execute`` runs in its executor thread.
    """

    params_cls = DiffusionSamplingParams
    needs_model = True

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.pipe: Any = None
        #: Most requests one ``execute`` may fuse; ``None`` = no limit of the runner's own.
        self.max_batch_size: int | None = None
        self._model_dir: str | None = None
        self._call_params: dict[str, inspect.Parameter] = {}
        self._batched_inputs = True
        # Facts about the pipeline kept across sleep(), when the pipeline itself is gone.
        self._native_size: tuple[int | None, int | None] = (None, None)
        self._size_multiple = 8
        self._size_reason = "the VAE scale factor"
        self._max_side: tuple[int | None, str | None] = (None, None)
        self._scheduler_name = ""
        self._step_limits = StageConstraints()
        #: A video model's frame rule (SizeLimits' frame fields); all None for an image model.
        self._frames_step: int | None = None
        self._frames_reason: str | None = None
        self._max_frames: int | None = None
        #: Whether the loaded pipeline makes videos (``frames``), and their default frame rate.
        self._video = False
        self._fps = DEFAULT_FPS
        #: An audio model's sample rate, longest clip (s) and why (SizeLimits' audio fields); the
        #: rate is None for a model that makes no audio.
        self._sample_rate: int | None = None
        self._max_audio_s: float | None = None
        self._audio_reason: str | None = None
        self._fixed_kwargs: dict[str, Any] = {}
        #: The loaded family's callback style; None: a pipeline of no registered family, read per
        #: form from its signature (:func:`callback_style`).
        self._callback: CallbackStyle | None = None
        # Step execution: the family's step loop (None: unsupported, for _step_reason) and the
        # state of each admitted request.
        self._step_family: StepFamily | None = None
        self._step_reason: str | None = "the model is not loaded"
        self._states: dict[str, StepState] = {}
        self._stepper = DiffusionStepper(self)
        #: The text / image / inpaint forms of the loaded model (image_inputs.py).
        self._forms: PipelineForms | None = None
        #: The denoiser's cache hooks and block counts; resident weight bytes per component.
        self.cache: StepCacheControl | None = None
        self._weight_bytes: dict[str, int] = {}
        #: Seconds the compile warm-up took at load (None: none ran).
        self._warmup_s: float | None = None
        self.loras = LoraAdapters(
            stage.engine_args.loras, stage.engine_args.max_loras, stage.engine_args.max_lora_file_mb * 2**20
        )
        #: Step execution: each prompt's encoder outputs kept across requests (None: off, or
        #: request-level, where the pipeline's own call encodes).
        bound = stage.engine_args.prompt_cache
        self.prompt_cache: PromptEmbeddingCache | None = (
            PromptEmbeddingCache(bound.max_bytes)
            if stage.engine_args.step_execution and bound is not None and bound.max_bytes > 0
            else None
        )

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def preload(cls, stage: StageConfig) -> None:
        import_model_libraries(diffusers=True)

    def load(self) -> None:
        # Model families registered from outside the package, imported here in the stage process.
        import_family_modules(self.stage.runner_args.get("families") or [])
        assert self.stage.model is not None  # needs_model: checked when the config is resolved
        self._model_dir = resolve_model(self.stage.model)
        self._load_pipeline()
        self.loras.check_registry()
        pipe = self.pipe
        signature = inspect.signature(type(pipe).__call__)
        self._call_params = dict(signature.parameters)
        forms = self._forms.forms.values() if self._forms is not None else ()
        self._batched_inputs = accepts_batched_inputs(signature) and all(
            accepts_batched_inputs(inspect.signature(type(f.pipe).__call__)) for f in forms
        )
        if not self._batched_inputs:
            self.max_batch_size = 1
            logger.warning(
                "%s does not take list prompts and generator lists; running requests one at a time",
                type(pipe).__name__,
            )
        # The family's spec rules sizes, call arguments and callbacks; a pipeline of no registered
        # family gets them derived from the pipeline itself.
        spec = for_pipeline(type(pipe).__name__)
        limits = spec.size_limits(pipe) if spec is not None else derive_size_limits(pipe)
        self._size_multiple = limits.multiple
        self._size_reason = limits.reason
        self._native_size = limits.native
        self._max_side = (limits.max_side, limits.max_side_reason)
        self._frames_step, self._frames_reason, self._max_frames = (
            limits.frames_step,
            limits.frames_reason,
            limits.max_frames,
        )
        # A video pipeline of no registered family is told by its num_frames argument.
        self._video = spec.output == "video" if spec is not None else "num_frames" in self._call_params
        self._fps = (spec.fps if spec is not None else None) or DEFAULT_FPS
        # Only a registered audio family makes audio: its limits hook says the rate and window.
        audio = spec is not None and spec.output == "audio"
        self._sample_rate = limits.sample_rate if audio else None
        self._max_audio_s, self._audio_reason = (limits.max_audio_s, limits.audio_reason) if audio else (None, None)
        self._scheduler_name = type(pipe.scheduler).__name__ if hasattr(pipe, "scheduler") else ""
        # What num_inference_steps the scheduler really runs (DDIM / PNDM: 999 of the 1,000 that
        # requests may ask for), reported at READY so a request past it is a 400, not a 500.
        self._step_limits = step_constraints(pipe.scheduler) if hasattr(pipe, "scheduler") else StageConstraints()
        self._fixed_kwargs = dict(spec.fixed_kwargs if spec is not None else DEFAULT_FIXED_KWARGS)
        self._callback = spec.callback if spec is not None else None
        compile_options = self.stage.engine_args.torch_compile
        if isinstance(compile_options, TorchCompile) and compile_options.warmup:
            self._compile_warmup()

    def _compile_warmup(self) -> None:
        """One image at the native size and the stage's default params, so the denoiser's first
        compilation is paid at start-up."""
        start = time.perf_counter()
        request = self._default_request("warm-up", "compile-warmup", seed=0, output_type="latent", cache="off")
        (out,) = self.execute([request], ExecuteContext(lambda rid: False))
        if out.error is not None:
            raise out.error
        self._warmup_s = time.perf_counter() - start
        logger.info("stage %d: compiled in a %.1f s warm-up", self.stage.stage_id, self._warmup_s)

    def _load_pipeline(self) -> None:
        assert self._model_dir is not None  # set by load
        spec = for_pipeline(index_class_name(self._model_dir))
        args = self.stage.engine_args
        pipe, applied = load_pipeline(self._model_dir, spec, args, self.device)
        if applied:
            logger.info("stage %d: %s", self.stage.stage_id, ", ".join(applied))
        # The text, img2img and inpainting forms of this model (ConfigError for a pipeline whose
        # inputs cannot be supplied); ``pipe`` is the text one where there is one. The forms share
        # the modules the options above were applied to.
        self._forms = PipelineForms(pipe)
        text = self._forms.text
        self.pipe = pipe = text.pipe if text is not None else pipe
        self.loras.bind(pipe)
        self.cache = StepCacheControl(pipe, args.cache, spec.name if spec is not None else type(pipe).__name__)
        self._weight_bytes = weight_bytes(pipe)
        self._step_family, self._step_reason = step_family(pipe, self.device)
        if self._step_family is not None and args.step_execution:
            self._step_family.row_cache = self.cache.row_cache()
        if self._step_family is not None and "image" in self._forms.forms:
            self._step_family.image_pipe = self._forms.forms["image"].pipe

    def sleep(self) -> dict[str, Any]:
        self.pipe = None
        if self._forms is not None:  # the call facts stay for batch_key; the modules go
            for form in self._forms.forms.values():
                form.pipe = None
        self.loras.bind(None)  # the adapters went with the pipeline; the registry stays
        self.cache = None
        self._weight_bytes = {}
        self._step_family = None
        self._states.clear()  # the worker fails those requests at the next step boundary
        self._invalidate_prompts()  # the cached embeddings hold device memory too
        return release_memory()

    def wake_up(self) -> dict[str, Any]:
        if self.pipe is not None:
            return {"reloaded": False}
        self._load_pipeline()
        return {"reloaded": True}

    # ------------------------------------------------------------------ LoRA control calls

    def rpc_list_loras(self) -> dict[str, Any]:
        """``collective_rpc("list_loras")``: registered names, loaded adapters (least recently used
        first), the active one, ``max_loras``, loads and evictions so far."""
        return self.loras.describe()

    def rpc_add_lora(self, name: str, path: str, load: bool = False) -> dict[str, Any]:
        """``collective_rpc("add_lora", kwargs={"name": ..., "path": ..., "load": False})``: offer the
        adapter at ``path`` (absolute, on the stage's machine) under ``name``; ``load`` loads it now.
        The prompt cache is cleared, failed or not: a name may now point at other weights."""
        try:
            return self.loras.add(name, path, load)
        finally:
            self._invalidate_prompts()

    def rpc_remove_lora(self, name: str) -> dict[str, Any]:
        """``collective_rpc("remove_lora", kwargs={"name": ...})``: stop offering ``name`` and unload
        it; the prompt cache is cleared, as by ``add_lora``."""
        try:
            return self.loras.remove(name)
        finally:
            self._invalidate_prompts()

    def _invalidate_prompts(self) -> None:
        if self.prompt_cache is not None:
            self.prompt_cache.invalidate()

    # ------------------------------------------------------------------ scheduling

    def constraints(self) -> StageConstraints:
        steps, (height, width) = self._step_limits, self._native_size
        out = msgspec.structs.replace(
            self._forms.constraints() if self._forms is not None else StageConstraints(),
            size_multiple=self._size_multiple,
            size_multiple_reason=self._size_reason,
            max_pixels=self.max_pixels(),
            max_side=self._max_side[0],
            max_side_reason=self._max_side[1],
            native_size=(height, width) if height and width else None,
            lora=self.loras.supported,
            min_inference_steps=steps.min_inference_steps,
            max_inference_steps=steps.max_inference_steps,
            inference_steps_reason=steps.inference_steps_reason,
            # A video pipeline of no registered family takes any frame count (step 1).
            frames_step=(self._frames_step or 1) if self._video else None,
            frames_reason=self._frames_reason,
            max_frames=self._max_frames,
            max_video_pixels=self.stage.engine_args.max_video_pixels if self._video else None,
            max_audio_s=self._max_audio_s,
            audio_reason=self._audio_reason,
        )
        if self.cache is not None:
            types, note = self.cache.served()
            out = msgspec.structs.replace(out, cache_types=types, cache_note=note)
        if self.stage.engine_args.step_execution and self._step_reason is None and out.image_inputs:
            # The worker runs every request of this stage in the step loop: what it cannot run
            # (inpainting; img2img outside the SD family) is refused before it is queued.
            family = self._step_family
            takes = family is not None and family.takes_images and family.image_pipe is not None
            out = msgspec.structs.replace(
                out,
                image_inputs=("image",) if takes else (),
                image_inputs_note="this stage runs with engine_args.step_execution, whose step loop runs "
                + ("img2img but not inpainting" if takes else "no image inputs for this pipeline")
                + "; serve them from a stage without step_execution",
            )
        return out

    def max_pixels(self) -> int:
        """The configured limit, or 4 x the model's native area: a 64 px model asked for 1024 x 1024
        would hold the replica for minutes to make what it was never trained for. A model whose
        configs state no native size (Wan's) is taken to be made for the stage's default size."""
        configured = self.stage.engine_args.max_pixels
        if configured is not None:
            return configured
        height, width = self._native_size
        if not (height and width):
            defaults = self.stage.default_sampling_params
            height, width = defaults.get("height"), defaults.get("width")
        return NATIVE_AREA_FACTOR * height * width if height and width else FALLBACK_MAX_PIXELS

    def _default(self, name: str, fallback: Any = None) -> Any:
        param = self._call_params.get(name)
        if param is None or param.default is inspect.Parameter.empty:
            return fallback
        return param.default

    # ------------------------------------------------------------------ the loaded model's defaults

    def size_of(self, p: DiffusionSamplingParams) -> tuple[int | None, int | None]:
        """(height, width): the request's, else the model's native size."""
        return p.height or self._native_size[0], p.width or self._native_size[1]

    def steps_of(self, p: DiffusionSamplingParams) -> int | None:
        return p.num_inference_steps or self._default("num_inference_steps")

    def guidance_of(self, p: DiffusionSamplingParams) -> float:
        scale = p.guidance_scale
        return float((self._default("guidance_scale") if scale is None else scale) or 0.0)

    def frames_of(self, p: DiffusionSamplingParams) -> int | None:
        """A video request's frame count, the pipeline's default if unset (None for images)."""
        frames = p.num_frames or self._default("num_frames")
        return int(frames) if self._video and frames else None

    def fps_of(self, p: DiffusionSamplingParams) -> int:
        """A video's frame rate: the request's, else its family's."""
        return int(p.fps or self._fps)

    def _clip_span(self, p: DiffusionSamplingParams) -> tuple[float, float]:
        """An audio request's ``(audio_start_in_s, audio_end_in_s)``: from 0 to the model's longest
        clip unless it says."""
        return float(p.audio_start_in_s or 0.0), float(p.audio_end_in_s or self._max_audio_s or 0.0)

    # ------------------------------------------------------------------ batching

    def profile_request(self) -> Request:
        """A prompt at the stage's defaults: the key of every request that sets no size, steps or
        guidance of its own, the one the learned policy most needs from the start."""
        return self._default_request("a red bicycle in a sunny park", seed=0)

    def batch_key(self, request: Request) -> Hashable:
        """Shape- and guidance-sensitive params with defaults resolved; never prompt or seed."""
        p = request.params
        return (
            *self.size_of(p),
            self.steps_of(p),
            self.guidance_of(p),
            # An empty negative prompt runs as no negative prompt (see execute), and must be batched
            # with those: SDXL zeroes the unconditional embedding for None but encodes "".
            bool(p.negative_prompt),
            p.per_prompt,
            in_force(p.output_type),
            self._scheduler_name,
            self._forms.key(p) if self._forms is not None else (),
            LoraAdapters.key(p.lora),
            # A video's frame count shapes the latents; fps does not (it is the item's), except
            # for a pipeline that takes it as its frame_rate (LTX scales its positions by it).
            self.frames_of(p),
            self.fps_of(p) if self._video and "frame_rate" in self._call_params else None,
            # A clip's start and end: the pipeline cuts one span from the whole wave's waveforms.
            self._clip_span(p) if self._sample_rate is not None else None,
            # The cache hooks are the denoiser's: one setting per wave (checked here, so a bad one
            # is this request's 400 before it queues).
            self._cache_key(p.cache),
        )

    def video_batch_cap(self, p: DiffusionSamplingParams) -> int | None:
        """Most requests of these (shape) params one forward may fuse so that the wave's total
        ``num_frames x height x width`` stays within ``engine_args.max_video_pixels`` (at least
        one: a single request past it was refused before it was queued); None: no such bound."""
        limit = self.stage.engine_args.max_video_pixels
        if not self._video or limit is None:
            return None
        height, width = self.size_of(p)
        per_request = (self.frames_of(p) or 1) * (height or 0) * (width or 0) * int(p.num_images_per_prompt or 1)
        return max(1, limit // per_request) if per_request else None

    def _cache_key(self, value: Any) -> str:
        if value is not None and self.cache is not None:
            self.cache.resolve(value)
        return cache_key(value)

    def stats(self) -> dict[str, Any]:
        """Step-cache block counts (``cache``), the prompt cache's counts (``prompt_cache``; None
        when off) and resident weight bytes (``weight_bytes``, total and
        ``weight_bytes_by_component``) of the loaded model."""
        return {
            "cache": self.cache.stats() if self.cache is not None else None,
            "prompt_cache": self.prompt_cache.stats() if self.prompt_cache is not None else None,
            "weight_bytes": sum(self._weight_bytes.values()),
            "weight_bytes_by_component": dict(self._weight_bytes),
            "compile_warmup_s": self._warmup_s,
        }

    # ------------------------------------------------------------------ execution

    def execute(self, batch: list[Request], ctx: ExecuteContext) -> list[RunnerOutput]:
        if self.max_batch_size is not None and len(batch) > self.max_batch_size:
            # A pipeline that cannot batch still serves a worker that ignored max_batch_size.
            size = self.max_batch_size
            return [out for i in range(0, len(batch), size) for out in self.execute(batch[i : i + size], ctx)]
        video_cap = self.video_batch_cap(batch[0].params)
        if video_cap is not None and len(batch) > video_cap:
            # A fused wave of videos past max_video_pixels runs in parts that each fit (equal keys:
            # one size and frame count, so one cap for all).
            parts = [batch[i : i + video_cap] for i in range(0, len(batch), video_cap)]
            return [out for part in parts for out in self.execute(part, ctx)]
        if self.pipe is None:
            raise StageAsleepError("the diffusion stage is asleep; call wake_up first")
        if len(batch) > 1 and self._form(batch[0].params).single_image:
            # A form whose pipeline takes one input image runs each request as its own call.
            return [out for r in batch for out in self.execute([r], ctx)]
        called = time.perf_counter()
        ids = [r.request_id for r in batch]
        first = batch[0].params  # equal batch keys: the shape params of one stand for all
        per_prompt = first.per_prompt
        output_type = in_force(first.output_type)

        # 1) Seeds: the request's own, or a fresh one reported back so the image can be redone.
        seeds = request_seeds(batch)
        metrics: list[dict[str, float | int]] = [{"seed": s, "batch_size": len(batch)} for s in seeds]

        def aborted_outputs(ms: float) -> list[RunnerOutput]:
            return [
                RunnerOutput(error=RequestAbortedError(f"request {rid} was aborted"), metrics={**m, "execution_ms": ms})
                for rid, m in zip(ids, metrics, strict=True)
            ]

        if all(ctx.is_aborted(rid) for rid in ids):  # everyone left before the wave started
            return aborted_outputs(0.0)
        try:  # one adapter (or none) and one cache setting for the whole wave: both are in the key
            self.loras.activate(first.lora)
            if self.cache is not None:
                self.cache.use(self.cache.resolve(first.cache), int(self.steps_of(first) or 1))
        except RequestError as e:
            return [RunnerOutput(error=e, metrics=m) for m in metrics]
        blocks = (self.cache.blocks_called, self.cache.blocks_run) if self.cache is not None else (0, 0)

        # 2) One generator per output image, in the pipeline's prompt-major order (req0's k images,
        #    then req1's...); image j of a request uses seed + j, whatever its batch-mates.
        generators = image_generators(seeds, per_prompt, self.device)

        # 3) Call arguments; absent params are left out so the pipeline's own defaults apply, except
        #    the size (the model's native one, see below).
        # The pipeline of the wave's form: text-to-image, img2img or inpainting (equal keys: one form).
        form = self._form(first)
        call_params = form.call_params
        batched = self._batched_inputs
        # Image forms get one row per output image (prompts repeated per image): their pipelines
        # pair input images with generators row by row. (A pipeline without list inputs takes one
        # request, its image once, and num_images_per_prompt.)
        rows = per_prompt if form.kind != TEXT and batched else 1
        prompts = [r.prompt for r in batch for _ in range(rows)]
        # "" is what pipelines use for a missing negative prompt, so a list may mix both.
        given = [r.params.negative_prompt or "" for r in batch for _ in range(rows)]
        negatives = given if any(given) else None
        kwargs: dict[str, Any] = {
            "prompt": prompts if batched else prompts[0],
            "generator": generators if batched else generators[0],
            "negative_prompt": negatives if batched or negatives is None else negatives[0],
            "num_images_per_prompt": per_prompt // rows,
            "num_videos_per_prompt": per_prompt // rows,  # the video pipelines' name for it
            "num_waveforms_per_prompt": per_prompt // rows,  # the audio pipelines' name for it
            "num_frames": first.num_frames,
            # LTX's name for the frame rate its positions are scaled by (in the batch key).
            "frame_rate": self.fps_of(first),
            # The native size is always passed: a signature default can be the real model's size
            # whatever this model is (Sana: 1024; Flux: 128 latent pixels per VAE factor).
            "height": self.size_of(first)[0],
            "width": self.size_of(first)[1],
            "num_inference_steps": first.num_inference_steps,
            "guidance_scale": first.guidance_scale,
            # Decode to floats once; uint8 images are made here, identically for every pipeline.
            "output_type": "latent" if output_type == "latent" else "np",
        }
        if self._sample_rate is not None:
            kwargs["audio_start_in_s"], kwargs["audio_end_in_s"] = self._clip_span(first)
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k in call_params}
        kwargs.update({k: v for k, v in self._fixed_kwargs.items() if k in call_params})
        kwargs.update(size_kwargs(call_params, kwargs.get("height"), kwargs.get("width")))
        if form.kind != TEXT:
            image_kwargs = image_call_kwargs(batch, form, per_prompt)
            if not batched or form.single_image:
                image_kwargs = {k: v[0] if isinstance(v, list) else v for k, v in image_kwargs.items()}
            kwargs.update(image_kwargs)

        # 4) Abort while running: leave the loop only when no one is waiting for this wave; a wave
        #    with a live request finishes (the worker drops the aborted ones' outputs).
        watch = StepWatch(ids, ctx)
        # An image form runs int(steps x strength) steps, its pipeline's default strength included:
        # then the pipeline's own count is used.
        steps = total_steps(kwargs) if form.kind == TEXT else None
        kwargs.update(watch.callbacks(self._callback or callback_style(call_params), steps))

        # 5) The forward, timed alone; a pipeline error propagates for the worker to isolate.
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                result = form.pipe(**kwargs)
        except WaveAborted:
            return aborted_outputs((time.perf_counter() - start) * 1e3)
        end = time.perf_counter()
        elapsed_ms = (end - start) * 1e3
        # After the last denoising step: the VAE decode and post-processing of the whole wave.
        decode_ms = (end - watch.last) * 1e3 if watch.last is not None and output_type != "latent" else None
        if self._video:
            images = result.frames if hasattr(result, "frames") else result[0]
        elif self._sample_rate is not None:
            images = result.audios if hasattr(result, "audios") else result[0]
        else:
            images = result.images if hasattr(result, "images") else result[0]

        # 6) Split back per request, k consecutive outputs each.
        outputs = []
        for i, m in enumerate(metrics):
            part = images[i * per_prompt : (i + 1) * per_prompt]
            fps = self.fps_of(batch[i].params) if self._video else None
            out = decoded_output(part, output_type, int(m["seed"]), fps=fps, sample_rate=self._sample_rate)
            out.metrics.update(m, execution_ms=elapsed_ms)
            if watch.first is not None:  # since execute() was called: encoding and the first denoising step
                out.metrics["first_step_ms"] = (watch.first - called) * 1e3
            if decode_ms is not None:
                out.metrics["decode_ms"] = decode_ms
            if self.cache is not None:  # the wave's denoiser blocks (each wave's outputs carry the same)
                out.metrics["cache_blocks_called"] = self.cache.blocks_called - blocks[0]
                out.metrics["cache_blocks_run"] = self.cache.blocks_run - blocks[1]
            out.metrics["weight_bytes"] = sum(self._weight_bytes.values())
            outputs.append(out)
        return outputs

    def _form(self, params: DiffusionSamplingParams) -> PipelineForm:
        """The pipeline form (text, img2img, inpaint) that serves requests with these params."""
        if self._forms is None:
            return PipelineForm(TEXT, self.pipe, self._call_params)
        return self._forms.form(params)

    # ------------------------------------------------------------------ step execution

    def step_support(self) -> str | None:
        return self._step_reason

    def step_key(self, request: Request) -> Hashable:
        """Size (and a video's frame count), guidance mode and LoRA adapter: requests of one key take
        a step in one denoiser call. The step count, guidance scale, seed and negative prompt are per
        sample and not part of it; the adapter and its scale are the pipeline's, so they are."""
        p = request.params
        cfg = self._family.uses_cfg(self.guidance_of(p))
        return (*self.size_of(p), cfg, LoraAdapters.key(p.lora), self.frames_of(p))

    def step_count(self, request: Request) -> int | None:
        """Its steps; an image request's ``strength`` runs that share of them (its pipeline's
        default strength, when unset, is not read here: the count is then an upper bound)."""
        p = request.params
        steps = self.steps_of(p)
        if steps is None or p.strength is None or self._form(p).kind == TEXT:
            return steps
        return max(1, int(steps * p.strength))

    def step_batch_cap(self, request: Request) -> int | None:
        """A video's share of ``engine_args.max_video_pixels``, as a request-level wave's."""
        return self.video_batch_cap(request.params)

    @property
    def _family(self) -> StepFamily:
        """The step family; the step methods run only where :meth:`step_support` said yes."""
        assert self._step_family is not None
        return self._step_family

    def step_admit(self, requests: list[Request], ctx: ExecuteContext) -> dict[str, RunnerOutput]:
        return self._stepper.admit(requests)

    def step_run(self, request_ids: list[str], ctx: ExecuteContext) -> dict[str, StepResult]:
        return self._stepper.run(request_ids, ctx)

    def step_drop(self, request_ids: list[str]) -> None:
        self._stepper.drop(request_ids)

    def _step_denoise(self, states: list[StepState]) -> list[torch.Tensor]:
        """The batched denoiser call of one step (a seam for tests that inject a failure)."""
        return self._family.denoise(states)
