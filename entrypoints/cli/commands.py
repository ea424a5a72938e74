"""The commands other than ``serve`` and ``generate``: ``worker`` (joins a Ray cluster),
``validate`` and ``models`` (configs), ``rpc`` and ``bench`` (against a running server)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omni_runtime.exceptions import ConfigError

from ..loadgen import auth_headers, plot_run, print_table, run_http_load, summarize
from .args import CliError


def worker_command(args: argparse.Namespace) -> list[str]:
    """The ``ray start`` that joins this machine to the cluster at ``args.address``, offering the
    custom resources the given configs' ray stages ask for (enough for all of a stage's replicas
    on this node), the models it holds and its tags (``--models``, ``--tags``: a resource each,
    from which those models' replicas are placed), and ``--resources``."""
    # lazy: imports numpy and yaml (the config; not at the CLI's start)
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


def cmd_validate(args: argparse.Namespace) -> int:
    import msgspec
    import yaml

    # lazy: imports numpy and yaml (the config; not at the CLI's start)
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
    # lazy: imports numpy and yaml (the config; not at the CLI's start)
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


def cmd_bench(args: argparse.Namespace) -> int:
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
