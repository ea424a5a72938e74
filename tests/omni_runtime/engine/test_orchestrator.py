"""Orchestrator routing through the stage graph, on in-process stage clients (no sockets)."""

from __future__ import annotations

import os

import pytest

from omni_runtime import AsyncOmni
from omni_runtime.exceptions import InvalidRequestError, StageExecutionError
from tests.conftest import echo_stage, make_config

INPROC = {"backend": "inproc"}


def stage(sid, sources=(), final=False, **kw):
    s = echo_stage(sid, runtime=INPROC, engine_input_source=list(sources), final_output=final, **kw)
    if not final:
        s.pop("final_output_type")
    return s


@pytest.fixture(scope="module")
def dag():
    # 0 -> 1 -> 3 (final, text) and 0 -> 2 -> 3: fan-out then fan-in; 2 is also final.
    config = make_config(
        [
            stage(0),
            stage(1, [0]),
            stage(2, [0], final=True, final_output_type="tensor"),
            stage(3, [1, 2], final=True, custom_process_input_func="tests.helpers:shout"),
        ]
    )
    with AsyncOmni(config) as engine:
        yield engine


async def collect(engine, prompt, **kw):
    return [out async for out in engine.generate(prompt, **kw)]


async def test_fan_out_fan_in_routes_through_every_stage(dag):
    outs = await collect(dag, "hello")
    # The inner stages 0 and 1 say when they are done (in either order); the final stages deliver.
    notices = [o for o in outs if o.progress is not None]
    assert sorted(o.progress.stage_id for o in notices) == [0, 1]
    assert all(o.progress.stage_done and not o.finished and o.text is None for o in notices)
    outs = [o for o in outs if o.progress is None]
    assert [o.finished for o in outs] == [False, True]
    final = outs[-1]
    assert sorted(final.outputs_by_stage) == [2, 3]
    assert final.outputs_by_stage[2].text == "hello"
    # Stage 3's input function saw both upstream outputs.
    assert final.outputs_by_stage[3].text == "1:HELLO | 2:HELLO"
    assert final.metrics["e2e_ms"] > 0


async def test_modalities_subset_stops_after_the_requested_stage(dag):
    async def served():
        return {r.stage_id: r.result["requests_served"] for r in await dag.collective_rpc("get_stats")}

    before = await served()
    outs = await collect(dag, "hi", modalities=["tensor"])
    assert outs[-1].finished and sorted(outs[-1].outputs_by_stage) == [2]
    after = await served()
    # Only stage 2 was asked for: its upstream 0 ran, stages 1 and 3 never did.
    assert {s: after[s] - before[s] for s in after} == {0: 1, 1: 0, 2: 1, 3: 0}
    with pytest.raises(InvalidRequestError, match="no final stage produces") as info:
        await collect(dag, "hi", modalities=["image"])
    assert info.value.param == "modalities"


async def test_params_list_must_match_stage_count(dag):
    with pytest.raises(InvalidRequestError, match="one entry per stage") as info:
        await collect(dag, "x", sampling_params=[None, None])
    assert info.value.param == "sampling_params_list"


async def test_stage_error_fails_only_that_request_and_names_the_stage():
    config = make_config([stage(0, final=True, stage_type="tests.helpers:FlakyRunner")])
    async with AsyncOmni(config) as engine:
        with pytest.raises(StageExecutionError, match="poisoned") as info:
            await collect(engine, "poison")
        assert info.value.stage_id == 0
        assert (await collect(engine, "fine"))[-1].text == "fine"


def test_a_killed_engines_socket_directory_is_removed_by_the_next_engine(tmp_path):
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from omni_runtime.engine.backends.process import _IPC_PREFIX, _remove_stale_ipc_dirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = Path(tempfile.gettempdir()) / f"{_IPC_PREFIX}{gone.stdout.strip()}-abc"
    alive = Path(tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getppid()}-"))
    stale.mkdir()
    try:
        _remove_stale_ipc_dirs()
        assert not stale.exists() and alive.exists()
    finally:
        for path in (stale, alive):
            if path.exists():
                path.rmdir()
