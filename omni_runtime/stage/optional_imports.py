"""Optional libraries that a replica's process imports only when its stages ask for them.

transformers and diffusers import torchao as they are imported whenever it is installed (their
quantizer modules do, at module level), whether or not anything is quantized: about 0.2 s of every
stage's start-up, and a page of warnings about kernels it cannot load (triton, mxfp8, cutlass) and
torch deprecations. A process the runtime owns (a stage process, the stage launcher, a Ray actor)
calls :func:`keep_out_unrequested` before those libraries are imported: unless one of its stages
sets ``engine_args.quantization``, torchao is marked absent with ``sys.modules["torchao"] = None``,
the import system's own "not installed" (``import torchao`` raises ImportError and
``importlib.util.find_spec`` answers None, which is how both libraries check). A caller's own
process (the inproc backend) is never changed: what its libraries import is the caller's business.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from omni_runtime.config import StageConfig

#: Imported only by a process with a stage that quantizes (``engine_args.quantization``).
TORCHAO = "torchao"
#: The libraries whose import decides whether torchao is imported with them.
IMPORTERS = ("transformers", "diffusers")


def needs_torchao(stage: StageConfig) -> bool:
    """Whether ``stage`` quantizes its weights (torchao through diffusers)."""
    return stage.engine_args.quantization is not None


def keep_out_unrequested(stages: Iterable[StageConfig]) -> None:
    """Mark torchao absent from this process unless one of ``stages`` needs it. A no-op once
    transformers or diffusers is imported (a replica forked from the launcher, which decided for
    every stage it forks): they chose what to import already."""
    if any(needs_torchao(s) for s in stages):
        return
    if TORCHAO in sys.modules or any(name in sys.modules for name in IMPORTERS):
        return
    sys.modules[TORCHAO] = None  # type: ignore[assignment]  # the import system's "absent"
