"""``omni-runtime generate``: prompts run in process, each result written as files by its task's
renderer (the task registry: entrypoints/tasks/), with a JSON report of what each ran with."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_runtime.exceptions import OmniError

from .args import CliError, placement_args

if TYPE_CHECKING:
    from ..capabilities import ModelCapabilities
    from ..tasks import Task

#: The task table (entrypoints/tasks/fields.py) of this command's options.
SURFACE = "cli"


def _read_image(path: Path) -> Any:
    """An input image file as the uint8 RGB array the engine takes; CliError if it is none."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB"))
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
        raise CliError(f"--image {path}: not an image this can read ({e})") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    # lazy: imports numpy (media items; not at the CLI's start)
    from omni_runtime.events import Final, Progress

    # lazy: imports janus and numpy (the engine; not at the CLI's start)
    from ..async_omni import AsyncOmni, load_resolved
    from ..capabilities import ModelCapabilities
    from ..tasks import TASKS, MediaRenderer

    overrides = {"max_num_seqs": args.max_num_seqs, "step_execution": args.step_execution, **placement_args(args)}
    resolved = load_resolved(args.model, overrides, args.ray_address)
    config = resolved.config
    caps = ModelCapabilities.of(resolved)
    task = _task(caps, args.model)
    image_stage = caps.stage(task.name)
    kind, suffix, renderer = task.kind, task.format, task.renderer
    assert image_stage is not None and isinstance(renderer, MediaRenderer)  # _task picks a served media task
    if kind != "video" and (args.frames is not None or args.fps is not None):
        raise CliError(f"--frames and --fps are for a video model; {args.model!r} makes {kind}s")
    if kind != "audio" and args.seconds is not None:
        raise CliError(f"--seconds is for an audio model; {args.model!r} makes {kind}s")
    if kind == "audio" and args.size is not None:
        raise CliError(f"--size is for an image or video model; {args.model!r} makes audio")
    # Every stage that takes image params gets these (a speech model has none).
    image = TASKS["text2image"].fields[SURFACE].params(args)
    if args.image is not None:
        if not any(t.needs_image and t.kind == kind for t in TASKS.values()):
            raise CliError(f"--image is for an image or video model; {args.model!r} makes {kind}")
        image["image"] = _read_image(args.image)

    def shown(params: dict[str, Any]) -> dict[str, Any]:
        """Params as the report gives them: the input image as its path."""
        return {k: str(args.image) if k == "image" else v for k, v in params.items() if v is not None}

    if args.lora is not None:
        # An existing file or folder is a path (this process loads it); anything else a name.
        where = Path(args.lora).expanduser()
        spec = {"path": str(where.resolve())} if where.exists() else {"name": args.lora}
        image["lora"] = {**spec, "scale": args.lora_scale}
    # A speech stage takes no image params: its voice, speed and seed are its own.
    # A stage whose params are a speech stage's (``speech``, ``omni_code2wav``) takes them.
    speaker = TASKS["text2speech"]
    speech_stage = caps.serves(speaker.name)
    if not speech_stage and (args.voice is not None or args.speed is not None):
        raise CliError(f"--voice and --speed are for a speech model; {args.model!r} has no speech stage")

    def speech(seed: int | None) -> dict[str, Any]:
        return {**speaker.fields[SURFACE].params(args), "seed": seed} if speech_stage else {}

    # (prompt, seed) for every image: each is its own request, so they batch together
    jobs: list[tuple[str, int | None]] = []
    for prompt in args.prompts:
        jobs.extend((prompt, None if args.seed is None else args.seed + i) for i in range(args.n))
    say = (lambda *_: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    results: list[Any] = [None] * len(jobs)  # filled as requests end: a Ctrl-C reports what is done
    used: list[dict[str, Any]] = [{} for _ in jobs]

    async def run() -> float:
        say(f"loading {config.model or args.model} ({len(config.stage_args)} stage(s))...")
        started = time.perf_counter()
        async with AsyncOmni(resolved) as omni:
            say(f"loaded in {time.perf_counter() - started:.1f} s; generating {len(jobs)} {kind}(s)")
            # Every stage that takes image params gets them (in a split pipeline the denoiser owns
            # seed and size, the encoder the negative prompt); each request is validated once,
            # all before the first runs, and the report says what each really ran with.
            requests = [
                omni.validate(
                    p, omni.sampling_params(image={**image, "seed": seed}, shared=speech(seed)), modalities=[kind]
                )
                for p, seed in jobs
            ]
            for i, request in enumerate(requests):
                used[i] = shown(request.params.get(image_stage, {}))
            # The bar counts denoising steps of every image, so it moves while images are drawn
            # (the stages report progress a few times a second), not only when one is done.
            steps = [int(u.get("num_inference_steps") or 1) for u in used]
            bar = tqdm(total=sum(steps), desc="generate", unit="step", disable=args.quiet)
            # More images than the engine admits at once are submitted as earlier ones finish.
            slots = asyncio.Semaphore(omni.health().max_pending)

            async def one(i: int, request: Any) -> None:
                shown = 0  # steps of this image already on the bar
                try:
                    async with slots:
                        async for event in omni.events(request):
                            match event:
                                case Progress(stage=sid, step=step) if sid == image_stage:
                                    step = min(step, steps[i])
                                    bar.update(max(0, step - shown))
                                    shown = max(shown, step)
                                case Final(output=out):
                                    results[i] = out
                except OmniError as e:
                    results[i] = e
                finally:
                    bar.update(steps[i] - shown)

            start = time.perf_counter()
            try:
                await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
            finally:
                bar.close()
            return time.perf_counter() - start

    interrupted = False
    wall = 0.0
    started = time.perf_counter()
    try:
        wall = asyncio.run(run())
    except KeyboardInterrupt:
        # Cancelling aborts every request still running; what finished is written below.
        interrupted, wall = True, time.perf_counter() - started
        print("interrupted: writing what finished", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    records, images = [], 0
    for i, ((prompt, _), res) in enumerate(zip(jobs, results, strict=True)):
        record: dict[str, Any] = {"index": i, "prompt": prompt, "params": used[i]}
        if res is None or (not isinstance(res, Exception) and not res.finished):
            record["error"] = "not finished (interrupted)"
        elif isinstance(res, Exception):
            record["error"] = f"{type(res).__name__}: {res}"
        else:
            seed = res.outputs_by_stage[image_stage].metrics.get("seed")
            files = renderer.write(renderer.items(res.media), args.out, f"{kind}-{i:03d}", suffix)
            images += len(files)
            record.update(request_id=res.request_id, seed=seed, files=files, metrics=res.metrics)
        records.append(record)
    report = {
        "model": config.model,
        "params": shown(image),
        "requests": len(jobs),
        kind + "s": images,
        "failed": sum("error" in r for r in records),
        "interrupted": interrupted,
        "wall_s": round(wall, 4),
        kind + "s_per_s": round(images / wall, 3) if wall > 0 else None,
        "results": records,
    }
    report_path = args.out / "report.json"
    report_path.write_text(json.dumps(report, indent=2, default=str))
    print(f"{images} {kind}(s) in {wall:.2f} s -> {args.out}/ (report: {report_path})")
    for r in records:
        if "error" in r and not interrupted:
            print(f"error: request {r['index']} ({r['prompt'][:40]!r}): {r['error']}", file=sys.stderr)
    if interrupted:
        return 130
    return 1 if report["failed"] else 0


def _task(caps: ModelCapabilities, model: str) -> Task:
    """What ``generate`` makes: the registry's task (of those that need no input image) served by
    the model's first final stage that makes images, videos or audio; it names the file format."""
    from ..tasks import TASKS  # lazy: imports numpy (not at the CLI's start)

    made = [t for t in TASKS.values() if t.job and not t.needs_image and caps.stage(t.name) is not None]
    if not made:
        raise CliError(f"the model {model!r} has no image, video or audio output")
    return min(made, key=lambda t: caps.stages[t.name])
