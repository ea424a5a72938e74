"""``runtime.parallel`` without a process group: the config's checks (each mistake a ConfigError
naming its key, hostile values included), the devices of each rank, and the pure helpers that
cut a denoiser call's rows and join its output (tests/omni_runtime/stage/test_rank_group.py runs
real groups)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.config import ConfigError, parse_config, rank_devices
from omni_runtime.stage.parallel import batch_rows, join_output, slice_rows


def stage(parallel: Any, devices: Any = "cpu", **more: Any) -> dict[str, Any]:
    runtime = {"devices": devices, "parallel": parallel, **more.pop("runtime", {})}
    return {
        "stage_id": 0,
        "stage_type": more.pop("stage_type", "diffusion"),
        "model": "builtin:tiny-sd",
        "runtime": runtime,
        "final_output": True,
        "final_output_type": "image",
        **more,
    }


def refused(entry: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        parse_config({"stage_args": [entry]}, "deploy.yaml")
    return e.value


@pytest.mark.parametrize(
    ("entry", "path", "says"),
    [
        (stage({"cfg_parallel_size": 2}, stage_type="echo"), "runtime.parallel", "diffusion"),
        (stage({"cfg_parallel_size": 2}, runtime={"backend": "inproc"}), "runtime.parallel", "backend: process"),
        (stage({"ring_degree": 2}), "runtime.parallel.ring_degree", "log-sum-exp"),
        (stage({"ulysses_degree": 16, "ring_degree": 2}, "cuda"), "runtime.parallel", "limit of 16"),
        (stage({"cfg_parallel_size": 2}, "cuda:0,cuda:1,cuda:2"), "runtime.devices", "list 2"),
        (stage({"cfg_parallel_size": 2}, "cuda:0,cuda:0"), "runtime.devices", "listed twice"),
        (stage({"cfg_parallel_size": 2}, "cuda"), "runtime.devices", "a GPU of its own"),
        (stage({"cfg_parallel_size": 2}, "cpu,cuda:0"), "runtime.devices", "one kind"),
        (stage({"cfg_parallel_size": 2}, "tpu:0,tpu:1"), "runtime.devices", "cpu or cuda"),
        (stage({"cfg_parallel_size": 2}, ",cpu"), "runtime.devices", "cpu or cuda"),
        (stage({"cfg_parallel_size": 2}, engine_args={"torch_compile": True}), "engine_args.torch_compile", "trace"),
        (stage({"cfg_parallel_size": 2}, engine_args={"cache": {"type": "first_block"}}), "engine_args.cache", "rows"),
    ],
)
def test_a_group_that_cannot_run_is_refused_at_load_naming_its_key(entry, path, says) -> None:
    error = refused(entry)
    assert f"stage_args[0].{path}" in str(error) and says in str(error), str(error)


@pytest.mark.parametrize(
    ("parallel", "key"),
    [
        ({"cfg_parallel_size": 3}, "cfg_parallel_size"),
        ({"ulysses_degree": 0}, "ulysses_degree"),
        ({"ulysses_degree": True}, "ulysses_degree"),
        ({"ring_degree": 2**70}, "ring_degree"),
        ({"collective_timeout_s": float("nan")}, "collective_timeout_s"),
        ({"collective_timeout_s": 0}, "collective_timeout_s"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ("2", "parallel"),
    ],
)
def test_a_bad_degree_is_refused_naming_it(parallel, key) -> None:
    assert key in str(refused(stage(parallel)))


def test_each_replica_takes_its_ranks_devices_in_order() -> None:
    config = parse_config(
        {"stage_args": [stage({"cfg_parallel_size": 2}, "cuda:0, cuda:1,cuda:2,cuda:3", runtime={"num_replicas": 2})]}
    )
    runtime = config.stage_args[0].runtime
    assert rank_devices(runtime, 0) == ["cuda:0", "cuda:1"] and rank_devices(runtime, 1) == ["cuda:2", "cuda:3"]
    shared = parse_config({"stage_args": [stage({"ulysses_degree": 2})]}).stage_args[0].runtime
    assert rank_devices(shared, 0) == ["cpu", "cpu"]


degrees = st.one_of(st.integers(-3, 20), st.sampled_from([2**64, 1.5, "2", None, True]))


@settings(max_examples=150, deadline=None, database=None)
@given(
    ulysses=degrees,
    ring=degrees,
    cfg=degrees,
    devices=st.one_of(
        st.sampled_from(["cpu", "cuda", "cuda:0,cuda:1", "cpu,cpu,cpu,cpu", "\ud800"]), st.text(max_size=12)
    ),
    replicas=st.integers(1, 3),
)
def test_any_parallel_section_loads_consistent_or_is_a_config_error(ulysses, ring, cfg, devices, replicas) -> None:
    parallel = {
        k: v
        for k, v in (("ulysses_degree", ulysses), ("ring_degree", ring), ("cfg_parallel_size", cfg))
        if v is not None
    }
    try:
        config = parse_config(
            {"stage_args": [stage(parallel, devices, runtime={"num_replicas": replicas})]}, "deploy.yaml"
        )
    except ConfigError as e:
        assert "stage_args[0]" in str(e)
        return
    runtime = config.stage_args[0].runtime
    assert runtime.parallel is not None
    world = runtime.parallel.world_size
    assert 1 <= world <= 16
    for replica in range(replicas):
        ranks = rank_devices(runtime, replica)
        assert len(ranks) == world and all(d.split(":")[0] in ("cpu", "cuda") for d in ranks)


# ----------------------------------------------------------------------------- rows


def test_the_rows_of_a_call_are_those_of_its_latents() -> None:
    assert batch_rows((torch.zeros(4, 3),), {}) == 4
    assert batch_rows((), {"hidden_states": torch.zeros(6, 2)}) == 6
    assert batch_rows((), {"sample": torch.zeros(2, 4, 8, 8)}) == 2
    assert batch_rows((), {"timestep": torch.zeros(3)}) is None


def test_a_share_of_rows_cuts_every_per_row_tensor_and_nothing_else() -> None:
    rows = 4
    kwargs = {
        "hidden_states": torch.arange(rows * 2).reshape(rows, 2),
        "timestep": torch.tensor(7.0),  # one for all: kept
        "encoder_hidden_states": torch.ones(rows, 3, 5),
        "added_cond_kwargs": {"text_embeds": torch.arange(rows), "time_ids": torch.zeros(rows, 6)},
        "img_ids": torch.zeros(rows, 3),  # a position table, however many tokens it has
        "return_dict": False,
        "attention_mask": None,
        "pair": (torch.arange(rows), torch.zeros(5)),
    }
    cut = slice_rows(kwargs, rows, 2, 4)
    assert cut["hidden_states"].tolist() == [[4, 5], [6, 7]]
    assert cut["timestep"].item() == 7.0 and cut["encoder_hidden_states"].shape == (2, 3, 5)
    assert cut["added_cond_kwargs"]["text_embeds"].tolist() == [2, 3]
    assert cut["added_cond_kwargs"]["time_ids"].shape == (2, 6)
    assert cut["img_ids"].shape == (rows, 3)
    assert cut["return_dict"] is False and cut["attention_mask"] is None
    assert cut["pair"][0].tolist() == [2, 3] and cut["pair"][1].shape == (5,)


def test_the_joined_output_keeps_its_form() -> None:
    def twice(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t])

    part = torch.ones(2, 3)
    assert join_output(part, twice).shape == (4, 3)
    joined = join_output((part, "extra"), twice)
    assert joined[0].shape == (4, 3) and joined[1] == "extra"
    assert join_output(SimpleNamespace(sample=part), twice).sample.shape == (4, 3)
    with pytest.raises(TypeError, match="cannot join"):
        join_output({"sample": part}, twice)
