"""The argument parser: one subcommand per command, each with its options, defaults and examples."""

from __future__ import annotations

import argparse
from pathlib import Path

from .args import (
    API_KEY_ENV,
    Help,
    add_placement_args,
    add_step_execution_arg,
    api_key_default,
    integer,
    json_of,
    names,
    number,
    positive_int,
    redis_url,
    size,
    url,
)
from .commands import cmd_bench, cmd_models, cmd_rpc, cmd_validate, cmd_worker
from .generate import cmd_generate
from .serve import cmd_serve

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
        formatter_class=Help,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, examples: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=summary,
            description=description or summary,
            epilog=f"examples:\n{examples}",
            formatter_class=Help,
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
        type=positive_int,
        help="most models loaded at once: past it the least recently used idle one is evicted",
    )
    s.add_argument(
        "--max-resident-bytes",
        type=positive_int,
        help="most weight bytes resident at once (as the runners report them), evicting as above",
    )
    s.add_argument(
        "--load-timeout",
        type=number(0, strict=True),
        default=300.0,
        help="seconds a request waits for its model to load or wake up (then 503)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=integer(1, 65535), default=8000, help="port to listen on")
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
    s.add_argument("--max-num-seqs", type=positive_int, help="most requests fused into one forward")
    s.add_argument("--request-batch-max-wait-ms", type=number(0), help="extra admission wait for a wave (ms)")
    add_step_execution_arg(s)
    add_placement_args(s)
    s.add_argument("--ray-address", help="Ray cluster of the config's ray stages (auto, HOST:PORT, or local)")
    s.add_argument("--max-pending", type=positive_int, help="most requests admitted at once (then 429)")
    s.add_argument("--default-timeout", type=number(0, strict=True), help="deadline (s) of a request without one")
    s.add_argument("--shutdown-timeout", type=number(0), default=30.0, help="grace period (s) on SIGTERM")
    s.add_argument("--header-timeout", type=number(0, strict=True), default=10.0, help="time (s) to send headers")
    s.add_argument("--body-timeout", type=number(0, strict=True), default=60.0, help="time (s) to send a body")
    s.add_argument("--file-ttl", type=number(0, strict=True), default=600.0, help="life (s) of response_format=url")
    s.add_argument(
        "--public-url", type=url, help="base of result URLs, e.g. https://api.example (default: the request's Host)"
    )
    s.add_argument("--file-store-mb", type=number(0, strict=True), default=256.0, help="memory for url images")
    s.add_argument("--redis-url", type=redis_url, help="share /v1/generate jobs through Redis (redis://HOST:PORT/DB)")
    s.add_argument("--job-ttl", type=number(0, strict=True), default=3600.0, help="life (s) of a finished job")
    s.add_argument("--max-jobs", type=positive_int, default=10_000, help="jobs the in-memory store holds")
    s.add_argument(
        "--job-lease",
        type=number(0.3),
        default=10.0,
        help="(s) a gateway may miss heartbeats before its jobs are recovered (Redis)",
    )
    s.add_argument(
        "--job-streams",
        type=positive_int,
        default=256,
        help="clients that may wait on job events at once (SSE, WebSocket, async_run=false); then 503",
    )
    s.add_argument(
        "--realtime-sessions",
        type=positive_int,
        default=16,
        help="realtime sessions (WS /v1/realtime) open at once; then refused (close code 4503)",
    )
    s.add_argument(
        "--realtime-idle-timeout",
        type=number(1.0),
        default=300.0,
        help="(s) a realtime session without a client message, while no response runs, is closed",
    )
    s.add_argument(
        "--redis-connections", type=positive_int, default=16, help="connections of each Redis pool (reads; writes)"
    )
    s.add_argument(
        "--redis-timeout", type=number(0.1), default=2.0, help="timeout (s) of every Redis call (connect, read, pool)"
    )
    s.add_argument("--otlp-endpoint", type=url, help="export job traces over OTLP/HTTP (http://HOST:4318)")
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
    g.add_argument("-n", type=positive_int, default=1, help="images per prompt (one request each)")
    g.add_argument("--out", type=Path, default=Path("outputs"), help="output folder")
    g.add_argument("--model", default="tiny-sd", help="bundled config name, deploy YAML or model dir")
    g.add_argument("--seed", type=int, help="seed of the first image; image i gets seed + i (default: random)")
    g.add_argument("--steps", type=positive_int, help="num_inference_steps (default: the model's)")
    g.add_argument("--size", type=size, help="WIDTHxHEIGHT (default: the model's)")
    g.add_argument("--frames", type=positive_int, help="frames of each video (a video model; default: the model's)")
    g.add_argument("--fps", type=integer(1, 240), help="frames per second a video plays at (default: the model's)")
    g.add_argument(
        "--seconds", type=number(0, strict=True), help="length of each clip (an audio model; default: the model's)"
    )
    g.add_argument(
        "--image",
        type=Path,
        help="an input image: a video model's first frame (image to video), an image model's source; "
        "the output takes its size",
    )
    g.add_argument("--guidance-scale", type=number(0), help="classifier-free guidance (default: the model's)")
    g.add_argument("--voice", help="a speech model's speaker, or an OpenAI voice name (default: its first speaker)")
    g.add_argument("--speed", type=number(0, strict=True), help="how fast a speech model speaks (0.25-4, default 1)")
    g.add_argument("--lora", metavar="PATH_OR_NAME", help="a LoRA adapter: a local folder/file, or a registered name")
    g.add_argument("--lora-scale", type=float, default=1.0, help="how strongly the LoRA applies")
    g.add_argument("--max-num-seqs", type=positive_int, help="most requests fused into one forward")
    add_step_execution_arg(g)
    add_placement_args(g)
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
    w.add_argument("--num-cpus", type=integer(0), help="CPUs this node offers (default: all)")
    w.add_argument("--num-gpus", type=integer(0), help="GPUs this node offers (default: all)")
    w.add_argument("--resources", type=json_of(dict), default={}, help="more custom resources, JSON")
    w.add_argument(
        "--models", type=names, default=[], help="served model names this node holds, comma-separated (sdxl,flux)"
    )
    w.add_argument("--tags", type=names, default=[], help="tags a stage's runtime.tags may ask for (a100,fast)")
    w.add_argument("--object-store-mb", type=number(0, strict=True), help="object store size (MiB)")
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
    r.add_argument("--url", type=url, default="http://127.0.0.1:8000", help="the server")
    r.add_argument("--args", type=json_of(list), default=[], help="JSON list of positional args")
    r.add_argument("--kwargs", type=json_of(dict), default={}, help="JSON object of keyword args")
    r.add_argument("--stage-ids", type=int, nargs="+", help="stages to call (default: all)")
    r.add_argument("--timeout", type=number(0, strict=True), help="per-replica timeout (s) (default: 30)")
    r.add_argument(
        "--api-key",
        default=api_key_default(),
        help="the server's key (default: $OMNI_RUNTIME_API_KEY or $OPENAI_API_KEY)",
    )
    r.set_defaults(func=cmd_rpc)

    b = command(
        "bench",
        "HTTP load generator against a running server",
        "  omni-runtime bench --concurrency 16 --total 64\n"
        "  omni-runtime bench --endpoint chat --rate 5 --total 200 --json run.json --plot run.png",
    )
    b.add_argument("--url", type=url, default="http://127.0.0.1:8000", help="the server")
    b.add_argument("--endpoint", choices=["images", "chat"], default="images", help="which route to load")
    b.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight (closed loop)")
    b.add_argument("--total", type=positive_int, default=64, help="requests in all")
    b.add_argument("--rate", type=number(0, strict=True), help="Poisson arrivals per second (default: closed loop)")
    b.add_argument("--prompt", default="a red fox in the snow", help="the prompt of every request")
    b.add_argument("-n", type=positive_int, default=1, help="images per request")
    b.add_argument("--size", type=size, help="WIDTHxHEIGHT (default: the model's)")
    b.add_argument("--steps", type=positive_int, help="num_inference_steps (default: the model's)")
    b.add_argument("--model", help="model name to send (default: none)")
    b.add_argument(
        "--api-key",
        default=api_key_default(),
        help="the server's key (default: $OMNI_RUNTIME_API_KEY or $OPENAI_API_KEY)",
    )
    b.add_argument("--timeout", type=number(0, strict=True), default=600.0, help="per-request timeout (s)")
    b.add_argument("--json", type=Path, help="write the summary and every sample here")
    b.add_argument("--plot", type=Path, help="write latency-over-time and throughput charts (PNG)")
    b.set_defaults(func=cmd_bench)
    return p
