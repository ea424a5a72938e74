"""MultiOmni without HTTP: an echo model, tiny-sd and a model directory that fails to load, started
together; interleaved requests from several tasks reach their own model; the broken one fails its
own requests with a typed error naming it while the others serve."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_runtime.entrypoints.multi_omni import ModelSpec, load_models_file, parse_model_arg

from omni_runtime import MultiOmni
from omni_runtime.exceptions import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    ModelUnavailableError,
    UnknownModelError,
)
from tests.conftest import children, echo_stage, eventually, make_config
from tests.entrypoints.openai.server_process import assert_gone

SMALL = {"num_inference_steps": 2, "height": 32, "width": 32}
#: An echo model whose one replica is not restarted: killing it kills the model's engine.
ECHO = make_config([echo_stage(runtime={"max_restarts": 0})], model="echo")


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A diffusers directory that resolves (its index names a pipeline) but has no weights."""
    path = tmp_path_factory.mktemp("broken")
    index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}
    (path / "model_index.json").write_text(json.dumps(index))
    return path


@pytest.fixture(scope="module")
async def multi(broken_dir: Path):
    models = MultiOmni(
        [ECHO, ModelSpec(source="tiny-sd", name="sd", max_pending=8), ModelSpec(source=broken_dir, name="broken")],
        max_pending=32,
    )
    assert models.states() == {"echo": "loading", "sd": "loading", "broken": "loading"}
    async with models:
        yield models
    assert set(models.states().values()) <= {"closed", "failed", "dead"}


async def last(multi: MultiOmni, prompt: str, params: object = None, **kw: object):
    out = None
    async for item in multi.generate(prompt, params, **kw):  # type: ignore[arg-type]
        out = item
    assert out is not None and out.finished
    return out


async def test_each_model_has_its_own_state_and_engine(multi):
    assert multi.states() == {"echo": "loaded", "sd": "loaded", "broken": "failed"}
    assert multi.names == ["echo", "sd", "broken"]
    health = multi.health()
    assert health["broken"] is None
    assert health["echo"].max_pending == 32 and health["sd"].max_pending == 8  # each its own admission
    assert multi.engine("echo") is not multi.engine("sd")
    assert multi.models["sd"].kinds == ["image"] and multi.models["echo"].kinds == ["text"]


async def test_interleaved_requests_from_several_tasks_reach_their_model(multi):
    async def echo(i: int) -> str:
        return (await last(multi, f"hello {i}", model="echo")).text

    async def image(i: int):
        return await last(multi, f"a fox {i}", {**SMALL, "seed": i}, model="sd")

    # echo, image, echo, image, ... all in flight at once
    results = await asyncio.gather(*(echo(i) if i % 2 == 0 else image(i) for i in range(6)))
    echoed = [r for r in results if isinstance(r, str)]
    made = [r for r in results if not isinstance(r, str)]
    assert echoed == [f"hello {i}" for i in range(0, 6, 2)]
    assert len(made) == 3 and all(out.images and out.images[0].size == (32, 32) for out in made)


async def test_a_model_that_failed_to_load_fails_its_own_requests_typed(multi, broken_dir):
    with pytest.raises(ModelUnavailableError) as info:
        await last(multi, "a fox", model="broken")
    assert info.value.model == "broken" and info.value.state == "failed"
    assert "`broken` failed to load" in str(info.value)
    assert multi.models["broken"].error is not None
    # The others serve on, before and after.
    assert (await last(multi, "still here", model="echo")).text == "still here"


async def test_unknown_and_missing_model_names(multi):
    with pytest.raises(UnknownModelError) as unknown:
        multi.engine("nope")
    assert unknown.value.known == ("echo", "sd", "broken") and "`echo`, `sd`, `broken`" in str(unknown.value)
    with pytest.raises(InvalidRequestError, match="`model` is required") as missing:
        multi.validate("hi")
    assert missing.value.param == "model"


