"""The GPU acceptance kit: one run, in a fixed time budget, of what only a GPU can tell about the
runtime, on full-size SDXL, FLUX.1-dev and Wan 2.1 1.3B shapes with random weights
(``load_format: dummy`` over the configs-only directories of benchmarks/gpu_models.py).

Parts, in order of value (a budget cut drops the last):

  a  a direct diffusers pipeline call against the same request through ``Omni`` (process backend),
     batch 1, SDXL and FLUX at 1024 px: the runtime's overhead per request
  g  FLOPs per denoising step (torch's FlopCounterMode over the denoiser's forwards of one step)
     and MFU for SDXL and FLUX at 1024 px and Wan 2.1 1.3B at 832x480, 81 frames, beside the
     published single-GPU figures
  b  request-level fusion through Omni: images/s at batch 1, 2, 4, 8 (SDXL at 512 and 1024 px,
     FLUX at 1024 px at fewer points) and the speed-up over batch 1
  d  first-block cache and MagCache on FLUX through Omni (a request's ``cache``): speed-up and the
     deviation of the latents from the uncached ones
  f  torchao int8 and float8 weight-only quantization and float8 layerwise casting of the FLUX
     transformer (``engine_args.quantization`` / ``layerwise_casting``): time per step, weight bytes
  e  regional ``torch.compile`` of the FLUX transformer (``torch_compile: {regional: true}``):
     compile seconds and steady speed-up
  c  step against request batching (``step_execution``) under one seeded Poisson load, SDXL 512 px
  p  one replica over two GPUs (``runtime.parallel``): FLUX with Ulysses 2, SDXL with CFG-parallel
     2, time per step against one GPU (two GPUs needed; with one, the part says so)
  h  no stage process left once every engine is closed

Times are taken between ``torch.cuda.synchronize()`` calls after a warm-up. A time per denoising
step comes from two runs of a few steps (the difference over the extra steps), never from full
28- or 50-step runs; full-run seconds are extrapolated from it and labeled so. After every part
``results.json`` and ``results.md`` are rewritten in ``--out``, so a killed run keeps what finished.

    python -m benchmarks.gpu --out DIR [--tiny] [--budget-s 420] [--device cuda] [--peak-tflops F]

``--tiny``: the same parts over the tiny builtins' configs with tiny sizes and step counts (the
CPU dry run of tests/benchmarks/test_gpu_kit.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import platform
import random
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import pct, write_json
from benchmarks.gpu_models import T5_LAYERS, write_models

logger = logging.getLogger("benchmarks.gpu")

PROMPT = "a red fox in a snowy forest, golden hour"
#: Dense bf16 tensor-core peak (TFLOP/s) by GPU name: H100 SXM and H200 alike; H100 PCIe lower.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4))
#: Published single-GPU full runs: (steps, seconds, MFU) to set the extrapolated figures beside.
ANCHORS = {
    "flux": "FLUX.1-dev 1024 px, 28 steps: 4.30 s compiled on one H100 (about 46-49 % MFU)",
    "wan": "Wan 2.1 1.3B 480p, 81 frames, 50 steps: about 48-52 s on one H100 (about 55-60 % MFU)",
}
FULL_RUN_STEPS = {"sdxl": 50, "flux": 28, "wan": 50}


@dataclass(frozen=True)
class Shapes:
    """Sizes and step counts of one mode (full size on a GPU, tiny for the CPU dry run)."""

    size: dict[str, int]  # the large image size per family
    small: int  # SDXL's smaller size (b, c)
    video: tuple[int, int, int]  # Wan's height, width, frames
    steps: tuple[int, int]  # the two step counts whose difference gives a time per step
    request_steps: int  # steps of a whole request (a, b)
    cache_steps: int  # d: caches act over a whole run
    batches: tuple[int, ...]
    flux_batches: tuple[int, ...]
    poisson_steps: int
    poisson_requests: int
    repeats: int


FULL = Shapes(
    size={"sdxl": 1024, "flux": 1024},
    small=512,
    video=(480, 832, 81),
    steps=(2, 6),
    request_steps=4,
    cache_steps=16,
    batches=(1, 2, 4, 8),
    flux_batches=(1, 4),
    poisson_steps=8,
    poisson_requests=24,
    repeats=3,
)
TINY = Shapes(
    size={"sdxl": 64, "flux": 64},
    small=32,
    video=(32, 32, 9),
    steps=(1, 3),
    request_steps=2,
    cache_steps=6,
    batches=(1, 2),
    flux_batches=(1, 2),
    poisson_steps=2,
    poisson_requests=4,
    repeats=1,
)


class Kit:
    """The run's state: its arguments, clock, model directories, the engines and direct pipelines the
    parts share (each made once, released once no later part needs it) and the results so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.torch = torch
        self.out = Path(args.out)
        self.shape = TINY if args.tiny else FULL
        self.device = args.device
        self.cuda = args.device.startswith("cuda")
        self.dtype = args.dtype or ("bfloat16" if self.cuda else "float32")
        if not self.cuda:
            # Intra-op threads that wait for each other slow a CPU run down many times over while the
            # stage processes share the cores (the dry run), as tests/conftest.py's model_cache says.
            torch.set_num_threads(1)
        self.started = time.monotonic()
        self.part_deadline = 0.0
        self.models = write_models(self.out / "models", tiny=args.tiny)
        self.results: dict[str, Any] = {"meta": self.meta(), "parts": {}}
        self._engines: dict[str, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-start")
        self._direct: dict[str, Any] = {}
        #: Figures one part measures and a later one compares with (the plain FLUX time per step).
        self.shared: dict[str, Any] = {}

    # ------------------------------------------------------------------ clock and results

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def part_left(self) -> float:
        return min(self.part_deadline - time.monotonic(), self.left())

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Seconds ``fn()`` took, the device idle before and drained after."""
        self.sync()
        start = time.perf_counter()
        result = fn()
        self.sync()
        return time.perf_counter() - start, result

    def per_step(self, run: Callable[[int], Any], repeats: int | None = None) -> tuple[float, float]:
        """(seconds per denoising step, seconds outside the steps) from runs of the two step
        counts of the mode, the fastest of ``repeats`` each, after a warm-up."""
        lo, hi = self.shape.steps
        run(lo)
        repeats = repeats or self.shape.repeats
        best = {s: min(self.timed(lambda s=s: run(s))[0] for _ in range(repeats)) for s in (lo, hi)}
        step = max(best[hi] - best[lo], 0.0) / (hi - lo)
        return step, best[lo] - lo * step

    def meta(self) -> dict[str, Any]:
        import diffusers
        import transformers

        torch = self.torch
        gpu = torch.cuda.get_device_name(0) if self.cuda else platform.processor() or "cpu"
        peak = self.args.peak_tflops or next((v for k, v in PEAK_TFLOPS if k in gpu), None)
        try:
            import torchao

            torchao_version = torchao.__version__
        except ImportError as e:
            torchao_version = f"not importable: {e}"
        return {
            "device": self.device,
            "gpu": gpu,
            "peak_bf16_tflops": peak,
            "dtype": self.dtype,
            "tiny": self.args.tiny,
            "budget_s": self.args.budget_s,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "torchao": torchao_version,
            "t5_layers": T5_LAYERS,
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    def write(self) -> None:
        self.results["meta"]["elapsed_s"] = round(time.monotonic() - self.started, 1)
        write_json(str(self.out / "results.json"), self.results)
        (self.out / "results.md").write_text(markdown(self.results))

    # ------------------------------------------------------------------ engines and pipelines

    def deploy(self, family: str, runtime: dict[str, Any] | None = None, **engine_args: Any) -> Any:
        from omni_runtime.config import parse_config

        stage = {
            "stage_id": 0,
            "stage_type": "diffusion",
            "model": str(self.models[family]),
            # One torch thread each on the dry run's two cores; on a GPU the host threads only launch.
            "runtime": {
                "backend": self.args.backend,
                "devices": self.device,
                "torch_threads": 0 if self.cuda else 1,
                **(runtime or {}),
            },
            "engine_args": {"load_format": "dummy", "dtype": self.dtype, "max_num_seqs": 8, **engine_args},
            "final_output": True,
            "final_output_type": "image",
        }
        return parse_config({"model": family, "stage_args": [stage]}, source=f"gpu-kit {family}")

    def start_engine(self, name: str) -> None:
        """Start an engine in the background: its process start and model build overlap the parts'
        own work. ``sdxl_step`` is the SDXL stage with step execution (part c)."""
        if name in self._engines:
            return
        from omni_runtime import Omni

        family, _, mode = name.partition("_")
        config = self.deploy(family, step_execution=mode == "step")
        self._engines[name] = self._pool.submit(Omni, config)

    def engine(self, name: str) -> Any:
        self.start_engine(name)
        return self._engines[name].result()

    def generate(self, omni: Any, params: dict[str, Any], n: int = 1) -> list[Any]:
        outs = omni.generate([f"{PROMPT} {i}" for i in range(n)], params, use_tqdm=False)
        for out in outs:
            if out.error is not None:
                raise out.error
        return outs

    def direct(self, family: str) -> Any:
        """The family's pipeline in this process (dummy weights on the device), for direct calls."""
        if family not in self._direct:
            from diffusers import DiffusionPipeline

            from omni_runtime.config import EngineArgs
            from omni_runtime.stage.runners.dummy_weights import dummy_pipeline

            pipe = dummy_pipeline(
                DiffusionPipeline, str(self.models[family]), EngineArgs(dtype=self.dtype), self.device
            )
            pipe.set_progress_bar_config(disable=True)
            self._direct[family] = pipe
        return self._direct[family]

    def call(self, pipe: Any, size: int | tuple[int, int], steps: int, output_type: str, **extra: Any) -> Any:
        height, width = (size, size) if isinstance(size, int) else size
        generator = self.torch.Generator(self.device).manual_seed(0)
        with self.torch.inference_mode():
            return pipe(
                prompt=PROMPT,
                height=height,
                width=width,
                num_inference_steps=steps,
                generator=generator,
                output_type=output_type,
                **extra,
            )

    def runner(self, family: str, **engine_args: Any) -> Any:
        """A DiffusionRunner in this process (the runtime's load path without a stage process)."""
        from omni_runtime.stage.runners.diffusion import DiffusionRunner

        runner = DiffusionRunner(self.deploy(family, **engine_args).stage_args[0])
        runner.load()
        return runner

    def execute(self, runner: Any, params: dict[str, Any]) -> np.ndarray:
        """One latent-output request through ``runner``; its latents."""
        from omni_runtime.params import resolve_params
        from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest

        resolved = resolve_params(runner.params_cls, {}, {"seed": 0, "output_type": "latent", **params})
        request = RunnerRequest(request_id="r", prompt=PROMPT, params=resolved)
        (out,) = runner.execute([request], ExecuteContext(lambda rid: False))
        if out.error is not None:
            raise out.error
        return out.tensors["latents"]

    def release(self, engines: set[str], directs: set[str]) -> None:
        """Close the engines and drop the pipelines not in the given sets."""
        closing = [n for n in self._engines if n not in engines]
        for name in closing:
            future = self._engines.pop(name)
            try:
                future.result().close()
            except Exception as e:  # a failed start was the part's error already
                logger.info("engine %s: %s", name, e)
        dropping = [n for n in self._direct if n not in directs]
        for name in dropping:
            del self._direct[name]
        if closing or dropping:
            self.free_memory()

    def drop_direct(self, family: str) -> None:
        self._direct.pop(family, None)
        self.free_memory()

    def free_memory(self) -> None:
        """The dropped models' device memory handed back before the next part builds its own. A CPU
        run skips it: nothing to hand back, and a collection of this heap takes half a second."""
        if self.cuda:
            from omni_runtime.stage.runners.torch_common import release_memory

            release_memory()

    def memory(self) -> dict[str, float]:
        if not self.cuda:
            return {}
        cuda = self.torch.cuda
        return {"allocated_gib": cuda.memory_allocated() / 2**30, "peak_gib": cuda.max_memory_allocated() / 2**30}


# ---------------------------------------------------------------------- the parts


def part_a(kit: Kit) -> dict[str, Any]:
    rows = []
    for family in ("sdxl", "flux"):
        size, steps = kit.shape.size[family], kit.shape.request_steps
        pipe, omni = kit.direct(family), kit.engine(family)
        omni.collective_rpc("set_batching", kwargs={"max_num_seqs": 1, "request_batch_max_wait_ms": 0})
        params = {"height": size, "width": size, "num_inference_steps": steps, "seed": 0}

        def direct(pipe: Any = pipe, size: int = size, steps: int = steps) -> tuple[Any, float]:
            """The call, and its decode: seconds from the last step's end to its return."""
            last_step = [0.0]

            def step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
                last_step[0] = time.perf_counter()  # no sync: as the stage's StepWatch times decode_ms
                return tensors

            out = kit.call(pipe, size, steps, "pil", callback_on_step_end=step_end)
            return out, time.perf_counter() - last_step[0]

        def served(omni: Any = omni, params: dict[str, Any] = params) -> Any:
            return kit.generate(omni, params)[0]

        direct(), served()  # warm-up: kernels, allocator, cuDNN's choices
        times: dict[str, list[float]] = {k: [] for k in ("direct", "direct_decode", "omni", "forward", "decode")}
        for _ in range(kit.shape.repeats):  # interleaved, so drift in the machine hits both
            seconds, (_, decode_s) = kit.timed(direct)
            times["direct"].append(seconds)
            times["direct_decode"].append(decode_s)
            seconds, out = kit.timed(served)
            times["omni"].append(seconds)
            times["forward"].append(out.metrics["execution_ms"] / 1e3)
            times["decode"].append(out.metrics.get("decode_ms", float("nan")) / 1e3)
        direct_s, omni_s, forward_s = (statistics.median(times[k]) for k in ("direct", "omni", "forward"))
        rows.append(
            {
                "model": family,
                "size": size,
                "steps": steps,
                "direct_ms": direct_s * 1e3,
                "omni_ms": omni_s * 1e3,
                "overhead_ms": (omni_s - direct_s) * 1e3,
                "overhead_pct": 100 * (omni_s - direct_s) / direct_s,
                "stage_forward_ms": forward_s * 1e3,
                "outside_forward_ms": (omni_s - forward_s) * 1e3,
                "direct_decode_ms": statistics.median(times["direct_decode"]) * 1e3,
                "stage_decode_ms": statistics.median(times["decode"]) * 1e3,
            }
        )
    return {
        "rows": rows,
        "notes": [
            f"median of {kit.shape.repeats} interleaved pairs after a warm-up; PIL output both ways",
            "stage_forward_ms: the stage's own pipeline call (execution_ms); outside_forward_ms: the rest "
            "of the request's wall time (queues, sockets, image transfer, conversion)",
            "direct_decode_ms / stage_decode_ms: from the last denoising step's end to the pipeline's return "
            "(VAE decode and post-processing; the stage's decode_ms metric, and a step-end callback direct)",
        ],
    }


def denoiser_flops(kit: Kit, pipe: Any, run: Callable[[int], Any]) -> float:
    """FLOPs of one denoising step: a 1-step run with every denoiser forward of it counted (two
    forwards a step under classifier-free guidance, as Wan calls it; one batch of two for SDXL)."""
    from torch.utils.flop_counter import FlopCounterMode

    from omni_runtime.stage.runners.sizes import denoiser

    module = denoiser(pipe)
    original = module.forward
    total = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        with FlopCounterMode(display=False) as counter:
            out = original(*args, **kwargs)
        total[0] += counter.get_total_flops()
        return out

    module.forward = counted
    try:
        run(1)
    finally:
        del module.forward
    return float(total[0])


def part_g(kit: Kit) -> dict[str, Any]:
    peak = kit.results["meta"]["peak_bf16_tflops"]
    height, width, frames = kit.shape.video
    cases: list[tuple[str, Any, dict[str, Any]]] = [
        ("sdxl", kit.shape.size["sdxl"], {}),
        ("flux", kit.shape.size["flux"], {}),
        ("wan", (height, width), {"num_frames": frames}),
    ]
    rows = []
    for family, size, extra in cases:
        if kit.part_left() < (30 if family == "wan" and not kit.args.tiny else 3):
            rows.append({"model": family, "skipped": "budget"})
            continue
        pipe = kit.direct(family)

        def run(steps: int, pipe: Any = pipe, size: Any = size, extra: dict[str, Any] = extra) -> Any:
            return kit.call(pipe, size, steps, "latent", **extra)

        flops = denoiser_flops(kit, pipe, run)
        # A Wan step is about a second: one run of each step count keeps the part in its budget.
        step_s, fixed_s = kit.per_step(run, repeats=1 if family == "wan" else None)
        achieved = flops / step_s / 1e12 if step_s > 0 else float("nan")
        full = FULL_RUN_STEPS[family]
        rows.append(
            {
                "model": family,
                "shape": f"{size}" + (f" x {frames} frames" if extra else ""),
                "tflop_per_step": flops / 1e12,
                "s_per_step": step_s,
                "achieved_tflops": achieved,
                "mfu_pct": 100 * achieved / peak if peak else "n/a (no peak for this device)",
                f"extrapolated_{full}_steps_s": fixed_s + full * step_s,
                "published": ANCHORS.get(family, ""),
            }
        )
        if family == "wan":  # used only here, and the largest activations of the run
            kit.drop_direct("wan")
    return {
        "rows": rows,
        "notes": [
            "MFU = FLOPs per step x steps per second / peak dense bf16 FLOP/s (H100/H200 SXM: 989.4 TFLOP/s, "
            "or --peak-tflops); FLOPs counted by torch.utils.flop_counter.FlopCounterMode over every denoiser "
            "forward of a 1-step run at the shape (2 x multiply-adds; attention included where torch has a "
            "formula for the kernel that ran)",
            f"s_per_step: the difference of {kit.shape.steps[0]}- and {kit.shape.steps[1]}-step runs "
            "(output_type latent), eager (not compiled), dummy weights",
            "extrapolated_*_s (EXTRAPOLATED, not measured): the runs' fixed part (text encoders, latents) + "
            "steps x s_per_step; no VAE decode. The published figures include it and are compiled",
            f"T5 / UMT5 run at {T5_LAYERS} of 24 layers (once per request; not in the per-step figures)",
        ],
    }


def set_batching(omni: Any, n: int, wait_ms: float) -> None:
    omni.collective_rpc("set_batching", kwargs={"max_num_seqs": n, "request_batch_max_wait_ms": wait_ms})


def part_b(kit: Kit) -> dict[str, Any]:
    points = [("sdxl", kit.shape.small, n) for n in kit.shape.batches]
    points += [("sdxl", kit.shape.size["sdxl"], n) for n in kit.shape.batches]
    points += [("flux", kit.shape.size["flux"], n) for n in kit.shape.flux_batches]
    rows: list[dict[str, Any]] = []
    base: dict[tuple[str, int], float] = {}
    for family, size, n in points:
        if kit.part_left() < 5:
            rows.append({"model": family, "size": size, "batch": n, "skipped": "budget"})
            continue
        omni = kit.engine(family)
        # A wave goes when it holds n requests (all are sent at once), never cut short by the wait.
        set_batching(omni, n, 1000)
        params = {"height": size, "width": size, "num_inference_steps": kit.shape.request_steps, "seed": 0}
        params["output_type"] = "latent"
        kit.generate(omni, params, n)  # warm-up: this batch shape's kernels
        seconds, outs = min(
            (kit.timed(lambda omni=omni, params=params, n=n: kit.generate(omni, params, n)) for _ in range(2)),
            key=lambda r: r[0],
        )
        rate = n / seconds
        base.setdefault((family, size), rate if n == 1 else float("nan"))
        rows.append(
            {
                "model": family,
                "size": size,
                "batch": n,
                "fused": statistics.mean(o.metrics["batch_size"] for o in outs),
                "s_per_wave": seconds,
                "images_per_s": rate,
                "speedup_vs_batch_1": rate / base[(family, size)],
            }
        )
    return {
        "rows": rows,
        "notes": [
            f"{kit.shape.request_steps} steps, output_type latent (no VAE decode), n requests sent at once with "
            "max_num_seqs = n; fastest of 2 after a warm-up; fused: the wave size the stage reported",
        ],
    }


def part_d(kit: Kit) -> dict[str, Any]:
    omni = kit.engine("flux")
    set_batching(omni, 1, 0)
    size, steps = kit.shape.size["flux"], kit.shape.cache_steps
    params = {"height": size, "width": size, "num_inference_steps": steps, "seed": 0, "output_type": "latent"}
    options: dict[str, Any] = {
        "off": "off",
        "first_block 0.05": {"type": "first_block", "threshold": 0.05},
        # Random weights change the first block's residual far more between steps than a trained
        # model's: a high threshold shows what skipping gains at all.
        "first_block 1.0": {"type": "first_block", "threshold": 1.0},
        "mag (uncalibrated)": {"type": "mag"},
    }
    kit.generate(omni, {**params, "cache": "off"})  # warm-up
    rows = []
    plain: tuple[float, np.ndarray] | None = None
    for name, cache in options.items():
        seconds, (out,) = kit.timed(lambda cache=cache: kit.generate(omni, {**params, "cache": cache}))
        latents = out.outputs_by_stage[0].tensors["latents"]
        plain = plain or (seconds, latents)
        called, ran = out.metrics.get("cache_blocks_called", 0), out.metrics.get("cache_blocks_run", 0)
        rows.append(
            {
                "cache": name,
                "s_per_image": seconds,
                "speedup": plain[0] / seconds,
                "blocks_skipped_pct": 100 * (1 - ran / called) if called else 0.0,
                "max_abs_dev": float(np.abs(latents - plain[1]).max()),
                "mean_abs_dev": float(np.abs(latents - plain[1]).mean()),
            }
        )
    return {
        "rows": rows,
        "notes": [
            f"FLUX {size} px, {steps} steps, one request each through Omni with its own `cache`; deviation of the "
            "output latents from the uncached request (same seed). Random weights: the deviation says how far "
            "a cache moves the output, not what it does to image quality; mag has no calibrated ratios here",
        ],
    }


def flux_plain(kit: Kit) -> dict[str, Any]:
    """The plain FLUX runner's time per step and weights, measured once for f and e."""
    if "flux_plain" not in kit.shared:
        runner = kit.runner("flux")
        kit.shared["flux_plain"] = {**measure_runner(kit, runner), "variant": "bf16 (plain)"}
        del runner
        kit.free_memory()
    return kit.shared["flux_plain"]


def measure_runner(kit: Kit, runner: Any) -> dict[str, Any]:
    size = kit.shape.size["flux"]
    if kit.cuda:
        kit.torch.cuda.reset_peak_memory_stats()
    step_s, _ = kit.per_step(
        lambda steps: kit.execute(runner, {"height": size, "width": size, "num_inference_steps": steps})
    )
    stats = runner.stats()
    return {
        "s_per_step": step_s,
        "transformer_gib": stats["weight_bytes_by_component"]["transformer"] / 2**30,
        **kit.memory(),
    }


def part_f(kit: Kit) -> dict[str, Any]:
    from omni_runtime.exceptions import ConfigError

    plain = flux_plain(kit)
    rows = [{**plain, "speedup": 1.0, "weights_ratio": 1.0}]
    variants = {
        "int8 weight-only": {"quantization": {"quant_type": "int8wo"}},
        "float8 weight-only": {"quantization": {"quant_type": "float8wo"}},
        "float8 layerwise casting": {
            "layerwise_casting": {"storage_dtype": "float8_e4m3fn", "compute_dtype": kit.dtype}
        },
    }
    for name, engine_args in variants.items():
        if kit.part_left() < 10:
            rows.append({"variant": name, "skipped": "budget"})
            continue
        try:
            load_s, runner = kit.timed(lambda engine_args=engine_args: kit.runner("flux", **engine_args))
        except ConfigError as e:  # what this device cannot run (float8 on a CPU): a reason, not a failure
            rows.append({"variant": name, "skipped": str(e)})
            continue
        row = {"variant": name, "load_s": load_s, **measure_runner(kit, runner)}
        row["speedup"] = plain["s_per_step"] / row["s_per_step"] if row["s_per_step"] else float("nan")
        row["weights_ratio"] = row["transformer_gib"] / plain["transformer_gib"]
        rows.append(row)
        del runner
        kit.free_memory()
    return {
        "rows": rows,
        "notes": [
            f"FLUX transformer at {kit.shape.size['flux']} px, eager, time per step from "
            f"{kit.shape.steps[0]}- and {kit.shape.steps[1]}-step runs; transformer_gib: the runtime's resident weight "
            "bytes (torchao tensors by their inner data); peak_gib: the process's peak while it ran",
        ],
    }


def part_e(kit: Kit) -> dict[str, Any]:
    plain = flux_plain(kit)
    # Inductor on a CPU needs a C++ compiler and minutes; the dry run checks the path with eager.
    backend = "inductor" if kit.cuda else "eager"
    size = kit.shape.size["flux"]
    runner = kit.runner("flux", torch_compile={"regional": True, "backend": backend})
    lo = kit.shape.steps[0]

    def run(steps: int) -> Any:
        return kit.execute(runner, {"height": size, "width": size, "num_inference_steps": steps})

    first_s, _ = kit.timed(lambda: run(lo))
    steady_s, _ = kit.timed(lambda: run(lo))
    step_s, _ = kit.per_step(run)
    return {
        "rows": [
            {
                "backend": backend,
                "compile_s": first_s - steady_s,
                "first_request_s": first_s,
                "s_per_step": step_s,
                "plain_s_per_step": plain["s_per_step"],
                "speedup": plain["s_per_step"] / step_s if step_s else float("nan"),
            }
        ],
        "notes": [
            f"FLUX {size} px, torch_compile {{regional: true, backend: {backend}}}: compile_s is the first "
            f"{lo}-step request's time less a steady one's (the compilation of the repeated blocks)",
        ],
    }


def part_c(kit: Kit) -> dict[str, Any]:
    size, steps, total = kit.shape.small, kit.shape.poisson_steps, kit.shape.poisson_requests
    params = {"height": size, "width": size, "num_inference_steps": steps}
    request, step = kit.engine("sdxl"), kit.engine("sdxl_step")
    set_batching(request, 8, 20)
    for omni in (request, step):
        kit.generate(omni, params)  # warm-up
    service_s = min(kit.timed(lambda: kit.generate(request, params))[0] for _ in range(2))
    rate = 2.0 / service_s  # twice what one-at-a-time serving keeps up with: a queue forms
    rng = random.Random(0)
    offsets = [0.0]
    for _ in range(total - 1):
        offsets.append(offsets[-1] + rng.expovariate(rate))
    rows = []
    for mode, omni in (("request", request), ("step", step)):
        latencies = [0.0] * total

        def one(i: int, omni: Any = omni, latencies: list[float] = latencies) -> None:
            start = time.perf_counter()
            kit.generate(omni, {**params, "seed": i})
            latencies[i] = time.perf_counter() - start

        start = time.perf_counter()
        threads = []
        for i, offset in enumerate(offsets):
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            threads.append(threading.Thread(target=one, args=(i,)))
            threads[-1].start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        ms = [x * 1e3 for x in latencies]
        rows.append(
            {"mode": mode, "requests": total, "req_s": total / wall, "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99)}
        )
    return {
        "rows": rows,
        "notes": [
            f"SDXL {size} px, {steps} steps, max_num_seqs 8 (request: request_batch_max_wait_ms 20); one seeded "
            f"Poisson sequence at {rate:.2f} req/s (2 x the one-at-a-time rate) sent to both engines",
        ],
    }


def part_o(kit: Kit) -> dict[str, Any]:
    """One SDXL request's time per step and outside the steps along each layer the runtime adds:
    the pipeline called directly, the same call from a worker thread (a stage runs its forwards on
    one), the runtime's runner in this process, and the whole path through ``Omni``."""
    pipe, runner, omni = kit.direct("sdxl"), kit.runner("sdxl"), kit.engine("sdxl")
    set_batching(omni, 1, 0)
    thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
    rows = []
    try:
        # The dry run takes one size: it checks the code path, not the figures.
        for size in (kit.shape.small,) if kit.args.tiny else (kit.shape.small, kit.shape.size["sdxl"]):
            params = {"height": size, "width": size, "output_type": "latent", "seed": 0}

            def direct(steps: int, size: int = size) -> Any:
                return kit.call(pipe, size, steps, "latent")

            paths: dict[str, Callable[[int], Any]] = {
                "direct": direct,
                "direct, on a worker thread": lambda steps: thread.submit(direct, steps).result(),
                "runner, in this process": lambda steps, p=params: kit.execute(
                    runner, {**p, "num_inference_steps": steps}
                ),
                "Omni (stage process)": lambda steps, p=params: kit.generate(omni, {**p, "num_inference_steps": steps}),
            }
            for path, run in paths.items():
                if kit.part_left() < 5:
                    rows.append({"size": size, "path": path, "skipped": "budget"})
                    continue
                step_s, fixed_s = kit.per_step(run)
                rows.append(
                    {"size": size, "path": path, "ms_per_step": step_s * 1e3, "ms_outside_steps": fixed_s * 1e3}
                )
    finally:
        thread.shutdown()
    return {
        "rows": rows,
        "notes": [
            f"SDXL, batch 1, output_type latent; per step from {kit.shape.steps[0]}- and {kit.shape.steps[1]}-step "
            "runs, fastest of the repeats after a warm-up; ms_outside_steps: text encoders, latents and, through "
            "Omni, the queues and sockets",
        ],
    }


def part_p(kit: Kit) -> dict[str, Any]:
    """One replica over two GPUs (``runtime.parallel``): FLUX with Ulysses 2 and SDXL with
    CFG-parallel 2, time per step against the same model on one GPU, and how far the group's
    latents are from the one GPU's (bf16). Needs two GPUs: with fewer, it records why not."""
    from omni_runtime import Omni

    count = kit.torch.cuda.device_count() if kit.cuda else 0
    if count < 2:
        where = "the CPU dry run" if not kit.cuda else f"{count} GPU"
        return {
            "rows": [{"skipped": f"{where}: a group needs two GPUs"}],
            "notes": ["on the CPU, tests/omni_runtime/stage/test_rank_group.py runs the groups over gloo"],
        }
    rows = []
    for family, parallel in (("flux", {"ulysses_degree": 2}), ("sdxl", {"cfg_parallel_size": 2})):
        size = kit.shape.size[family]
        params = {"height": size, "width": size, "output_type": "latent", "seed": 0}

        def run(omni: Any, steps: int, params: dict[str, Any] = params) -> Any:
            return kit.generate(omni, {**params, "num_inference_steps": steps})

        one = kit.engine(family)
        step_one, _ = kit.per_step(lambda steps, one=one: run(one, steps))
        reference = np.asarray(run(one, kit.shape.steps[0])[0].tensors["latents"], dtype=np.float32)
        kit.release(set(), set())  # the one-GPU engine's memory, before the group loads
        group = Omni(kit.deploy(family, runtime={"devices": "cuda:0,cuda:1", "parallel": parallel}))
        try:
            step_two, _ = kit.per_step(lambda steps, group=group: run(group, steps))
            latents = np.asarray(run(group, kit.shape.steps[0])[0].tensors["latents"], dtype=np.float32)
        finally:
            group.close()
        rows.append(
            {
                "family": family,
                "size": size,
                "parallel": ", ".join(f"{k} {v}" for k, v in parallel.items()),
                "ms_per_step_1_gpu": step_one * 1e3,
                "ms_per_step_2_gpus": step_two * 1e3,
                "speedup": step_one / step_two if step_two else None,
                "max_abs_latent_diff": float(np.abs(latents - reference).max()),
            }
        )
    return {"rows": rows, "notes": ["batch 1, output_type latent; per step as in part o; bf16 on both"]}


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    run: Callable[[Kit], dict[str, Any]]
    #: Seconds it needs at the least on a GPU (skipped below), and the most it may take.
    need_s: float
    cap_s: float
    engines: frozenset[str] = frozenset()
    directs: frozenset[str] = frozenset()


PARTS = (
    Part("a", "Runtime overhead per request: direct pipeline vs Omni", part_a, 40, 120,
         frozenset({"sdxl", "flux"}), frozenset({"sdxl", "flux"})),
    Part("g", "FLOPs per step and MFU", part_g, 30, 90, directs=frozenset({"sdxl", "flux"})),
    Part("b", "Request-level fusion throughput", part_b, 20, 70, frozenset({"sdxl", "flux"})),
    Part("d", "First-block cache and MagCache (FLUX)", part_d, 15, 45, frozenset({"flux"})),
    Part("f", "Quantization and layerwise casting (FLUX transformer)", part_f, 40, 90),
    Part("e", "Regional torch.compile (FLUX)", part_e, 60, 150),
    Part("c", "Step vs request batching under Poisson load (SDXL)", part_c, 40, 70, frozenset({"sdxl"})),
    Part("o", "Where an SDXL request's time goes: direct, worker thread, runner, Omni", part_o, 30, 90,
         frozenset({"sdxl"}), frozenset({"sdxl"})),
    Part("p", "One replica over two GPUs: Ulysses (FLUX) and CFG-parallel (SDXL)", part_p, 60, 150),
)  # fmt: skip


#: torch's own pool of compile workers (inductor), started by part e's in-process compile: torch
#: keeps it for the life of the process and ends it at exit; it is no stage process.
COMPILE_WORKER = "torch/_inductor/compile_worker"


def stage_processes() -> tuple[list[dict[str, Any]], int]:
    """The children of this process left once every engine is closed, and how many of the others
    were torch's compile workers."""
    import psutil

    found, workers = [], 0
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if COMPILE_WORKER in cmdline:
            workers += 1
        else:
            found.append({"pid": p.pid, "cmdline": cmdline[:200]})
    return found, workers


def run(args: argparse.Namespace) -> dict[str, Any]:
    kit = Kit(args)
    chosen = set(args.parts.split(",")) - {""}
    parts = [p for p in PARTS if not chosen or p.key in chosen]
    for part in parts:
        kit.results["parts"][part.key] = {"title": part.title, "status": "pending"}
    kit.results["parts"]["h"] = {"title": "No stage process left after the engines closed", "status": "pending"}
    kit.write()
    # The engines part a needs start now, while this process builds its own pipelines; the dry run
    # also starts part c's (its two cores are idle while the first engines load).
    needed = set().union(*(p.engines for p in parts))
    for name in ("sdxl", "flux", *(() if kit.cuda else ("sdxl_step",))):
        if name in needed:
            kit.start_engine(name)
    try:
        for i, part in enumerate(parts):
            record: dict[str, Any] = kit.results["parts"][part.key]
            need = 1.0 if args.tiny else part.need_s
            if kit.left() < need:
                record.update(status="skipped", reason=f"skipped: budget ({kit.left():.0f} s left, needs {need:.0f})")
            else:
                kit.part_deadline = time.monotonic() + part.cap_s
                start = time.monotonic()
                try:
                    record.update(status="ok", **part.run(kit))
                    if any("error" in row for row in record["rows"]):
                        record["status"] = "partial"
                except Exception as e:
                    record.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                    logger.exception("part %s failed", part.key)
                record["seconds"] = round(time.monotonic() - start, 1)
            later = parts[i + 1 :]
            kit.release(set().union(*(p.engines for p in later)), set().union(*(p.directs for p in later)))
            logger.info("part %s: %s", part.key, record["status"])
            kit.write()
    finally:
        kit.release(set(), set())
        kit._pool.shutdown(wait=True)
        left, workers = stage_processes()
        kit.results["parts"]["h"].update(
            status="ok" if not left else "error",
            rows=[{"leftover_processes": len(left), "processes": left, "torch_compile_workers": workers}],
            notes=[
                "children of the benchmark process (psutil, recursive) once every engine was closed; torch's "
                "inductor compile workers (part e compiles in this process) are counted apart: torch ends them at exit"
            ],
        )
        kit.write()
    return kit.results


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown: the run's facts, then each part's table and notes."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v).replace("|", "/").replace("\n", " ")

    lines = ["# GPU kit results", ""]
    lines += [f"- {k}: {cell(v)}" for k, v in results["meta"].items()]
    for key, part in results["parts"].items():
        lines += ["", f"## {key}. {part['title']}", "", f"status: {part['status']}"]
        if part.get("seconds") is not None:
            lines[-1] += f" ({part['seconds']} s)"
        for field_name in ("reason", "error"):
            if part.get(field_name):
                lines += ["", f"{field_name}: {cell(part[field_name])}"]
        rows = part.get("rows") or []
        columns = list(dict.fromkeys(c for row in rows for c in row))
        if rows:
            lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
        lines += [""] + [f"- {note}" for note in part.get("notes", [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json, results.md, gpu.log and the models")
    ap.add_argument("--tiny", action="store_true", help="tiny configs, sizes and step counts (the CPU dry run)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="the whole run's seconds, model builds included")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--backend",
        choices=("process", "inproc"),
        help="the engines' stage backend; default: process, inproc with --tiny (no stage process to start: "
        "the dry run fits its 20 s on two cores)",
    )
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    ap.add_argument("--parts", default="", help="the parts to run, e.g. a,b (default: all, in order of value)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: by GPU name)")
    args = ap.parse_args()
    args.backend = args.backend or ("inproc" if args.tiny else "process")
    if args.device.startswith("cuda") and args.device == "cuda":
        args.device = "cuda:0"  # a stage's generators and its runtime.devices want one device
    Path(args.out).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.StreamHandler(), logging.FileHandler(Path(args.out) / "gpu.log")],
    )
    results = run(args)
    statuses = {k: p["status"] for k, p in results["parts"].items()}
    print(json.dumps(statuses))
    sys.exit(0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1)


if __name__ == "__main__":
    main()
