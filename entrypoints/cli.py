"""``omni-runtime``: the command line. One entry point, argparse subcommands.

``serve`` runs the HTTP server; ``generate`` runs prompts in process; ``validate`` checks a deploy
YAML; ``models`` lists what is bundled; ``rpc`` and ``bench`` talk to a running server.
Every bad argument is a message on stderr and a non-zero exit (2 for usage, 1 for failures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omni_runtime.exceptions import ConfigError, OmniError

from .loadgen import auth_headers


class CliError(Exception):
    """A failure to report as ``error: ...`` with exit code 1."""


# --------------------------------------------------------------------------- argument types


def _int(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise argparse.ArgumentTypeError(f"expected an integer {bounds}, got {value}")
        return value

    return parse


_positive_int = _int(1)


def _float(minimum: float, *, strict: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"expected a number {'>' if strict else '>='} {minimum:g}, got {text}")
        return value

    return parse


def _size(text: str) -> tuple[int, int]:
    from .openai.protocol import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_value(kind: type):
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text[:80]!r}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"expected a JSON {kind.__name__}, got {type(value).__name__}")
        return value

    return parse


def _redis_url(text: str) -> str:
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise argparse.ArgumentTypeError(f"expected a redis://, rediss:// or unix:// URL, got {text!r}")
    return text


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text.rstrip("/")


# --------------------------------------------------------------------------- serve


def _local_url(host: str, port: int) -> str:
    """This server's own address as others reach it: the machine's name for a wildcard bind."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _placement_args(args: argparse.Namespace) -> dict[str, Any]:
    """--device, --dtype and --replicas as engine overrides of the model's (diffusion) stages."""
    return {"devices": args.device, "dtype": args.dtype, "num_replicas": args.replicas}


def _add_step_execution_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step-execution",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="diffusion requests join and leave a running batch between denoising steps",
    )


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="torch device of the model's stages: cpu, cuda, cuda:1 (default: the config's)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="weights' dtype (default: the config's)")
    p.add_argument("--replicas", type=_int(1, 64), help="replicas of the model's stages (default: the config's)")


