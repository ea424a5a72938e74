"""The ray backend on a real (private) Ray cluster with two worker nodes: replicas placed by
resources and spread over the nodes, the same results as the process backend, batching, abort and
deadlines, faults (a killed actor, a lost node), tensors handed actor to actor, mixed backends,
placements that can never be satisfied."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from omni_runtime import AsyncOmni
from omni_runtime.config import load_config
from omni_runtime.exceptions import RequestAbortedError, RequestTimeoutError, StageDeadError, StageStartupError
from tests.conftest import echo_stage, eventually, make_config
from tests.omni_runtime.engine.backends.conftest import STORE

RAY = {"backend": "ray"}


def on_ray(config, **runtime):
    """``config`` (a bundled name or a DeployConfig) with every stage on the ray backend."""
    import msgspec

    data = msgspec.to_builtins(load_config(config) if isinstance(config, str) else config)
    for stage in data["stage_args"]:
        stage["runtime"] = {**stage["runtime"], **RAY, **runtime}
        stage["runtime"].pop("process", None)
    return make_config(data["stage_args"], model=data.get("model"))


async def run(engine, prompt, params=None, **kw):
    last = None
    async for out in engine.generate(prompt, params, **kw):
        last = out
    return last


@functools.cache
def _solo_runner() -> Any:
    """tiny-sd's request-level runner in this process, loaded once for the module's comparisons."""
    import msgspec

    from omni_runtime.config import StageConfig
    from omni_runtime.stage.runners.diffusion import DiffusionRunner

    stage = msgspec.convert({"stage_id": 0, "stage_type": "diffusion", "model": "builtin:tiny-sd"}, StageConfig)
    runner = DiffusionRunner(stage)
    runner.load()
    return runner


def solo_image(prompt: str, seed: int) -> np.ndarray:
    """The image the request-level runner makes for one request alone, in this process."""
    import torch

    from omni_runtime.params import DiffusionSamplingParams, resolve_params
    from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = _solo_runner()
        given = {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 7.5, "seed": seed}
        params = resolve_params(DiffusionSamplingParams, {}, given)
        [out] = runner.execute([RunnerRequest("r", prompt, params)], ExecuteContext(lambda rid: False))
        return out.media[0].data
    finally:
        torch.set_num_threads(threads)


async def test_tiny_sd_replicas_spread_over_two_nodes_batch_and_match_the_process_backend(ray_cluster):
    config = on_ray("tiny-sd", num_replicas=2, placement="spread", resources={"CPU": 1})
    async with AsyncOmni(config, request_batch_max_wait_ms=100) as engine:
        health = engine.health()
        nodes = health.stages[0].replica_nodes
        assert len(set(nodes)) == 2 and set(nodes) <= {n.node_id for n in ray_cluster.nodes.values()}
        prompts = [f"a red fox {i}" for i in range(6)]
        outs = await asyncio.gather(*(run(engine, p, {"seed": i}) for i, p in enumerate(prompts)))
        assert {o.metrics["replica_id"] for o in outs} == {0, 1}  # both nodes served
        assert max(o.metrics["batch_size"] for o in outs) > 1  # fused waves still form
        for i in (0, 3):
            got = np.asarray(outs[i].images[0]).astype(int)
            assert np.abs(got - solo_image(prompts[i], i).astype(int)).max() <= 2


async def test_deadlines_and_aborts_free_a_ray_replica(ray_cluster):
    stage = echo_stage(stage_type="tests.helpers:FlakyRunner", runtime=RAY, engine_args={"max_num_seqs": 4})
    async with AsyncOmni(make_config([stage])) as engine:
        # ``delay_ms`` keeps the forward in its thread (a hang on the actor's loop would be killed
        # as an unresponsive replica, rightly).
        start = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            await run(engine, "hang until the deadline", {"timeout": 0.5, "delay_ms": 1})
        assert time.monotonic() - start < 3
        task = asyncio.create_task(run(engine, "hang until aborted", {"delay_ms": 1}, request_id="stuck"))
        await eventually(lambda: engine.health().stages[0].inflight == 1, what="the request on the actor")
        engine.abort("stuck")
        with pytest.raises(RequestAbortedError):
            await task

        async def idle() -> bool:
            return (await engine.collective_rpc("get_stats", timeout=5))[0].result["running"] == 0

        # Each forward notices its abort at its next check (1 ms apart); the wait is for the
        # stats call on a busy machine (two pytest workers beside a Ray cluster took over 10 s).
        await eventually(idle, timeout=30, what="the hung forwards stopped on the actor")
        assert (await run(engine, "served after")).text == "served after"
        assert engine.health().stages[0].restarts == 0


async def test_a_killed_actor_fails_its_wave_fast_and_is_restarted(ray_cluster):
    stage = echo_stage(runtime={**RAY, "max_restarts": 2}, engine_args={"max_num_seqs": 4})
    async with AsyncOmni(make_config([stage])) as engine:
        [ping] = await engine.collective_rpc("ping", timeout=10)
        old_pid = ping.result["pid"]
        tasks = [asyncio.create_task(run(engine, f"w{i}", {"delay_ms": 5000})) for i in range(3)]
        await eventually(lambda: engine.health().stages[0].inflight == 3, what="the wave on the actor")
        start = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - start < 2
        assert all(isinstance(r, StageDeadError) for r in results), results
        await eventually(lambda: engine.health().stages[0].live_replicas == 1, timeout=30, what="the restart")
        assert (await run(engine, "back")).text == "back"
        [ping] = await engine.collective_rpc("ping", timeout=10)
        assert ping.result["pid"] != old_pid and engine.health().stages[0].restarts == 1


async def test_replicas_of_a_lost_node_come_back_on_a_surviving_one(ray_cluster):
    # Two nodes that alone offer `movable`: the replica lands on one (either), and after that
    # node is lost it can only come back on the other.
    pair = [ray_cluster.add(name, num_cpus=1, resources={"movable": 1}) for name in ("c", "c2")]
    stage = echo_stage(runtime={**RAY, "num_replicas": 1, "resources": {"movable": 1}})
    async with AsyncOmni(make_config([stage])) as engine:
        [host] = engine.health().stages[0].replica_nodes
        victim = next(n for n in pair if n.node_id == host)
        survivor = next(n for n in pair if n.node_id != host)
        ray_cluster.cluster.remove_node(victim, allow_graceful=False)
        await eventually(
            lambda: (
                engine.health().stages[0].live_replicas == 1
                and engine.health().stages[0].replica_nodes == [survivor.node_id]
            ),
            timeout=60,
            what="the lost replica back on the other node",
        )
        outs = await asyncio.gather(*(run(engine, f"after {i}") for i in range(4)))
        assert [o.text for o in outs] == [f"after {i}" for i in range(4)]


async def test_a_split_pipeline_hands_its_tensors_from_actor_to_actor(ray_cluster):
    # Every tensor goes through the object store (the threshold is lowered for the tiny model).
    config = on_ray("tiny-sd-split", resources={"CPU": 0.5}, object_store_min_bytes=1024)
    async with AsyncOmni(config) as engine:
        out = await run(engine, "a lighthouse", [None, {"seed": 5}, None])
        backend = engine.engine._orchestrator.backends["ray"]
        image = np.asarray(out.images[0])
        # Embeddings and latents went actor to actor: this process fetched only what it delivered.
        delivered = sum(np.asarray(t).nbytes for t in out.tensors.values()) + image.nbytes
        assert 0 < backend.fetched_bytes <= delivered
        assert np.abs(image.astype(int) - solo_image("a lighthouse", 5).astype(int)).max() <= 2


async def test_a_text_stage_in_a_process_feeds_a_diffusion_stage_on_ray(ray_cluster):
    import msgspec

    data = msgspec.to_builtins(load_config("tiny-omni"))
    data["stage_args"][1]["runtime"] = {**data["stage_args"][1]["runtime"], **RAY, "resources": {"CPU": 1}}
    data["stage_args"][1]["runtime"].pop("process", None)
    async with AsyncOmni(make_config(data["stage_args"], model="mixed")) as engine:
        nodes = [s.replica_nodes for s in engine.health().stages]
        assert nodes[0] != nodes[1]  # a local process, and a Ray node
        out = await run(engine, "a small boat")
        # The text stage delivered (its sampled text may be empty: a random model can stop at once)
        # and fed the image stage on Ray.
        assert out.outputs_by_stage[0].text is not None
        assert out.images and out.images[0].size == (64, 64)


def test_a_placement_no_node_can_satisfy_fails_at_once_and_says_what_is_missing(ray_cluster):
    stage = echo_stage(runtime={**RAY, "resources": {"GPU": 1, "node_z": 1}})
    start = time.monotonic()
    with pytest.raises(StageStartupError, match=r"stage 0 replica 0 cannot be placed.*missing \{'GPU': 1"):
        AsyncOmni(make_config([stage]))
    assert time.monotonic() - start < 10


async def test_a_node_that_stops_answering_is_replaced_by_heartbeat_and_its_actor_exits(ray_cluster):
    """Only the node's raylet dies: the replica is given up within seconds (its stream breaks, or
    it misses heartbeats), and the actor's process, which Ray would leave running for minutes
    holding its memory, exits by itself once it hears nothing from the engine."""
    import psutil

    lost = ray_cluster.add("d", num_cpus=1, resources={"lonely": 1, "spare_d": 1})
    runtime = {"resources": {"spare_d": 1}, "heartbeat_timeout_s": 2.0, "orphan_timeout_s": 4.0, "max_restarts": 1}
    stage = echo_stage(runtime={**RAY, **runtime})
    async with AsyncOmni(make_config([stage]), default_timeout=60) as engine:
        [ping] = await engine.collective_rpc("ping", timeout=10)
        orphan = psutil.Process(ping.result["pid"])
        assert engine.health().stages[0].replica_nodes == [lost.node_id]
        start = time.monotonic()
        lost.kill_raylet()
        await eventually(lambda: engine.health().stages[0].replica_states != ["live"], timeout=10, what="loss")
        assert time.monotonic() - start < 6
        # Its replacement needs spare_d, which only the lost node had: it waits for capacity while
        # the orphan exits by itself (orphan_timeout_s without a word from the engine).
        gone, _ = psutil.wait_procs([orphan], timeout=30)
        assert gone and time.monotonic() - start < 30
    ray_cluster.cluster.remove_node(lost, allow_graceful=False)


def test_a_replica_waiting_to_be_placed_leaves_its_ready_sibling_alive_and_is_named_at_the_timeout(ray_cluster):
    """Two replicas that each need node a's only ``node_a``: one starts, the other can only wait
    for it. The ready one is heartbeaten meanwhile (unpinged, it would exit by itself after
    ``orphan_timeout_s`` and free its place for the other, which would then start well within
    ``startup_timeout_s``), and the pool fails at ``startup_timeout_s`` naming what the waiting
    replica waits for."""
    stage = echo_stage(
        runtime={
            **RAY,
            "num_replicas": 2,
            "resources": {"CPU": 0.5, "node_a": 1},
            "heartbeat_timeout_s": 1.0,  # pings every 0.25 s
            "orphan_timeout_s": 3.0,  # the replica's own silence limit
            "startup_timeout_s": 10,
        }
    )
    start = time.monotonic()
    waits = r"replica [01] of stage 0 waits for resources \{'CPU': 0.5, 'node_a': 1"
    with pytest.raises(StageStartupError, match=waits):
        AsyncOmni(make_config([stage]))
    assert 10 <= time.monotonic() - start < 30


def test_omni_runtime_worker_joins_the_cluster_with_the_resources_a_config_asks_for(ray_cluster, tmp_path):
    import subprocess
    import sys

    import ray
    import yaml

    config = {
        "model": "pinned",
        "stage_args": [
            echo_stage(runtime={"backend": "ray", "num_replicas": 2, "resources": {"CPU": 0.5, "echo_box": 1}})
        ],
    }
    path = tmp_path / "pinned.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = [sys.executable, "-m", "omni_runtime.entrypoints.cli", "worker", "--address", ray_cluster.address]
    args = [str(path), "--num-cpus", "1", "--object-store-mb", "80"]
    dry = subprocess.run([*cli, *args, "--dry-run"], capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and '--resources {"echo_box": 2.0}' in dry.stdout
    worker = subprocess.Popen(
        [*cli, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not any(n["Alive"] and n["Resources"].get("echo_box") == 2 for n in ray.nodes()):
            assert worker.poll() is None and time.monotonic() < deadline, "the node did not join"
            time.sleep(0.5)
    finally:
        worker.terminate()
        worker.wait(30)
    deadline = time.monotonic() + 30
    while any(n["Alive"] and "echo_box" in n["Resources"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the node did not leave"
        time.sleep(0.5)


def test_engines_of_one_process_share_its_ray_connection_and_the_last_close_stops_the_local_cluster():
    """In a fresh process (this one already joined the test cluster; Ray's connection is per
    process), with ``RAY_ADDRESS`` pointing nowhere (``local`` must not follow it): a cluster that
    does not answer fails within the bound; a start refused for impossible resources gives its
    connection back whole; of two engines on one local cluster, closing the first leaves the
    second serving; the last close stops every process of the cluster and removes its temp dir
    (``ray_process_script.py`` prints what it found)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[4]
    token = Path.home() / ".ray" / "auth_token"
    had_token = token.exists()
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9", "PYTHONPATH": str(root)}
    start = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("ray_process_script.py"))],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=root,
        )
    finally:
        if not had_token:
            token.unlink(missing_ok=True)  # a new local cluster writes one
    took = time.monotonic() - start
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    found = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    unreachable_s = float(found["unreachable"].split(" s: ")[0])
    assert unreachable_s < 5 and "no Ray cluster answers at '127.0.0.1:1'" in found["unreachable"]
    assert "cannot be placed" in found["refused"] and found["dirs after refused"] == "[]"
    assert int(found["cluster processes"].split(":")[0]) >= 3 and "raylet" in found["cluster processes"]
    assert found["second after first closed"] == "still served"
    assert found["left running"] == "[]" and found["children"] == "[]" and found["dirs left"] == "[]"
    assert "done" in out.stdout and took < 150


