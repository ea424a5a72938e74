"""Run by test_ray_connection.py in a fresh process (Ray's connection is per process): several
engines come and go in one process that has ``RAY_ADDRESS`` pointing nowhere, each asking for a
private local cluster. Prints one ``key: value`` line per finding for the test to check."""

from __future__ import annotations

import glob
import os
import tempfile
import time

import psutil

from omni_runtime import Omni
from omni_runtime.exceptions import StageStartupError
from tests.conftest import echo_stage, make_config


def config(**runtime):
    runtime = {"backend": "ray", "resources": {"CPU": 0}, "startup_timeout_s": 60, **runtime}
    return make_config([echo_stage(runtime=runtime)])


def cluster_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "omr-ray-*")))


def running(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def with_path(path: str) -> list[int]:
    """Processes with ``path`` on their command line, and their descendants (the raylet's agents
    and workers, which Ray leaves orphaned after a shutdown)."""
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(path in arg for arg in p.info["cmdline"] or ()):
                found |= {p.pid, *(c.pid for c in p.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
    return sorted(found)


before = cluster_dirs()

# 1) A cluster nobody answers at: a typed failure within the bound (Ray would retry for a minute
#    and then end the process).
start = time.monotonic()
try:
    Omni(config(startup_timeout_s=5), ray_address="127.0.0.1:1")
except StageStartupError as e:
    print(f"unreachable: {time.monotonic() - start:.1f} s: {e}")

# 2) A start refused for resources no node has: the connection it made is given back whole.
try:
    Omni(config(resources={"GPU": 4}), ray_address="local")
except StageStartupError as e:
    print(f"refused: {e}")
print(f"dirs after refused: {sorted(cluster_dirs() - before)}")

# 3) Then two engines on one local cluster (RAY_ADDRESS is ignored): closing the first leaves the
#    second serving.
first = Omni(config(), ray_address="local")
second = Omni(config(), ray_address="local")
[ours] = cluster_dirs() - before
cluster = with_path(ours)
print(f"cluster processes: {len(cluster)}: {sorted(psutil.Process(p).name() for p in cluster)}")
first.close()
print(f"second after first closed: {second.generate('still served', use_tqdm=False)[0].text}")
second.close()

# 4) Nothing left: no process of the cluster, no child of this process, no temp dir.
print(f"left running: {running(cluster) + with_path(ours)}")
print(f"children: {running(p.pid for p in psutil.Process().children(recursive=True))}")
print(f"dirs left: {sorted(cluster_dirs() - before)}")
print("done")
