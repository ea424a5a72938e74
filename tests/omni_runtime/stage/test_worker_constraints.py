"""The constraints a stage reports in READY are a StageConstraints struct: a runner that returns the
older dict form is converted at load, and one that names a field the struct lacks (a misspelt key,
which would disable a check in silence) fails the load."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from omni_runtime.config import StageConfig
from omni_runtime.messages import StageConstraints, StageReady
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner
from omni_runtime.stage.worker import StageWorker

pytestmark = pytest.mark.unit


class _Runner(StageRunner):
    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        return [RunnerOutput(text="") for _ in batch]


class TypedRunner(_Runner):
    def constraints(self) -> StageConstraints:
        return StageConstraints(size_multiple=16, max_pixels=4096, native_size=(32, 64))


class DictRunner(_Runner):
    def constraints(self) -> Any:
        return {"size_multiple": 8, "image_inputs": ["image"], "default_strength": {"image": 0.5}}


class CompiledRunner(_Runner):
    def stats(self) -> dict[str, Any]:
        return {"compile_warmup_s": 1.5}


class MisspeltRunner(_Runner):
    def constraints(self) -> Any:
        return {"size_multple": 8}


def stage(runner: type[StageRunner]) -> StageConfig:
    return msgspec.convert({"stage_id": 0, "stage_type": f"{__name__}:{runner.__name__}"}, StageConfig)


async def ready(runner: type[StageRunner]) -> StageReady:
    worker = StageWorker(stage(runner), 0, send=lambda msg: None)
    try:
        return await worker.start()
    finally:
        await worker.close()


async def test_a_typed_runner_reports_its_struct() -> None:
    msg = await ready(TypedRunner)
    assert msg.constraints == StageConstraints(size_multiple=16, max_pixels=4096, native_size=(32, 64))


async def test_the_compile_time_of_the_load_travels_in_ready() -> None:
    assert (await ready(CompiledRunner)).compile_s == 1.5
    assert (await ready(TypedRunner)).compile_s is None


async def test_the_dict_form_is_converted() -> None:
    msg = await ready(DictRunner)
    assert msg.constraints == StageConstraints(
        size_multiple=8, image_inputs=("image",), default_strength={"image": 0.5}
    )


async def test_an_unknown_field_fails_the_load() -> None:
    worker = StageWorker(stage(MisspeltRunner), 0, send=lambda msg: None)
    try:
        with pytest.raises(TypeError, match=r"MisspeltRunner\.constraints\(\).*size_multple"):
            await worker.start()
    finally:
        await worker.close()


def test_ready_travels_with_its_constraints() -> None:
    constraints = StageConstraints(
        size_multiple=8,
        native_size=(64, 48),
        lora=True,
        image_inputs=("image", "mask_image"),
        default_strength={"image": 0.8},
        requires_image="edits only",
    )
    msg = StageReady(stage_id=2, replica_id=1, pid=7, constraints=constraints)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=StageReady)
    assert decoded == msg and decoded.constraints.native_size == (64, 48)
