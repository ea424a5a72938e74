"""Acceleration options, one run per family and option: wall time per image and its ratio to the
plain pipeline, the deviation from the plain image (max abs difference and PSNR, same seed),
resident weight bytes and peak RSS.

Each (family, option) loads its own DiffusionRunner in a fresh process for its image, weight
bytes and peak RSS (that option's alone); the images are compared in the parent. The times come
from one process per family holding every option's runner, timed in interleaved rounds (plain,
option 1, option 2..., then again) and the fastest round kept: on a shared machine contention
changes over minutes, and only ever adds time. Random-weight models: the deviation says how far
an option moves the output, not what it does to visual quality.

With ``--step-execution``: instead, tiny-flux in step execution, four requests joining a running
batch, each with its own ``cache`` or none (per-request caching): total time, blocks skipped,
deviation from the uncached images.

With ``--compile``: instead, per family, regional ``torch.compile`` (inductor) with the warm-up at
load (``torch_compile: {regional: true, warmup: true}``), each family in a fresh process with an
empty inductor cache: the seconds the load spent compiling, the first request's time after it
(the compile already paid) and the steady time per image beside the uncompiled one.

    python -m benchmarks.acceleration [--steps 20] [--rounds 3] [--json out.json] [--compile | --step-execution]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import REPO, table, write_json

#: A skipping first-block threshold for random weights: their first-block residual changes by
#: far more between steps than a trained model's (diffusers' default 0.05 would never skip).
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "cache first_block 1.0": {"cache": {"type": "first_block", "threshold": 1.0}},
    "cache taylorseer /2": {"cache": {"type": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 2}},
    "cache mag": {"cache": {"type": "mag"}},
    "cache pab": {"cache": {"type": "pab"}},
    "int8wo": {"quantization": {"quant_type": "int8wo"}},
    "float8 storage": {"layerwise_casting": {"storage_dtype": "float8_e4m3fn"}},
    "bfloat16 storage": {"layerwise_casting": {"storage_dtype": "bfloat16"}},
}
#: Per family: the builtin model, the denoiser component, the size, and whether caching applies.
FAMILIES: dict[str, dict[str, Any]] = {
    "flux": {"model": "builtin:tiny-flux", "denoiser": "transformer", "size": 128, "cache": True},
    "sd": {"model": "builtin:small-sd", "denoiser": "unet", "size": 128, "cache": False},
}


#: What ``--compile`` asks for: diffusers' regional compilation, paid at load.
COMPILE = {"regional": True, "warmup": True, "backend": "inductor"}


def runner_for(family: str, option: str, steps: int | None = None) -> Any:
    import msgspec

    from omni_runtime.config import StageConfig
    from omni_runtime.stage.runners.diffusion import DiffusionRunner

    spec = FAMILIES[family]
    engine_args = dict(OPTIONS.get(option, {}))
    if "quantization" in engine_args:
        engine_args["quantization"] = {**engine_args["quantization"], "components": [spec["denoiser"]]}
    defaults: dict[str, Any] = {}
    if option == "compile":
        # The warm-up runs the stage's defaults: the size and step count timed here.
        engine_args = {"torch_compile": COMPILE}
        defaults = {"height": spec["size"], "width": spec["size"], "num_inference_steps": steps}
    stage = msgspec.convert(
        {
            "stage_id": 0,
            "stage_type": "diffusion",
            "model": spec["model"],
            "engine_args": engine_args,
            "default_sampling_params": defaults,
        },
        StageConfig,
    )
    runner = DiffusionRunner(stage)
    runner.load()
    return runner


def generate(runner: Any, family: str, steps: int) -> tuple[np.ndarray, float, float]:
    """One image (seed 3), the wall seconds it took and the CPU seconds this process spent on it."""
    from omni_runtime.params import DiffusionSamplingParams, resolve_params
    from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest

    size = FAMILIES[family]["size"]
    params = {"height": size, "width": size, "num_inference_steps": steps, "output_type": "np", "seed": 3}
    resolved = resolve_params(DiffusionSamplingParams, {}, params)
    request = RunnerRequest(request_id="r", prompt="a lighthouse at dusk", params=resolved)
    start, cpu = time.perf_counter(), time.process_time()
    (output,) = runner.execute([request], ExecuteContext(lambda rid: False))
    assert output.error is None, output.error
    return output.tensors["images"], time.perf_counter() - start, time.process_time() - cpu


def one(family: str, option: str, steps: int, out: str) -> dict[str, Any]:
    """In a fresh process: load, make one image (saved to ``out``); bytes and peak RSS."""
    import torch

    torch.set_num_threads(2)
    runner = runner_for(family, option)
    img, _, _ = generate(runner, family, steps)
    np.save(out, img)
    stats = runner.stats()
    return {
        "weight_bytes": stats["weight_bytes"],
        "denoiser_bytes": stats["weight_bytes_by_component"][FAMILIES[family]["denoiser"]],
        "blocks_skipped": (stats["cache"] or {}).get("hit_rate", 0.0),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def timed(family: str, options: list[str], steps: int, rounds: int) -> dict[str, list[float]]:
    """In one process: every option's runner, warmed up, timed in interleaved rounds; the fastest
    image of each, in wall and in CPU seconds. One torch thread: the CPU time of a process that is
    descheduled does not grow, so it stays comparable on a machine other work keeps busy (two
    threads would add the time one spends spinning while it waits for the other)."""
    import torch

    torch.set_num_threads(1)
    runners = {option: runner_for(family, option) for option in options}
    for option in options:
        generate(runners[option], family, steps)  # warm-up: first-call allocations and kernels
    best = {option: [math.inf, math.inf] for option in options}
    for _ in range(rounds):
        for option in options:
            _, wall, cpu = generate(runners[option], family, steps)
            best[option] = [min(best[option][0], wall), min(best[option][1], cpu)]
    return best


def compiled(family: str, steps: int, rounds: int) -> dict[str, Any]:
    """In one fresh process (an empty inductor cache): the plain runner timed, then the compiled
    one loaded (its compile seconds), its first request and its steady time per image."""
    import torch

    torch.set_num_threads(1)
    plain = runner_for(family, "plain")
    image, _, _ = generate(plain, family, steps)  # warm-up
    plain_s = min(generate(plain, family, steps)[1] for _ in range(rounds))
    start = time.perf_counter()
    runner = runner_for(family, "compile", steps)
    load_s = time.perf_counter() - start
    first, first_s, _ = generate(runner, family, steps)
    compiled_s = min(generate(runner, family, steps)[1] for _ in range(rounds))
    return {
        "family": family,
        "compile_s": runner.stats()["compile_warmup_s"],
        "load_s": load_s,
        "first_request_s": first_s,
        "s_per_image": compiled_s,
        "plain_s_per_image": plain_s,
        "speedup": plain_s / compiled_s,
        "max_abs_diff": float(np.abs(first - image).max()),
    }


def compile_main(args: argparse.Namespace) -> None:
    rows = []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": cache}
            rows.append(_child(["--steps", str(args.steps), "--rounds", str(args.rounds), "--compiled", family], env))
        print(f"{family}: compiled in {rows[-1]['compile_s']:.1f} s", file=sys.stderr)
    columns = ["family", "compile_s", "load_s", "first_request_s", "s_per_image", "plain_s_per_image", "speedup"]
    print(f"regional torch.compile (inductor), warm-up at load, {args.steps} steps, 1 torch thread, cold cache")
    print(table(rows, [*columns, "max_abs_diff"]))
    write_json(args.json, rows)


#: ``--step-execution``: what each of the four requests asks for, per run.
STEP_MIXES: dict[str, list[Any]] = {
    "none cached": ["off"] * 4,
    "half cached": [{"type": "first_block", "threshold": 1.0}, "off"] * 2,
    "all first_block": [{"type": "first_block", "threshold": 1.0}] * 4,
    "all mag": [{"type": "mag"}] * 4,
}


def step_mixes(steps: int, rounds: int) -> list[dict[str, Any]]:
    """tiny-flux in step execution: four requests joining a running batch every few steps, each
    with its own cache setting (or none), driven as the worker drives them; the fastest of
    ``rounds`` per mix, and each request's largest difference from its uncached image."""
    import msgspec
    import torch

    from omni_runtime.config import StageConfig
    from omni_runtime.params import DiffusionSamplingParams, resolve_params
    from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
    from omni_runtime.stage.runners.diffusion import DiffusionRunner

    torch.set_num_threads(1)
    size = FAMILIES["flux"]["size"]
    stage = {"stage_id": 0, "stage_type": "diffusion", "model": "builtin:tiny-flux"}
    runner = DiffusionRunner(msgspec.convert({**stage, "engine_args": {"step_execution": True}}, StageConfig))
    runner.load()
    ctx = ExecuteContext(lambda rid: False)

    def run(mix: list[Any]) -> tuple[float, dict[str, np.ndarray]]:
        params = {"height": size, "width": size, "num_inference_steps": steps, "output_type": "np"}
        requests = [
            RunnerRequest(
                request_id=f"r{i}",
                prompt=f"a lighthouse {i}",
                params=resolve_params(DiffusionSamplingParams, {}, {**params, "seed": i, "cache": c}),
            )
            for i, c in enumerate(mix)
        ]
        running: list[str] = []
        images: dict[str, np.ndarray] = {}
        start = time.perf_counter()
        for i, request in enumerate(requests):  # one joins every steps // 4 steps
            assert not runner.step_admit([request], ctx)
            running.append(request.request_id)
            for _ in range(steps // 4 if i < len(requests) - 1 else 0):
                for rid, result in runner.step_run(list(running), ctx).items():
                    if result.output is not None:
                        images[rid] = result.output.tensors["images"]
                        running.remove(rid)
        while running:
            for rid, result in runner.step_run(list(running), ctx).items():
                if result.output is not None:
                    images[rid] = result.output.tensors["images"]
                    running.remove(rid)
        return time.perf_counter() - start, images

    run(STEP_MIXES["none cached"])  # warm-up
    rows, plain_images = [], run(STEP_MIXES["none cached"])[1]
    for name, mix in STEP_MIXES.items():
        assert runner.cache is not None
        called, ran = runner.cache.blocks_called, runner.cache.blocks_run
        best = math.inf
        for _ in range(rounds):
            wall, images = run(mix)
            best = min(best, wall)
        called, ran = runner.cache.blocks_called - called, runner.cache.blocks_run - ran
        diff = max(float(np.abs(images[k] - plain_images[k]).max()) for k in images)
        rows.append(
            {"mix": name, "s_total": best, "blocks_skipped": 1 - ran / called if called else 0.0, "max_abs_diff": diff}
        )
    for row in rows:
        row["speedup"] = rows[0]["s_total"] / row["s_total"]
    return rows


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _child(args: list[str], env: dict[str, str] | None = None) -> Any:
    cmd = [sys.executable, "-m", "benchmarks.acceleration", *args]
    environ = {**os.environ, **(env or {})}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, env=environ)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{' '.join(args)} failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=3, metavar=("FAMILY", "OPTION", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--timed", metavar="FAMILY", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help="time regional torch.compile paid at load instead")
    ap.add_argument("--compiled", metavar="FAMILY", help=argparse.SUPPRESS)
    ap.add_argument("--step-execution", action="store_true", help="time per-request caching in step execution instead")
    args = ap.parse_args()
    if args.step_execution:
        rows = step_mixes(args.steps, args.rounds)
        print(f"tiny-flux, step execution, 4 requests joining every {args.steps // 4} steps, {args.steps} steps each")
        print(table(rows, ["mix", "s_total", "speedup", "blocks_skipped", "max_abs_diff"]))
        write_json(args.json, rows)
        return
    if args.compiled:
        print(json.dumps(compiled(args.compiled, args.steps, args.rounds)))
        return
    if args.compile:
        compile_main(args)
        return
    if args.one:
        family, option, out = args.one
        print(json.dumps(one(family, option, args.steps, out)))
        return
    if args.timed:
        print(json.dumps(timed(args.timed, options_of(args.timed), args.steps, args.rounds)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            times = _child(["--steps", str(args.steps), "--rounds", str(args.rounds), "--timed", family])
            plain: dict[str, Any] | None = None
            for option in options_of(family):
                out = str(Path(tmp) / f"{family}-{len(rows)}.npy")
                result = _child(["--steps", str(args.steps), "--one", family, option, out])
                img = np.load(out)
                wall, cpu = times[option]
                if plain is None:
                    plain = {**result, "image": img, "s_per_image": wall, "cpu_s_per_image": cpu}
                row = {"family": family, "option": option, "s_per_image": wall, "cpu_s_per_image": cpu, **result}
                row["speedup"] = plain["s_per_image"] / wall
                row["cpu_speedup"] = plain["cpu_s_per_image"] / cpu
                row["weights_ratio"] = result["denoiser_bytes"] / plain["denoiser_bytes"]
                row["max_abs_diff"] = float(np.abs(img - plain["image"]).max())
                row["psnr_db"] = psnr(img, plain["image"])
                rows.append(row)
                print(f"{family} / {option}: {row['s_per_image']:.3f} s/image", file=sys.stderr)
    columns = ["family", "option", "s_per_image", "speedup", "cpu_s_per_image", "cpu_speedup", "max_abs_diff"]
    columns += ["psnr_db", "blocks_skipped"]
    columns += ["denoiser_bytes", "weights_ratio", "weight_bytes", "peak_rss_mb"]
    print(f"{args.steps} steps, fastest of {args.rounds} interleaved rounds after a warm-up, 1 torch thread")
    print(table(rows, columns))
    write_json(args.json, rows)


def options_of(family: str) -> list[str]:
    """The options a family takes: a UNet has no diffusers cache hooks (refused at load)."""
    return [o for o in OPTIONS if FAMILIES[family]["cache"] or not o.startswith("cache")]


if __name__ == "__main__":
    main()
