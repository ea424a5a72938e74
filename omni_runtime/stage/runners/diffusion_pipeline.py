"""The diffusion runner's pipeline, outside its scheduling: a diffusers pipeline loaded from a model
directory with the engine's options, the facts of its ``__call__`` the runner reads (list inputs,
its step callback), the step callback of a wave's call, and what it returns turned into one
request's output.

Runs in the stage worker: loading at start-up and on ``wake_up``, the rest in the forward thread.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from typing import Any

import numpy as np
import torch

from omni_runtime.config import EngineArgs, TorchCompile
from omni_runtime.exceptions import ConfigError
from omni_runtime.media import audio_items, image_items, video_items
from omni_runtime.models.families import CallbackStyle, FamilySpec
from omni_runtime.stage.runners.acceleration import apply_memory_options, check_components, quantization_kwargs
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput
from omni_runtime.stage.runners.dummy_weights import dummy_pipeline
from omni_runtime.stage.runners.sizes import denoiser
from omni_runtime.stage.runners.torch_common import WaveAborted

#: A video's frame rate when neither the request nor its family names one.
DEFAULT_FPS = 16


def accepts_batched_inputs(signature: inspect.Signature) -> bool:
    """Whether a pipeline ``__call__`` takes a list of prompts and a list of generators.

    An unannotated parameter is given the benefit of the doubt; one annotated without any list
    type (e.g. ``prompt: str``) is not.
    """

    def takes_list(name: str) -> bool:
        param = signature.parameters.get(name)
        if param is None:
            return False
        annotation = param.annotation
        if annotation is inspect.Parameter.empty:
            return True
        text = annotation if isinstance(annotation, str) else repr(annotation)
        return any(word in text for word in ("list", "List", "Sequence", "Iterable"))

    return takes_list("prompt") and takes_list("generator")


def load_pipeline(model_dir: str, spec: FamilySpec | None, args: EngineArgs, device: str) -> tuple[Any, list[str]]:
    """The pipeline of ``model_dir`` (through its family's ``spec`` where that names a class of its
    own, else diffusers') with ``engine_args``' weights, memory and model-running options applied,
    and what was applied."""
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # A stage process has no terminal to draw on: loading bars are only noise in server logs.
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    # local_files_only: a model directory is complete on disk; never reach for a hub. A
    # registered family's pipeline class outside diffusers loads through that class.
    pipeline_cls = DiffusionPipeline
    if spec is not None and spec.pipeline_class:
        pipeline_cls = spec.load_pipeline_class()
    if args.load_format == "dummy":
        # Offloaded weights live in CPU memory: built there, moved per use like real ones.
        pipe = dummy_pipeline(pipeline_cls, model_dir, args, "cpu" if args.offload else device)
    else:
        pipe = pipeline_cls.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype), local_files_only=True, **quantization_kwargs(args)
        )
        check_components(pipe, args)
    pipe, applied = apply_memory_options(pipe, args, device)
    pipe.set_progress_bar_config(disable=True)
    applied += apply_engine_options(pipe, args)
    return pipe, applied


def apply_engine_options(pipe: Any, args: EngineArgs) -> list[str]:
    """The model-running options of ``engine_args`` (channels-last, attention slicing, VAE tiling,
    ``torch.compile``), applied to a loaded pipeline; returns what was applied, for the log.
    An option the pipeline has no use for (channels-last on a transformer) is skipped, not an error."""
    applied = []
    if args.channels_last:
        for name in ("unet", "vae"):
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                # Module.to takes memory_format, which torch's overloads of it leave out.
                module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
                applied.append(f"{name} channels-last")
    if args.attention_slicing is not None and hasattr(pipe, "enable_attention_slicing"):
        pipe.enable_attention_slicing(args.attention_slicing)
        applied.append(f"attention slicing {args.attention_slicing}")
    vae = getattr(pipe, "vae", None)
    if args.vae_tiling and vae is not None and hasattr(vae, "enable_tiling"):
        vae.enable_tiling()
        applied.append("VAE tiling")
    if args.vae_slicing and vae is not None and hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
        applied.append("VAE slicing")
    if args.torch_compile:
        options = args.torch_compile if isinstance(args.torch_compile, TorchCompile) else TorchCompile()
        module = denoiser(pipe)
        compile_kwargs = {
            "backend": options.backend,
            "mode": options.mode,
            "fullgraph": options.fullgraph,
            "dynamic": options.dynamic,
        }
        # In place (the module stays the pipeline's, so its config and hooks are as they were);
        # compilation itself happens at the first forward of each shape.
        if options.regional:
            if not getattr(module, "_repeated_blocks", None):
                raise ConfigError(
                    f"{type(module).__name__} names no repeated blocks for diffusers' regional compilation "
                    "(the flux and wan transformers and the UNets do); drop regional",
                    path="engine_args.torch_compile.regional",
                )
            module.compile_repeated_blocks(**compile_kwargs)
        else:
            module.compile(**compile_kwargs)
        where = "repeated blocks" if options.regional else type(module).__name__
        applied.append(f"torch.compile of the {where} ({options.backend})")
    return applied


def callback_style(call_params: dict[str, inspect.Parameter]) -> CallbackStyle:
    """The callback style of a pipeline of no registered family, from its ``__call__`` signature."""
    if "callback_on_step_end" in call_params:
        return "on_step_end"
    if "callback" in call_params and "callback_steps" in call_params:
        return "legacy"
    return "none"


class StepWatch:
    """The step callback of one pipeline call: it notes when the first and the latest denoising
    step ended (what follows the latest is the decode), reports each step's progress, and leaves
    the call (:class:`~omni_runtime.stage.runners.torch_common.WaveAborted`) once every request
    of the wave is aborted."""

    def __init__(self, ids: list[str], ctx: ExecuteContext) -> None:
        self.ids = ids
        self.ctx = ctx
        self.first: float | None = None
        self.last: float | None = None

    def _step(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        if all(self.ctx.is_aborted(rid) for rid in self.ids):
            raise WaveAborted

    def callbacks(self, style: CallbackStyle, steps: int | None) -> dict[str, Any]:
        """The call arguments of a pipeline whose callback is of ``style``, for a call of ``steps``
        steps (None: the pipeline's own count, or the step alone where it does not say)."""
        ids, ctx = self.ids, self.ctx
        if style == "on_step_end":

            def on_step_end(pipe: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
                self._step()
                ctx.step_progress(ids, step + 1, steps or getattr(pipe, "num_timesteps", 0) or step + 1)
                return callback_kwargs

            return {"callback_on_step_end": on_step_end}
        if style == "legacy":

            def legacy_callback(step: int, timestep: Any, latents: Any) -> None:
                self._step()
                ctx.step_progress(ids, step + 1, steps or step + 1)

            return {"callback": legacy_callback, "callback_steps": 1}
        return {}


def index_class_name(model_dir: str) -> str:
    """The pipeline class a model directory's ``model_index.json`` names ("" if none)."""
    try:
        with open(os.path.join(model_dir, "model_index.json")) as f:
            name = json.load(f).get("_class_name", "")
    except (OSError, ValueError):
        return ""
    return name if isinstance(name, str) else ""


def total_steps(kwargs: dict[str, Any]) -> int | None:
    """The denoising steps a call will run, when the call says (img2img's strength may shorten it:
    then the pipeline's own count is used)."""
    steps = kwargs.get("num_inference_steps")
    return int(steps) if isinstance(steps, int) and "strength" not in kwargs else None


def decoded_output(
    part: Any, output_type: str, seed: int, *, fps: int | None = None, sample_rate: int | None = None
) -> RunnerOutput:
    """One request's share of what a pipeline (or a step loop's decode) returned, as its output:
    ``latent`` tensors as float32 ``latents``; else float arrays in [0, 1] as ``images`` /
    ``videos`` / ``audios`` for ``np``, or media items (uint8 images, videos at ``fps``, audio at
    ``sample_rate``; ``seed`` numbers them). ``fps`` is set for a video, ``sample_rate`` for audio."""
    out = RunnerOutput()
    if output_type == "latent":
        # float() first: numpy has no bfloat16.
        latents = part.detach().float().cpu() if torch.is_tensor(part) else part
        out.tensors["latents"] = np.asarray(latents, dtype=np.float32)
        return out
    floats = np.asarray(part, dtype=np.float32)
    if sample_rate is not None and output_type == "np":
        out.tensors["audios"] = floats
    elif sample_rate is not None:
        out.media.extend(audio_items(floats, sample_rate=sample_rate, seed=seed))
    elif fps is not None and output_type == "np":
        out.tensors["videos"] = floats
    elif fps is not None:
        out.media.extend(video_items(floats, fps=fps, seed=seed))
    elif output_type == "np":
        out.tensors["images"] = floats
    else:
        out.media.extend(image_items(floats, seed=seed))
    return out
