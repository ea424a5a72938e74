"""Backends come from a registry, and each reads its own ``runtime:`` keys into its own struct."""

from __future__ import annotations

import msgspec
import pytest

from omni_runtime.config import parse_config, with_ray_address
from omni_runtime.engine.backends import BACKENDS, EngineResources, make_backends, register_backend
from omni_runtime.engine.backends.inproc import InProcBackend
from omni_runtime.engine.backends.process import ProcessOptions
from omni_runtime.engine.backends.ray_backend import RayOptions
from omni_runtime.exceptions import ConfigError


def config(**runtime):
    stage = {"stage_id": 0, "stage_type": "echo", "final_output": True, "final_output_type": "text", "runtime": runtime}
    return parse_config({"stage_args": [stage]}, "deploy.yaml")


def error_of(**runtime) -> str:
    with pytest.raises(ConfigError) as e:
        config(**runtime)
    return str(e.value)


def test_flat_backend_keys_load_into_the_backend_s_own_struct():
    runtime = (
        config(backend="ray", ray_address="local", resources={"CPU": 0.5}, placement="spread").stage_args[0].runtime
    )
    assert runtime.options == RayOptions(ray_address="local", resources={"CPU": 0.5}, placement="spread")
    assert config(backend="ray", orphan_timeout_s=4).stage_args[0].runtime.options.orphan_timeout_s == 4.0
    assert config(transport="tcp").stage_args[0].runtime.options == ProcessOptions(transport="tcp")
    assert config(backend="inproc").stage_args[0].runtime.backend == "inproc"


def test_errors_in_backend_keys_name_the_yaml_path():
    assert "stage_args[0].runtime.object_store_min_bytes: Expected `int` >= 0" in error_of(
        backend="ray", object_store_min_bytes=-1
    )
    assert "stage_args[0].runtime.orphan_timeout_s: Expected `float` > 0.0" in error_of(
        backend="ray", orphan_timeout_s=0
    )
    assert "stage_args[0].runtime.transport: Invalid enum value 'udp'" in error_of(transport="udp")
    assert "stage_args[0].runtime.backend: Invalid enum value 'nope'" in error_of(backend="nope")
    assert "stage_args[0].runtime.colour: unknown key" in error_of(colour="red")


def test_another_backend_s_keys_are_accepted_and_ignored():
    runtime = config(ray_address="local", resources={"GPU": 1}).stage_args[0].runtime
    assert runtime.backend == "process" and runtime.options == ProcessOptions()


def test_a_loaded_config_round_trips_and_takes_the_ray_address_override():
    loaded = config(backend="ray", resources={"CPU": 0.5})
    again = parse_config(msgspec.to_builtins(loaded))
    assert again == loaded
    assert with_ray_address(loaded, "127.0.0.1:1").stage_args[0].runtime.options.ray_address == "127.0.0.1:1"


class FakeOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    colour: str = "blue"


class FakeBackend(InProcBackend):
    name = "fake"
    options = FakeOptions


def test_a_backend_registered_from_outside_is_made_with_its_options():
    register_backend("fake", f"{__name__}:FakeBackend")
    try:
        cfg = config(backend="fake", colour="red")
        assert cfg.stage_args[0].runtime.options == FakeOptions(colour="red")
        backends = make_backends(cfg, EngineResources())
        assert list(backends) == ["fake"] and isinstance(backends["fake"], FakeBackend)
    finally:
        del BACKENDS["fake"]


def test_a_backend_checks_its_stages_together_when_the_config_is_resolved():
    from omni_runtime.resolve import config_errors

    stages = [
        {
            "stage_id": i,
            "stage_type": "echo",
            "final_output": i == 1,
            "final_output_type": "text" if i == 1 else None,
            "engine_input_source": [0] if i == 1 else [],
            "runtime": {"backend": "ray", "ray_address": address},
        }
        for i, address in enumerate(("local", "auto"))
    ]
    errors = config_errors(parse_config({"stage_args": stages}, "deploy.yaml"), "deploy.yaml")
    expected = "deploy.yaml: stage_args: the ray stages name different clusters: ['auto', 'local']"
    assert [str(e) for e in errors] == [expected]