async def test_models_run_on_the_nodes_declaring_them_and_one_whose_node_is_lost_fails_fast(ray_cluster):
    """Nodes declaring ``m1`` and ``m2`` (``omni-runtime worker --models``): each model's replica
    runs on its own node; ``m3``, which no node declares, fails its load while they serve. When
    m2's node is lost, m2 is reported ``unplaced`` and fails its requests at once while m1 serves,
    until a node declaring m2 joins and the waiting restart places it there. The declaring nodes
    go again at the end: the other tests' engines see a cluster where no node declares a model."""
    from omni_runtime.entrypoints.multi_omni import ModelSpec

    from omni_runtime import MultiOmni
    from omni_runtime.engine.backends.ray_backend import declared_resources
    from omni_runtime.exceptions import ModelUnavailableError

    cluster = ray_cluster.cluster
    added = [cluster.add_node(num_cpus=1, resources=declared_resources([m], []), object_store_memory=STORE)
             for m in ("m1", "m2")]  # fmt: skip
    cluster.wait_for_nodes()
    holds = dict(zip(("m1", "m2"), added, strict=True))
    runtime = {**RAY, "resources": {"CPU": 0.25}, "heartbeat_timeout_s": 2.0}
    specs = [ModelSpec(source=make_config([echo_stage(runtime=runtime)], model="echo"), name=m) for m in holds]
    multi = MultiOmni([*specs, ModelSpec(source=specs[0].source, name="m3")])

    async def run_on(model, prompt):
        last = None
        async for out in multi.generate(prompt, model=model):
            last = out
        return last

    try:
        await multi.start()
        # 1) placed by declared model; m3 failed at once beside them
        assert multi.states() == {"m1": "loaded", "m2": "loaded", "m3": "failed"}
        assert "no live node of the Ray cluster declares the model `m3`" in str(multi.models["m3"].error)
        for name, node in holds.items():
            assert multi.health()[name].stages[0].replica_nodes == [node.node_id]
        outs = await asyncio.gather(run_on("m1", "one"), run_on("m2", "two"))
        assert [o.text for o in outs] == ["one", "two"]

        # 2) m2's only declaring node is lost: m2 is reported and fails fast, m1 serves
        cluster.remove_node(holds["m2"], allow_graceful=False)
        await eventually(lambda: multi.states()["m2"] == "unplaced", timeout=30, what="m2 unplaced")
        start = time.monotonic()
        with pytest.raises(ModelUnavailableError, match=r"the model `m2` has no node.*declares the model `m2`"):
            await run_on("m2", "lost")
        assert time.monotonic() - start < 2
        assert (await run_on("m1", "still")).text == "still" and multi.states()["m1"] == "loaded"

        # 3) a node declaring m2 joins: the waiting restart places m2 there, and it serves again
        back = ray_cluster.add("m2_again", num_cpus=1, resources=declared_resources(["m2"], []))
        added.append(back)
        await eventually(lambda: multi.states()["m2"] == "loaded", timeout=30, what="m2 placed again")
        assert multi.health()["m2"].stages[0].replica_nodes == [back.node_id]
        assert (await run_on("m2", "back")).text == "back"
    finally:
        await asyncio.get_running_loop().run_in_executor(None, multi.close)
        for node in added:
            if node in cluster.worker_nodes:
                cluster.remove_node(node, allow_graceful=False)
        ray_cluster.nodes.pop("m2_again", None)
