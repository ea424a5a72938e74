"""``engine_args.return_freed_memory``: the stage worker fixes glibc's mmap threshold in its
process, so that a large block freed by one forward goes back to the system instead of staying in
the heap for shapes that never fit it again (docs/reliability.md, "Memory")."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from omni_runtime.config import EngineArgs, StageConfig
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner
from omni_runtime.stage.worker import StageWorker

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the mmap threshold is glibc's")

#: In a fresh interpreter: free one 8 MiB block (glibc then raises its threshold to 8 MiB unless it
#: is fixed), allocate another, and print how many bytes that one added to the mapped blocks.
PROBE = """
import ctypes, sys
from omni_runtime.stage.memory import fix_mmap_threshold

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
block = bytearray(8 << 20)
del block
before = libc.mallinfo2().hblkhd
block = bytearray(8 << 20)
print(libc.mallinfo2().hblkhd - before)
"""


@glibc
@pytest.mark.integration
@pytest.mark.parametrize("mode", ["glibc default", "fixed"])
def test_a_freed_large_block_does_not_move_the_next_one_into_the_heap(mode: str) -> None:
    # glibc's own defaults: no tuning of malloc from this environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    cmd = [sys.executable, "-c", PROBE, mode]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True, env=env)
    mapped = int(out.stdout)
    if mode == "fixed":
        assert mapped >= 8 << 20  # mapped for itself: unmapped, and returned, when freed
    else:
        assert mapped == 0  # the cause: carved out of the heap, where it fragments


@pytest.mark.unit
def test_it_is_on_by_default() -> None:
    assert EngineArgs().return_freed_memory is True


class Runner(StageRunner):
    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        return [RunnerOutput(text="") for _ in batch]


def worker_stats(**engine_args: Any) -> dict[str, Any]:
    data = {"stage_id": 0, "stage_type": f"{__name__}:Runner", "engine_args": engine_args}
    worker = StageWorker(msgspec.convert(data, StageConfig), 0, send=lambda msg: None)
    try:
        return worker.stats()
    finally:
        worker.forward_thread.shutdown()


@glibc
@pytest.mark.unit
def test_the_worker_fixes_the_threshold_and_says_so() -> None:
    assert worker_stats()["mmap_threshold_fixed"] is True
    assert worker_stats(return_freed_memory=False)["mmap_threshold_fixed"] is False
