"""What a child process of the runtime gets from its parent: its import path, and a life tied
to the parent's. The stage processes, the launcher and the ranks of a parallel group each die
when the thread that started them ends (``PR_SET_PDEATHSIG``), even if their parent is SIGKILLed
and can clean nothing up."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it exits (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def child_env() -> dict[str, str]:
    """A child's environment: this one, with this process's import path, so custom runner
    modules resolve in the child as they do here."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    return env