async def test_validate_then_generate_and_abort_on_one_model(multi):
    valid = multi.validate("checked once", model="echo")
    assert (await last(multi, valid, model="echo")).text == "checked once"
    results = await multi.collective_rpc("ping", model="echo", timeout=10)
    assert [r.ok for r in results] == [True]
    multi.abort(["no-such-request"])  # unknown ids are ignored by every model


async def test_events_come_typed_from_the_model_named(multi):
    from omni_runtime.events import Final, StageDone

    texts = [e async for e in multi.events("typed", model="echo")]
    assert isinstance(texts[-1], Final) and texts[-1].output.text == "typed"
    images = [e async for e in multi.events("a fox", {**SMALL, "seed": 3}, model="sd")]
    assert isinstance(images[-1], Final) and images[-1].output.images[0].size == (32, 32)
    assert [type(e) for e in images][-2:] == [StageDone, Final]
    with pytest.raises(UnknownModelError):
        [e async for e in multi.events("lost", model="nope")]


async def test_one_models_death_leaves_the_others_serving(multi):
    """Last in the module: the echo model's engine dies for good; tiny-sd serves on."""
    [ping] = await multi.collective_rpc("ping", model="echo", timeout=10)
    os.kill(ping.result["pid"], signal.SIGKILL)
    await eventually(lambda: multi.models["echo"].state == "dead", timeout=30, what="the echo model's death")
    assert isinstance(multi.models["echo"].error, EngineDeadError)
    with pytest.raises(ModelUnavailableError, match="`echo` is dead"):
        await last(multi, "anyone?", model="echo")
    assert (await last(multi, "a fox", SMALL, model="sd")).images
    assert multi.states() == {"echo": "dead", "sd": "loaded", "broken": "failed"}


def test_model_args_and_models_file(tmp_path: Path):
    assert parse_model_arg("tiny-sd") == ModelSpec(source="tiny-sd")
    assert parse_model_arg("chat=./x.yaml") == ModelSpec(source="./x.yaml", name="chat")
    odd = tmp_path / "a=b.yaml"
    odd.write_text("")
    assert parse_model_arg(str(odd)) == ModelSpec(source=str(odd))
    (tmp_path / "local.yaml").write_text("")
    models = tmp_path / "models.yaml"
    models.write_text("sd: tiny-sd\nlocal: local.yaml\nfast: {config: echo, max_pending: 2}\n")
    assert load_models_file(models) == [
        ModelSpec(source="tiny-sd", name="sd"),
        ModelSpec(source=str(tmp_path / "local.yaml"), name="local"),
        ModelSpec(source="echo", name="fast", max_pending=2),
    ]
    models.write_text("fast: {config: echo, max_pending: 0}\n")
    with pytest.raises(ConfigError, match=r"fast\.max_pending: expected int >= 1"):
        load_models_file(models)
    models.write_text("fast: {config: echo, replicas: 2}\n")
    with pytest.raises(ConfigError, match="unknown field `replicas`"):
        load_models_file(models)
    with pytest.raises(ConfigError, match="given twice"):
        MultiOmni(["echo", "echo"])


