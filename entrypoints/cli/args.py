"""What the commands share: the argument types argparse checks values with (a bad one is a
message and exit 2), the help layout, the option groups several commands take, the API key's
environment variable, and :class:`CliError` (a failure: ``error: ...`` and exit 1)."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any


class CliError(Exception):
    """A failure to report as ``error: ...`` with exit code 1."""


# --------------------------------------------------------------------------- argument types


def integer(minimum: int, maximum: int | None = None):
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


positive_int = integer(1)


def number(minimum: float, *, strict: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"expected a number {'>' if strict else '>='} {minimum:g}, got {text}")
        return value

    return parse


def size(text: str) -> tuple[int, int]:
    from ..openai.protocol import parse_size  # lazy: imports FastAPI and pydantic (not at the CLI's start)

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def json_of(kind: type):
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text[:80]!r}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"expected a JSON {kind.__name__}, got {type(value).__name__}")
        return value

    return parse


def redis_url(text: str) -> str:
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise argparse.ArgumentTypeError(f"expected a redis://, rediss:// or unix:// URL, got {text!r}")
    return text


def url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text.rstrip("/")


def names(text: str) -> list[str]:
    """A comma-separated list of names (empty items dropped; checked by the worker)."""
    return [n.strip() for n in text.split(",") if n.strip()]


def placement_args(args: argparse.Namespace) -> dict[str, Any]:
    """--device, --dtype and --replicas as engine overrides of the model's (diffusion) stages."""
    return {"devices": args.device, "dtype": args.dtype, "num_replicas": args.replicas}


def add_step_execution_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step-execution",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="diffusion requests join and leave a running batch between denoising steps",
    )


def add_placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="torch device of the model's stages: cpu, cuda, cuda:1 (default: the config's)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="weights' dtype (default: the config's)")
    p.add_argument("--replicas", type=integer(1, 64), help="replicas of the model's stages (default: the config's)")


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Help with each option's default (unless it is none or the help already says it), and
    descriptions and examples as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if "(default" in help or action.default in (None, False, argparse.SUPPRESS):
            return help
        return super()._get_help_string(action)


#: The environment variable ``serve`` (and the client commands) read the key from.
API_KEY_ENV = "OMNI_RUNTIME_API_KEY"


def api_key_default() -> str | None:
    # For the client commands only: the key a server was started with, as OpenAI tools read it.
    return os.environ.get(API_KEY_ENV) or os.environ.get("OPENAI_API_KEY")
