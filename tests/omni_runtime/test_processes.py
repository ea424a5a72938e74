"""Shared memory across processes: a dead engine's segments are swept, and a child's pool never
involves multiprocessing's resource tracker. (The in-process rules are in test_shm.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from omni_runtime import shm
from tests.omni_runtime.test_shm import BIG, put


def test_sweep_removes_segments_of_engines_whose_process_is_gone(engine):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    name = f"{shm.NAME_ROOT}-{dead_pid}-feedbeef-o-0"
    shm.Segment.create(name, 4096).close()
    mine = shm.ShmPool(engine + "-live")
    try:
        live = put(mine, np.zeros(BIG, dtype=np.float32))
        shm.sweep_dead_engines()
        assert shm.segment_names(name) == []
        assert shm.pending(live)  # this process's segments stay
    finally:
        mine.close()


def test_no_resource_tracker_involvement(engine):
    # multiprocessing's tracker would warn about (or unlink) segments it does not own at exit.
    code = (
        "import numpy as np, sys\n"
        "from omni_runtime import shm\n"
        f"p = shm.ShmPool({engine + '-child'!r})\n"
        "h = p.put(np.zeros(1 << 18, np.float32), '<f4', False)\n"
        "print(h.name)\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert child.returncode == 0, child.stderr
    assert "resource_tracker" not in child.stderr and "leaked" not in child.stderr
    # The child did not close its pool: the segment is there for its owner (here: us) to unlink.
    assert shm.segment_names(child.stdout.strip()) == [child.stdout.strip()]
