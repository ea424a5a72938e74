"""``omni-runtime``: the command line. One entry point, argparse subcommands.

``serve`` runs the HTTP server; ``generate`` runs prompts in process; ``validate`` checks a deploy
YAML; ``models`` lists what is bundled; ``worker`` joins a Ray cluster; ``rpc`` and ``bench`` talk
to a running server. Every bad argument is a message on stderr and a non-zero exit (2 for usage,
1 for failures). The parser is ``parser.py``, each command in its module (``serve.py``,
``generate.py``, ``commands.py``), what they share in ``args.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from omni_runtime.exceptions import ConfigError, OmniError

from .args import CliError
from .commands import worker_command
from .parser import build_parser

__all__ = ["CliError", "build_parser", "main", "worker_command"]


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
