"""The ray backend beside the process backend, on a private Ray cluster started here (a head and
two worker nodes of one CPU each), every comparison measured in the same run, interleaved:

(a) echo: sequential round trip (p50/p99) and throughput with N requests in flight, ray vs process;
(b) scale-out: tiny-sd throughput with 1 replica on 1 node vs 2 replicas spread over 2 nodes
    (each replica one torch thread; target >= 1.7x);
(c) a 64 MiB tensor from stage to stage: Ray's object store (actor to actor) vs shared memory
    (the process backend) vs pickle over pyzmq.

    python -m benchmarks.distributed [--rounds 3] [--inflight 1000] [--images 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import msgspec

from benchmarks._common import summary, table, write_json
from benchmarks.overhead import async_inflight, async_sequential
from benchmarks.transfer import MIB, PickleLink, runtime_config, runtime_rate

STORE = 200 * MIB


def with_runtime(config: Any, **runtime: Any) -> Any:
    from omni_runtime.config import parse_config

    data = msgspec.to_builtins(config)
    for stage in data["stage_args"]:
        stage["runtime"] = {**stage["runtime"], **runtime}
        stage["runtime"].pop("process", None)
    return parse_config(data, source="benchmark")


def on_nodes(config: Any, producer: str, consumer: str) -> Any:
    """The two-stage transfer pipeline on Ray, its stages pinned to the named nodes (no CPU)."""
    from omni_runtime.config import parse_config

    data = msgspec.to_builtins(config)
    for stage, node in zip(data["stage_args"], (producer, consumer), strict=True):
        stage["runtime"] = {**stage["runtime"], "backend": "ray", "resources": {"CPU": 0, node: 0.01}}
    return parse_config(data, source="benchmark")


async def images_per_s(engine: Any, n: int) -> float:
    async def one(i: int) -> None:
        async for _ in engine.generate(f"a lighthouse {i}", {"seed": i}):
            pass

    await asyncio.gather(*(one(i) for i in range(4)))  # warm-up
    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sequential", type=int, default=300)
    ap.add_argument("--inflight", type=int, default=1000)
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="omr-")
    os.environ["RAY_TMPDIR"] = tmp  # Ray's sockets and files stay in here
    import ray
    import uvloop
    from ray.cluster_utils import Cluster

    from omni_runtime import AsyncOmni
    from omni_runtime.config import load_config

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": STORE}
    )
    for name in ("a", "b"):
        cluster.add_node(num_cpus=1, resources={f"node_{name}": 1}, object_store_memory=STORE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    loop = uvloop.new_event_loop()
    results: dict[str, list[float]] = {}

    def keep(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    echo = load_config("echo")
    sd = load_config("tiny-sd")
    engines: dict[str, AsyncOmni] = {}
    link = PickleLink(touch=False)
    try:
        # The echo and transfer actors take no CPU of the cluster's two: those are tiny-sd's.
        free = {"backend": "ray", "resources": {"CPU": 0}}
        engines["echo-process"] = AsyncOmni(echo, max_pending=2 * args.inflight)
        engines["echo-ray"] = AsyncOmni(with_runtime(echo, **free), max_pending=2 * args.inflight)
        xfer = runtime_config("ipc")
        engines["xfer-ray-same"] = AsyncOmni(on_nodes(xfer, "node_a", "node_a"))
        engines["xfer-ray-cross"] = AsyncOmni(on_nodes(xfer, "node_a", "node_b"))
        engines["xfer-shm"] = AsyncOmni(runtime_config("ipc"))
        one_node = with_runtime(sd, backend="ray", torch_threads=1, resources={"CPU": 1, "node_a": 0.5})
        two_nodes = with_runtime(
            sd, backend="ray", torch_threads=1, num_replicas=2, placement="spread", resources={"CPU": 1}
        )
        for _ in range(args.rounds):
            for kind in ("process", "ray"):
                engine = engines[f"echo-{kind}"]
                keep(
                    f"echo-{kind}-p50",
                    summary(loop.run_until_complete(async_sequential(engine, args.sequential)))["p50_ms"],
                )
                rate, _ = loop.run_until_complete(async_inflight(engine, args.inflight))
                keep(f"echo-{kind}-inflight", rate)
            # One tiny-sd engine at a time: each has the nodes' CPUs (and the machine) to itself.
            for name, config in (("sd-1", one_node), ("sd-2", two_nodes)):
                with AsyncOmni(config, max_num_seqs=4) as engine:
                    keep(name, loop.run_until_complete(images_per_s(engine, args.images)))
            nbytes = args.mib * MIB
            keep("xfer-pickle", link.rate(nbytes, args.seconds)[0])
            for name in ("xfer-shm", "xfer-ray-same", "xfer-ray-cross"):
                keep(name, loop.run_until_complete(runtime_rate(engines[name], nbytes, args.seconds, False))[0])
    finally:
        link.close()
        for engine in engines.values():
            engine.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    rows = [
        {
            "measure": "echo round trip p50 (ms)",
            "process": med["echo-process-p50"],
            "ray": med["echo-ray-p50"],
            "ray / process": med["echo-ray-p50"] / med["echo-process-p50"],
        },
        {
            "measure": f"echo, {args.inflight} in flight (req/s)",
            "process": med["echo-process-inflight"],
            "ray": med["echo-ray-inflight"],
            "ray / process": med["echo-ray-inflight"] / med["echo-process-inflight"],
        },
    ]
    print(table(rows, list(rows[0])))
    scale = med["sd-2"] / med["sd-1"]
    print(
        f"\ntiny-sd on Ray: 1 replica on 1 node {med['sd-1']:.2f} img/s, 2 replicas on 2 nodes "
        f"{med['sd-2']:.2f} img/s: {scale:.2f}x (target >= 1.7)"
    )
    mb = MIB / 1e6
    rows = [
        {"path": name, "MB/s": med[key] * mb, "x pickle": med[key] / med["xfer-pickle"]}
        for name, key in (
            ("pickle over pyzmq (two processes)", "xfer-pickle"),
            ("process backend, shared memory", "xfer-shm"),
            ("ray backend, object store, one node", "xfer-ray-same"),
            ("ray backend, object store, two nodes", "xfer-ray-cross"),
        )
    ]
    print(f"\n{args.mib} MiB from stage to stage, one at a time:")
    print(table(rows, list(rows[0])))
    print(f"medians of {args.rounds} rounds")
    write_json(args.json, {"raw": results, "medians": med})


if __name__ == "__main__":
    main()
