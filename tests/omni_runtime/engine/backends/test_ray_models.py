"""Workers that declare the models they hold: what ``omni-runtime worker --models/--tags`` offers,
and which names can be declared. Placement by declared model on a Ray cluster is tested in
test_ray.py, beside the other tests on its cluster."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from omni_runtime.entrypoints.cli import build_parser, worker_command

from omni_runtime.engine.backends.ray_backend import DECLARED_CAPACITY, declared_resources, resource_name
from omni_runtime.exceptions import ConfigError


@pytest.mark.unit
def test_worker_dry_run_declares_its_models_and_tags_as_node_resources() -> None:
    args = build_parser().parse_args(
        ["worker", "--address", "head:6379", "--models", "sdxl, flux", "--tags", "a100,fast", "--dry-run"]
    )
    cmd = worker_command(args)
    assert cmd[1:5] == ["start", "--address", "head:6379", "--block"]
    offered = cmd[cmd.index("--resources") + 1]
    assert offered == (
        '{"omni_model:flux": 1000.0, "omni_model:sdxl": 1000.0, "omni_tag:a100": 1000.0, "omni_tag:fast": 1000.0}'
    )
    bad = build_parser().parse_args(["worker", "--address", "head:6379", "--models", "sdxl,bad model", "--dry-run"])
    with pytest.raises(ConfigError, match="invalid model name 'bad model'"):
        worker_command(bad)


@pytest.mark.unit
@given(st.text(max_size=140))
def test_a_model_or_tag_name_is_a_resource_or_a_config_error_naming_it(name: str) -> None:
    try:
        resource = resource_name("tag", name)
    except ConfigError as e:
        assert repr(name) in str(e)
    else:
        assert resource == "omni_tag:" + name and name.isascii() and name[0].isalnum() and " " not in name
        assert declared_resources([], [name]) == {resource: DECLARED_CAPACITY}