async def test_lazy_models_and_a_budget_of_one(broken_dir):
    """Three lazy echo models (two put to sleep when evicted, one stopped) and a lazy broken one
    under a budget of one loaded model: concurrent first requests share one load, alternating
    requests from several tasks are all answered across evictions, and the broken one fails its
    own requests typed while the others serve."""
    models = MultiOmni(
        [
            ModelSpec(source=ECHO, name="a", lazy=True),
            ModelSpec(source=ECHO, name="b", lazy=True),
            ModelSpec(source=ECHO, name="s", lazy=True, evict="stop"),
            ModelSpec(source=broken_dir, name="broken", lazy=True),
        ],
        max_loaded_models=1,
        load_timeout=120,
    )
    async with models:
        assert set(models.states().values()) == {"unloaded"}
        first = [asyncio.ensure_future(last(models, f"first {i}", model="a")) for i in range(6)]
        await eventually(lambda: models.models["a"].state == "loading", timeout=30, what="a loading")
        assert [o.text for o in await asyncio.gather(*first)] == [f"first {i}" for i in range(6)]
        assert models.counts()["a"].loads == 1 and models.states()["a"] == "loaded"

        async def client(k: int) -> list[str]:
            return [(await last(models, f"{k}-{i}", model="ab"[(k + i) % 2])).text or "" for i in range(4)]

        answers = await asyncio.wait_for(asyncio.gather(*(client(k) for k in range(4))), 120)
        assert answers == [[f"{k}-{i}" for i in range(4)] for k in range(4)]
        await eventually(
            lambda: list(models.states().values()).count("loaded") <= 1, timeout=30, what="the budget held"
        )
        a, b = models.counts()["a"], models.counts()["b"]
        # Evicted by sleep, each came back by a wake-up, never a second cold load.
        assert a.evictions + b.evictions >= 1 and a.loads == b.loads == 1
        assert a.wakes + b.wakes >= a.evictions + b.evictions - 1

        # The model stopped when evicted goes back to unloaded, its engine closed.
        assert (await last(models, "stop me", model="s")).text == "stop me"
        assert (await last(models, "back", model="a")).text == "back"
        await eventually(lambda: models.states()["s"] == "unloaded", timeout=30, what="s stopped")
        assert models.counts()["s"].evictions == 1 and models.models["s"].engine is None

        with pytest.raises(ModelUnavailableError) as info:
            await last(models, "a fox", model="broken")
        assert info.value.model == "broken" and info.value.state == "failed"
        assert (await last(models, "still here", model="a")).text == "still here"
        assert models.states()["broken"] == "failed"


def test_lazy_and_evict_in_model_args_and_models_file(tmp_path: Path):
    assert parse_model_arg("chat=echo@lazy") == ModelSpec(source="echo", name="chat", lazy=True)
    assert parse_model_arg("echo@lazy@stop") == ModelSpec(source="echo", lazy=True, evict="stop")
    models = tmp_path / "models.yaml"
    models.write_text("fast: {config: echo, lazy: true, evict: stop}\nsd: tiny-sd\n")
    assert load_models_file(models) == [
        ModelSpec(source="echo", name="fast", lazy=True, evict="stop"),
        ModelSpec(source="tiny-sd", name="sd"),
    ]


@settings(max_examples=40, deadline=None)
@given(lazy=st.one_of(st.integers(), st.text(max_size=8), st.none(), st.lists(st.booleans(), max_size=2)),
       evict=st.text(max_size=12).filter(lambda e: e not in ("sleep", "stop")))  # fmt: skip
def test_models_file_refuses_bad_lazy_and_evict(tmp_path_factory: pytest.TempPathFactory, lazy, evict):
    models = tmp_path_factory.mktemp("m") / "models.yaml"
    models.write_text(yaml.safe_dump({"fast": {"config": "echo", "lazy": lazy}}))
    with pytest.raises(ConfigError, match=r"fast\.lazy: expected true or false"):
        load_models_file(models)
    models.write_text(yaml.safe_dump({"fast": {"config": "echo", "evict": evict}}))
    with pytest.raises(ConfigError, match=r"fast\.evict: expected sleep or stop"):
        load_models_file(models)


def test_close_while_a_lazy_model_loads_closes_it_once_loaded_even_if_the_loop_ends():
    """``close()`` during a lazy model's load, then the loop ends (cancelling the task that waited
    for it): the load, finishing in its thread, closes the engine it made."""
    before = {p.pid for p in children()}

    async def main() -> MultiOmni:
        models = MultiOmni([ModelSpec(source=ECHO, name="a", lazy=True)])
        acquiring = asyncio.ensure_future(models.acquire("a"))
        await eventually(lambda: models.models["a"].state == "loading", timeout=30, what="a loading")
        models.close()
        assert not acquiring.done()  # cancelled when the loop ends, the load still running
        return models

    models = asyncio.run(main())  # waits for the loading thread (the default executor's shutdown)
    try:
        assert_gone([p for p in children() if p.pid not in before], timeout=5)
        assert models.states()["a"] == "closed" and models.models["a"].engine is None
    finally:
        for p in children():
            if p.pid not in before:
                p.kill()
