"""A private Ray cluster for the ray backend's tests: a head and two worker nodes, each with a
resource of its own, started once per test module (about 5-10 s) and stopped by its own handle, never
by ``ray stop`` (which stops every Ray process on the machine)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

STORE = 80 * 1024 * 1024  # object store per node: small, this machine is shared


@dataclass
class RayCluster:
    cluster: Any
    nodes: dict[str, Any]

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self, name: str, **kwargs: Any) -> Any:
        node = self.cluster.add_node(object_store_memory=STORE, **kwargs)
        self.cluster.wait_for_nodes()
        self.nodes[name] = node
        return node


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A private Ray cluster (a head and two nodes) for one test module. Module-scoped: its head,
    raylets and this process's driver threads would otherwise stay up, using CPU, for the rest of
    the worker's session, under every later test (one that measures an idle engine's CPU saw them)."""
    # A short private temp dir: Ray puts its sockets there (unix socket paths are short), and its
    # current-cluster file, which would otherwise go to the machine-wide /tmp/ray.
    tmp = tempfile.mkdtemp(prefix="omr-")
    token = Path.home() / ".ray" / "auth_token"
    had_token = token.exists()
    os.environ["RAY_TMPDIR"] = tmp
    import ray
    from ray.cluster_utils import Cluster

    # A lost node is declared dead after a few failed health checks half a second apart, checked
    # from a second after it joined (Ray's defaults take about 15 s, 5 s more for a new node): the
    # tests that remove a node wait for that. A check fails on a refused call or one unanswered for
    # Ray's health_check_timeout_ms, not on a slow answer of a busy node.
    health = {
        "health_check_initial_delay_ms": 1000,
        "health_check_period_ms": 500,
        "health_check_failure_threshold": 3,
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "object_store_memory": STORE,
            "_system_config": health,
        },
    )
    info = RayCluster(cluster, {})
    try:
        info.add("a", num_cpus=2, resources={"node_a": 1, "spare": 1})
        info.add("b", num_cpus=2, resources={"node_b": 1, "spare": 2})
        ray.init(address=cluster.address, log_to_driver=False)
        yield info
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_TMPDIR", None)
        shutil.rmtree(tmp, ignore_errors=True)
        if not had_token:
            token.unlink(missing_ok=True)