def _make_server(config: Any, state: Any, shutdown_timeout: float) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn with the runtime's shutdown: drain, then abort what is left, then close the engine.

        1) the first SIGTERM/SIGINT stops accepting and lets in-flight requests finish
        2) after ``shutdown_timeout`` the rest are aborted (their clients get a 503 saying why)
        3) the engine is closed, so no stage process outlives the server
        A second signal skips the wait (in-flight requests are aborted at once), not step 3.
        """

        loop: asyncio.AbstractEventLoop | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises a captured signal after shutdown, which would end the process by
            # the signal's default action (exit status -15) after a clean shutdown; exit 0 instead.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                self.should_exit = True
                return
            self.force_exit = True
            if self.loop is not None:
                self.loop.call_soon_threadsafe(state.abort_all, "the server was stopped before the request finished")

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            # A dead engine cannot come back: drain (its requests have all failed) and exit.
            state.on_dead.append(lambda error: setattr(self, "should_exit", True))
            await super().serve(sockets)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = sockets[0].getsockname()[:2] if sockets else (config.host, config.port)
                logging.getLogger("uvicorn.error").info(
                    "Serving %s on http://%s:%d", ", ".join(state.multi.names), host, port
                )

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            state.draining = True  # new requests on open connections get a 503
            reason = f"the server shut down; the request did not finish within the {shutdown_timeout:g} s grace period"
            timer = asyncio.get_running_loop().call_later(shutdown_timeout, state.abort_all, reason)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()
                await state.close()  # first: a forced exit skips the lifespan shutdown below
                if self.force_exit:
                    await self.lifespan.shutdown()  # ends the app's lifespan task instead of cancelling it

    return Server(config)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from omni_runtime.logs import configure_logging

    from .multi_omni import load_models_file, parse_model_arg
    from .openai.job_manager import JobSettings
    from .openai.server import create_app
    from .openai.timeouts import timed_protocol

    # Before the app imports anything: the runtime's lines at --log-level, the libraries' warnings
    # only at debug; the stage processes get the same level.
    configure_logging(args.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = _server_api_key(args)
    models = [parse_model_arg(m) for m in args.model] + (load_models_file(args.models_file) if args.models_file else [])
    app = create_app(
        models or "tiny-sd",
        api_key=api_key,
        max_pending=args.max_pending,
        default_timeout=args.default_timeout,
        max_loaded_models=args.max_loaded_models,
        max_resident_bytes=args.max_resident_bytes,
        load_timeout=args.load_timeout,
        engine_args={
            "max_num_seqs": args.max_num_seqs,
            "request_batch_max_wait_ms": args.request_batch_max_wait_ms,
            "step_execution": args.step_execution,
            **_placement_args(args),
        },
        ray_address=args.ray_address,
        allowed_origins=args.allowed_origins,
        file_ttl_s=args.file_ttl,
        file_store_bytes=int(args.file_store_mb * 1024 * 1024),
        jobs=JobSettings(
            redis_url=args.redis_url,
            ttl_s=args.job_ttl,
            max_jobs=args.max_jobs,
            lease_s=args.job_lease,
            otlp_endpoint=args.otlp_endpoint,
            max_streams=args.job_streams,
            redis_connections=args.redis_connections,
            redis_timeout_s=args.redis_timeout,
        ),
        public_url=args.public_url,
        local_url=_local_url(args.host, args.port),
    )
    # Bind before the engine starts: a busy port is a clear error, not a model load and a crash.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        lifespan="on",
        # A backstop only: requests still running at shutdown_timeout are aborted by the server.
        timeout_graceful_shutdown=args.shutdown_timeout + 10.0,
        # Slow clients (trickled headers, stalled bodies) are cut off; see openai/timeouts.py.
        http=timed_protocol(args.header_timeout, args.body_timeout),
    )
    state = app.state.omni
    server = _make_server(config, state, args.shutdown_timeout)
    try:
        server.run(sockets=[sock])
    except SystemExit as e:  # uvicorn exits this way when the app fails to start
        if e.code:
            raise CliError("the server failed to start (see the log above)") from None
    finally:
        sock.close()
        state.multi.close()
    if state.dead is not None:
        # Non-zero, so that a supervisor (systemd, Kubernetes) starts a fresh server.
        raise CliError(f"the engine died, so the server stopped: {state.dead}")
    if state.failed is not None:
        raise CliError(f"the engine failed to start, so the server stopped: {state.failed}")
    return 0


# --------------------------------------------------------------------------- generate

#: The file format ``generate`` writes videos in (images are PNG).
VIDEO_FORMAT = "mp4"
#: The file format ``generate`` writes audio clips in.
AUDIO_FORMAT = "wav"


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

    from omni_runtime import encoders
    from omni_runtime.media import items_of

    from .async_omni import AsyncOmni, load_resolved
    from .capabilities import TASK_KIND, ModelCapabilities

    overrides = {"max_num_seqs": args.max_num_seqs, "step_execution": args.step_execution, **_placement_args(args)}
    resolved = load_resolved(args.model, overrides, args.ray_address)
    config = resolved.config
    caps = ModelCapabilities.of(resolved)
    # The first final stage that makes images, videos or audio: what is generated, and its format.
    made = {sid: TASK_KIND[t] for t in ("text2image", "text2video", "text2audio", "text2speech")
            if (sid := caps.stage(t)) is not None}  # fmt: skip
    if not made:
        raise CliError(f"the model {args.model!r} has no image, video or audio output")
    image_stage = min(made)
    kind = made[image_stage]
    if kind != "video" and (args.frames is not None or args.fps is not None):
        raise CliError(f"--frames and --fps are for a video model; {args.model!r} makes {kind}s")
    if kind != "audio" and args.seconds is not None:
        raise CliError(f"--seconds is for an audio model; {args.model!r} makes {kind}s")
    if kind == "audio" and args.size is not None:
        raise CliError(f"--size is for an image or video model; {args.model!r} makes audio")
    suffix = {"video": VIDEO_FORMAT, "audio": AUDIO_FORMAT}.get(kind, "png")
    image: dict[str, Any] = {"num_inference_steps": args.steps, "guidance_scale": args.guidance_scale}
    image.update(num_frames=args.frames, fps=args.fps, audio_end_in_s=args.seconds)
    if args.size is not None:
        image["width"], image["height"] = args.size
    if args.image is not None:
        if kind == "audio":
            raise CliError(f"--image is for an image or video model; {args.model!r} makes audio")
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
    speech_stage = caps.serves("text2speech")
    if not speech_stage and (args.voice is not None or args.speed is not None):
        raise CliError(f"--voice and --speed are for a speech model; {args.model!r} has no speech stage")

    def speech(seed: int | None) -> dict[str, Any]:
        return {"voice": args.voice, "speed": args.speed, "seed": seed} if speech_stage else {}

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
                        async for out in omni.generate(request):
                            if out.progress is not None:
                                if out.progress.stage_id == image_stage and out.progress.step is not None:
                                    step = min(out.progress.step, steps[i])
                                    bar.update(max(0, step - shown))
                                    shown = max(shown, step)
                                continue
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
            files = []
            for j, item in enumerate(items_of(res.media, kind)):
                path = args.out / f"{kind}-{i:03d}{f'-{j}' if j else ''}.{suffix}"
                path.write_bytes(encoders.encode(item, suffix))
                files.append(str(path))
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


# --------------------------------------------------------------------------- worker


def _names(text: str) -> list[str]:
    """A comma-separated list of names (empty items dropped; checked by the worker)."""
    return [n.strip() for n in text.split(",") if n.strip()]


def worker_command(args: argparse.Namespace) -> list[str]:
    """The ``ray start`` that joins this machine to the cluster at ``args.address``, offering the
    custom resources the given configs' ray stages ask for (enough for all of a stage's replicas
    on this node), the models it holds and its tags (``--models``, ``--tags``: a resource each,
    from which those models' replicas are placed), and ``--resources``."""
    from omni_runtime.config import load_config
    from omni_runtime.engine.backends.ray_backend import declared_resources

    offered: dict[str, float] = {}
    for name in args.configs:
        for stage in load_config(name).stage_args:
            if stage.runtime.backend != "ray":
                continue
            for key, amount in stage.runtime.options.resources.items():
                if key not in ("CPU", "GPU"):
                    offered[key] = max(offered.get(key, 0.0), amount * stage.runtime.num_replicas)
    offered.update(declared_resources(args.models, args.tags))
    offered.update(args.resources)
    ray = Path(sys.executable).with_name("ray")
    cmd = [str(ray) if ray.exists() else "ray", "start", "--address", args.address, "--block", "--disable-usage-stats"]
    if args.num_cpus is not None:
        cmd += ["--num-cpus", str(args.num_cpus)]
    if args.num_gpus is not None:
        cmd += ["--num-gpus", str(args.num_gpus)]
    if offered:
        cmd += ["--resources", json.dumps(offered, sort_keys=True)]
    if args.object_store_mb is not None:
        cmd += ["--object-store-memory", str(int(args.object_store_mb * 1024 * 1024))]
    return cmd


def cmd_worker(args: argparse.Namespace) -> int:
    import os

    cmd = worker_command(args)
    print("$ " + " ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    # Become `ray start --block`: the node runs while this process does, and a signal to it (Ctrl-C,
    # SIGTERM from a supervisor) stops the node, whose replicas the engine replaces elsewhere.
    os.execv(cmd[0], cmd) if os.path.isabs(cmd[0]) else os.execvp(cmd[0], cmd)
    return 0  # not reached


# --------------------------------------------------------------------------- validate, models


def cmd_validate(args: argparse.Namespace) -> int:
    import msgspec
    import yaml

    from omni_runtime.config import load_config
    from omni_runtime.resolve import resolve_config

    config = load_config(args.config)
    # Everything the engine would refuse at start-up, all of it at once (a ConfigError lists each).
    resolve_config(config, source=Path(args.config).name if Path(args.config).is_file() else args.config)
    data = msgspec.to_builtins(config)
    for stage in data["stage_args"]:
        stage["runtime"].pop("process", None)  # the older spelling, resolved into `backend`
    print(json.dumps(data, indent=2) if args.format == "json" else yaml.safe_dump(data, sort_keys=False).rstrip())
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from omni_runtime.config import bundled_config_names, load_config
    from omni_runtime.models.builtin import builtin_names

    configs: list[dict[str, Any]] = []
    for name in bundled_config_names():
        try:
            config = load_config(name)
            stages = [s.stage_type + (f"->{s.final_output_type}" if s.final_output else "") for s in config.stage_args]
            configs.append({"name": name, "model": config.model, "stages": stages})
        except ConfigError as e:
            configs.append({"name": name, "error": str(e)})
    builtins = builtin_names()
    if args.json:
        print(json.dumps({"configs": configs, "builtin_models": builtins}, indent=2))
        return 0
    print("Bundled configs (omni-runtime serve NAME):")
    for c in configs:
        print(f"  {c['name']:<18} {c.get('error') or ', '.join(c['stages'])}")
    print("Builtin models (model: builtin:NAME in a deploy YAML):")
    for name in builtins:
        print(f"  {name}")
    return 0


# --------------------------------------------------------------------------- rpc


def cmd_rpc(args: argparse.Namespace) -> int:
    import httpx

    body: dict[str, Any] = {"method": args.method, "args": args.args, "kwargs": args.kwargs}
    if args.stage_ids:
        body["stage_ids"] = args.stage_ids
    if args.timeout is not None:
        body["timeout"] = args.timeout
    try:
        resp = httpx.post(
            f"{args.url}/v1/omni/collective_rpc",
            json=body,
            headers=auth_headers(args.api_key),
            timeout=(args.timeout or 30.0) + 10.0,
        )
    except httpx.HTTPError as e:
        raise CliError(f"cannot reach {args.url}: {e}") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:500]
        raise CliError(f"HTTP {resp.status_code}: {message}")
    results = resp.json()
    print(json.dumps(results, indent=2))
    failed = [r for r in results if not r.get("ok")]
    for r in failed:
        print(f"error: stage {r['stage_id']} replica {r['replica_id']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


# --------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> int:
    from .loadgen import plot_run, print_table, run_http_load, summarize

    if args.endpoint == "images":
        path = "/v1/images/generations"
        payload: dict[str, Any] = {"prompt": args.prompt, "n": args.n}
        if args.size is not None:
            payload["size"] = f"{args.size[0]}x{args.size[1]}"
        if args.steps is not None:
            payload["num_inference_steps"] = args.steps
    else:
        path, payload = "/v1/chat/completions", {"messages": [{"role": "user", "content": args.prompt}]}
    if args.model:
        payload["model"] = args.model
    samples, wall = asyncio.run(
        run_http_load(
            args.url,
            path,
            payload,
            concurrency=args.concurrency,
            total=args.total,
            rate=args.rate,
            api_key=args.api_key,
            timeout=args.timeout,
        )
    )
    summary = summarize(samples, wall, args.n if args.endpoint == "images" else 1)
    if summary["ok"] == 0 and samples and samples[0].error:
        print(f"error: every request failed; first: HTTP {samples[0].status}: {samples[0].error}", file=sys.stderr)
    print_table([(f"{args.endpoint} c={args.concurrency}", summary)])
    if args.json:
        report = {"url": args.url, "endpoint": args.endpoint, "payload": payload, "summary": summary}
        args.json.write_text(json.dumps(report | {"samples": [asdict(s) for s in samples]}, indent=2))
    if args.plot:
        plot_run(samples, args.plot, f"{args.endpoint}: concurrency {args.concurrency}, {args.total} requests")
    return 0 if summary["errors"] == 0 else 1


# --------------------------------------------------------------------------- parser


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Help with each option's default (unless it is none or the help already says it), and
    descriptions and examples as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if "(default" in help or action.default in (None, False, argparse.SUPPRESS):
            return help
        return super()._get_help_string(action)


#: The environment variable ``serve`` (and the client commands) read the key from.
API_KEY_ENV = "OMNI_RUNTIME_API_KEY"


def _server_api_key(args: argparse.Namespace) -> str | None:
    """The key ``serve`` requires: from ``--api-key``, ``--api-key-file`` or ``$OMNI_RUNTIME_API_KEY``
    (the last two keep it out of ``ps``), at most one of them; none: no key required."""
    sources: dict[str, str] = {}
    if args.api_key is not None:
        sources["--api-key"] = args.api_key
    if args.api_key_file is not None:
        try:
            sources["--api-key-file"] = args.api_key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"--api-key-file: cannot read {args.api_key_file}: {e}") from None
    if os.environ.get(API_KEY_ENV):
        sources[f"${API_KEY_ENV}"] = os.environ[API_KEY_ENV]
    if len(sources) > 1:
        raise CliError(f"the API key is given twice ({' and '.join(sources)}); give it one way")
    if not sources:
        return None
    ((where, key),) = sources.items()
    if not key:
        raise CliError(f"{where}: the API key is empty")
    logging.getLogger(__name__).info("requiring an API key on /v1 routes (from %s)", where)
    return key


def _api_key_default() -> str | None:
    # For the client commands only: the key a server was started with, as OpenAI tools read it.
    return os.environ.get(API_KEY_ENV) or os.environ.get("OPENAI_API_KEY")


_RPC_METHODS = """built-in methods:
  ping           {pid, stage_id, replica_id} of each replica
  get_stats      requests served/failed, queue length, running, waves, batch-size histogram
  set_batching   --kwargs '{"max_num_seqs": 8, "request_batch_max_wait_ms": 10}'
  sleep          release the model's memory (requests get 503 until wake_up)
  wake_up        reload the model
  list_loras     LoRA adapters offered by name, loaded (least recently used first), active
  add_lora       --kwargs '{"name": "ink", "path": "/srv/loras/ink", "load": true}' (a path on the server)
  remove_lora    --kwargs '{"name": "ink"}'
  a custom runner's rpc_<name> methods are called by <name>

examples:
  omni-runtime rpc ping
  omni-runtime rpc set_batching --kwargs '{"max_num_seqs": 8}' --stage-ids 0
  omni-runtime rpc get_stats --url http://gpu-box:8000 --api-key "$KEY"
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-runtime",
        description="Serve and run multi-stage generation models (diffusion, text-to-image pipelines).",
        epilog="Run `omni-runtime COMMAND --help` for a command's options and examples.",
        formatter_class=_Help,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, examples: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=summary,
            description=description or summary,
            epilog=f"examples:\n{examples}",
            formatter_class=_Help,
        )

    s = command(
        "serve",
        "run the OpenAI-style HTTP server",
        "  omni-runtime serve                                # tiny-sd on http://127.0.0.1:8000\n"
        "  omni-runtime serve small-sd --port 9000 --max-num-seqs 8\n"
        "  omni-runtime serve ./my-sdxl --device cuda --dtype float16 --replicas 2 --host 0.0.0.0\n"
        '  omni-runtime serve pipeline.yaml --api-key "$KEY" --ray-address head:6379\n'
        "  omni-runtime serve tiny-sd --redis-url redis://127.0.0.1:6379/0   # jobs shared by gateways\n"
        "  omni-runtime serve tiny-sd echo chat=./my-llm.yaml                # three models, routed by `model`",
        "Run the OpenAI-style HTTP server (docs/http_api.md), async jobs included (docs/jobs.md).\n"
        "It answers at once: /health is 503 `loading` until the models are loaded, then 200. SIGTERM\n"
        "drains, then exits 0; a dead engine makes it exit 1.",
    )
    s.add_argument(
        "model",
        nargs="*",
        help="bundled config name, deploy YAML or model dir (default: tiny-sd); several are served side by side, "
        "each under its config's name or as NAME=CONFIG; a trailing @lazy loads one on its first request, "
        "@stop makes the budget stop it rather than put it to sleep",
    )
    s.add_argument(
        "--models-file",
        metavar="YAML",
        help="more models to serve: NAME: CONFIG, or NAME: {config: CONFIG, max_pending: N, lazy: true, "
        "evict: sleep|stop}, one per line",
    )
    s.add_argument(
        "--max-loaded-models",
        type=_positive_int,
        help="most models loaded at once: past it the least recently used idle one is evicted",
    )
    s.add_argument(
        "--max-resident-bytes",
        type=_positive_int,
        help="most weight bytes resident at once (as the runners report them), evicting as above",
    )
    s.add_argument(
        "--load-timeout",
        type=_float(0, strict=True),
        default=300.0,
        help="seconds a request waits for its model to load or wake up (then 503)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=_int(1, 65535), default=8000, help="port to listen on")
    s.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every /v1 route (shown by ps: prefer ${API_KEY_ENV} "
        "or --api-key-file)",
    )
    s.add_argument(
        "--api-key-file",
        type=Path,
        metavar="PATH",
        help="the key as the text of this file (surrounding whitespace dropped)",
    )
    s.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN", help="allow browsers from these origins (CORS)")
    s.add_argument("--max-num-seqs", type=_positive_int, help="most requests fused into one forward")
    s.add_argument("--request-batch-max-wait-ms", type=_float(0), help="extra admission wait for a wave (ms)")
    _add_step_execution_arg(s)
    _add_placement_args(s)
    s.add_argument("--ray-address", help="Ray cluster of the config's ray stages (auto, HOST:PORT, or local)")
    s.add_argument("--max-pending", type=_positive_int, help="most requests admitted at once (then 429)")
    s.add_argument("--default-timeout", type=_float(0, strict=True), help="deadline (s) of a request without one")
    s.add_argument("--shutdown-timeout", type=_float(0), default=30.0, help="grace period (s) on SIGTERM")
    s.add_argument("--header-timeout", type=_float(0, strict=True), default=10.0, help="time (s) to send headers")
    s.add_argument("--body-timeout", type=_float(0, strict=True), default=60.0, help="time (s) to send a body")
    s.add_argument("--file-ttl", type=_float(0, strict=True), default=600.0, help="life (s) of response_format=url")
    s.add_argument(
        "--public-url", type=_url, help="base of result URLs, e.g. https://api.example (default: the request's Host)"
    )
    s.add_argument("--file-store-mb", type=_float(0, strict=True), default=256.0, help="memory for url images")
    s.add_argument("--redis-url", type=_redis_url, help="share /v1/generate jobs through Redis (redis://HOST:PORT/DB)")
    s.add_argument("--job-ttl", type=_float(0, strict=True), default=3600.0, help="life (s) of a finished job")
    s.add_argument("--max-jobs", type=_positive_int, default=10_000, help="jobs the in-memory store holds")
    s.add_argument(
        "--job-lease",
        type=_float(0.3),
        default=10.0,
        help="(s) a gateway may miss heartbeats before its jobs are recovered (Redis)",
    )
    s.add_argument(
        "--job-streams",
        type=_positive_int,
        default=256,
        help="clients that may wait on job events at once (SSE, WebSocket, async_run=false); then 503",
    )
    s.add_argument(
        "--redis-connections", type=_positive_int, default=16, help="connections of each Redis pool (reads; writes)"
    )
    s.add_argument(
        "--redis-timeout", type=_float(0.1), default=2.0, help="timeout (s) of every Redis call (connect, read, pool)"
    )
    s.add_argument("--otlp-endpoint", type=_url, help="export job traces over OTLP/HTTP (http://HOST:4318)")
    s.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level",
    )
    s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False, help="log every request")
    s.set_defaults(func=cmd_serve)

    g = command(
        "generate",
        "generate images, videos or audio in process and write PNG, MP4 or WAV files and a report",
        '  omni-runtime generate "a lighthouse at dusk"\n'
        '  omni-runtime generate "a fox" "a cat" -n 4 --seed 42 --steps 8 --size 64x64 --out out/\n'
        '  omni-runtime generate "a boat" --model ./my-sdxl --device cuda --dtype float16\n'
        '  omni-runtime generate "a boat sets sail" --model tiny-wan --image first.png --frames 5\n'
        '  omni-runtime generate "rain on a tin roof" --model tiny-stable-audio --seconds 1.5\n'
        '  omni-runtime generate "hello there" --model tiny-tts --voice alloy --speed 1.2',
    )
    g.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    g.add_argument("-n", type=_positive_int, default=1, help="images per prompt (one request each)")
    g.add_argument("--out", type=Path, default=Path("outputs"), help="output folder")
    g.add_argument("--model", default="tiny-sd", help="bundled config name, deploy YAML or model dir")
    g.add_argument("--seed", type=int, help="seed of the first image; image i gets seed + i (default: random)")
    g.add_argument("--steps", type=_positive_int, help="num_inference_steps (default: the model's)")
    g.add_argument("--size", type=_size, help="WIDTHxHEIGHT (default: the model's)")
    g.add_argument("--frames", type=_positive_int, help="frames of each video (a video model; default: the model's)")
    g.add_argument("--fps", type=_int(1, 240), help="frames per second a video plays at (default: the model's)")
    g.add_argument(
        "--seconds", type=_float(0, strict=True), help="length of each clip (an audio model; default: the model's)"
    )
    g.add_argument(
        "--image",
        type=Path,
        help="an input image: a video model's first frame (image to video), an image model's source; "
        "the output takes its size",
    )
    g.add_argument("--guidance-scale", type=_float(0), help="classifier-free guidance (default: the model's)")
    g.add_argument("--voice", help="a speech model's speaker, or an OpenAI voice name (default: its first speaker)")
    g.add_argument("--speed", type=_float(0, strict=True), help="how fast a speech model speaks (0.25-4, default 1)")
    g.add_argument("--lora", metavar="PATH_OR_NAME", help="a LoRA adapter: a local folder/file, or a registered name")
    g.add_argument("--lora-scale", type=float, default=1.0, help="how strongly the LoRA applies")
    g.add_argument("--max-num-seqs", type=_positive_int, help="most requests fused into one forward")
    _add_step_execution_arg(g)
    _add_placement_args(g)
    g.add_argument("--ray-address", help="Ray cluster of the config's ray stages (auto, HOST:PORT, or local)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)

    v = command(
        "validate",
        "check a deploy YAML and print the resolved config",
        "  omni-runtime validate my-pipeline.yaml\n  omni-runtime validate tiny-omni --format json",
        "Check a deploy YAML as the engine does at start-up (keys, types, ranges, runners, input\n"
        "functions, models) and print it with every default filled in; report every mistake at once.",
    )
    v.add_argument("config", help="deploy YAML path or bundled config name")
    v.add_argument("--format", choices=["yaml", "json"], default="yaml", help="output format")
    v.set_defaults(func=cmd_validate)

    w = command(
        "worker",
        "join this machine to a Ray cluster as a node for ray stages",
        "  omni-runtime worker --address head:6379 my-pipeline.yaml --num-gpus 1\n"
        "  omni-runtime worker --address head:6379 --resources '{\"sdxl_box\": 2}' --dry-run\n"
        "  omni-runtime worker --address head:6379 --models sdxl,flux --tags a100",
        "Run `ray start --address ADDRESS --block` with the node resources the given deploy configs'\n"
        "ray stages ask for (a custom resource that pins a stage to this kind of machine, say), and\n"
        "the models it holds: once any node declares models, a model's replicas run only on nodes\n"
        "that declare it. The node lives as long as this command; see docs/distributed.md.",
    )
    w.add_argument("--address", required=True, help="the Ray head, HOST:PORT")
    w.add_argument(
        "configs", nargs="*", metavar="CONFIG", help="deploy YAMLs or bundled names whose resources to offer"
    )
    w.add_argument("--num-cpus", type=_int(0), help="CPUs this node offers (default: all)")
    w.add_argument("--num-gpus", type=_int(0), help="GPUs this node offers (default: all)")
    w.add_argument("--resources", type=_json_value(dict), default={}, help="more custom resources, JSON")
    w.add_argument(
        "--models", type=_names, default=[], help="served model names this node holds, comma-separated (sdxl,flux)"
    )
    w.add_argument("--tags", type=_names, default=[], help="tags a stage's runtime.tags may ask for (a100,fast)")
    w.add_argument("--object-store-mb", type=_float(0, strict=True), help="object store size (MiB)")
    w.add_argument("--dry-run", action="store_true", help="print the ray start command and exit")
    w.set_defaults(func=cmd_worker)

    m = command(
        "models",
        "list bundled configs and builtin models",
        "  omni-runtime models\n  omni-runtime models --json | jq '.configs[].name'",
    )
    m.add_argument("--json", action="store_true", help="print JSON")
    m.set_defaults(func=cmd_models)

    r = command("rpc", "run a control call on a running server's stage replicas", "", "")
    r.description = "Run a control call on every replica of a running server's stages; print JSON."
    r.epilog = _RPC_METHODS
    r.add_argument("method", help="a built-in method (below) or a custom runner's")
    r.add_argument("--url", type=_url, default="http://127.0.0.1:8000", help="the server")
    r.add_argument("--args", type=_json_value(list), default=[], help="JSON list of positional args")
    r.add_argument("--kwargs", type=_json_value(dict), default={}, help="JSON object of keyword args")
    r.add_argument("--stage-ids", type=int, nargs="+", help="stages to call (default: all)")
    r.add_argument("--timeout", type=_float(0, strict=True), help="per-replica timeout (s) (default: 30)")
    r.add_argument(
        "--api-key",
        default=_api_key_default(),
        help="the server's key (default: $OMNI_RUNTIME_API_KEY or $OPENAI_API_KEY)",
    )
    r.set_defaults(func=cmd_rpc)

    b = command(
        "bench",
        "HTTP load generator against a running server",
        "  omni-runtime bench --concurrency 16 --total 64\n"
        "  omni-runtime bench --endpoint chat --rate 5 --total 200 --json run.json --plot run.png",
    )
    b.add_argument("--url", type=_url, default="http://127.0.0.1:8000", help="the server")
    b.add_argument("--endpoint", choices=["images", "chat"], default="images", help="which route to load")
    b.add_argument("--concurrency", type=_positive_int, default=16, help="requests in flight (closed loop)")
    b.add_argument("--total", type=_positive_int, default=64, help="requests in all")
    b.add_argument("--rate", type=_float(0, strict=True), help="Poisson arrivals per second (default: closed loop)")
    b.add_argument("--prompt", default="a red fox in the snow", help="the prompt of every request")
    b.add_argument("-n", type=_positive_int, default=1, help="images per request")
    b.add_argument("--size", type=_size, help="WIDTHxHEIGHT (default: the model's)")
    b.add_argument("--steps", type=_positive_int, help="num_inference_steps (default: the model's)")
    b.add_argument("--model", help="model name to send (default: none)")
    b.add_argument(
        "--api-key",
        default=_api_key_default(),
        help="the server's key (default: $OMNI_RUNTIME_API_KEY or $OPENAI_API_KEY)",
    )
    b.add_argument("--timeout", type=_float(0, strict=True), default=600.0, help="per-request timeout (s)")
    b.add_argument("--json", type=Path, help="write the summary and every sample here")
    b.add_argument("--plot", type=Path, help="write latency-over-time and throughput charts (PNG)")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ConfigError, OmniError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`omni-runtime models --json | head`): nothing more to say.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
