"""The resolve pass: every mistake of a deploy config found at load, all of them at once, each
naming its YAML path; and what the engine gets per stage."""

from __future__ import annotations

import pytest

from omni_runtime.config import load_config, parse_config
from omni_runtime.exceptions import ConfigError
from omni_runtime.params import DiffusionSamplingParams, EchoSamplingParams, GenericSamplingParams
from omni_runtime.resolve import config_errors, resolve_config
from omni_runtime.stage.runners.base import runner_class
from omni_runtime.stage.runners.stage_types import stage_types


def stage(sid: int = 0, **kw: object) -> dict:
    base = {"stage_id": sid, "stage_type": "echo", "final_output": True, "final_output_type": "text"}
    return {**base, **kw}


def errors(*stages: dict) -> list[str]:
    return [str(e) for e in config_errors(parse_config({"stage_args": list(stages)}, "deploy.yaml"), "deploy.yaml")]


def test_a_typo_in_default_sampling_params_is_refused_at_load():
    """It used to load, then fail every request with a 400."""
    assert errors(stage(default_sampling_params={"delay_msx": 5})) == [
        "deploy.yaml: stage_args[0].default_sampling_params.delay_msx: unknown key"
    ]
    [bad_value] = errors(stage(default_sampling_params={"delay_ms": -1}))
    assert bad_value.startswith("deploy.yaml: stage_args[0].default_sampling_params.delay_ms: ")


def test_a_runner_or_input_function_that_does_not_import_is_refused_at_load():
    [runner] = errors(stage(stage_type="no.such:Runner"))
    assert runner.startswith("deploy.yaml: stage_args[0].stage_type: cannot load the runner 'no.such:Runner'")
    [not_a_runner] = errors(stage(stage_type="omni_runtime.params:EchoSamplingParams"))
    assert "is not a StageRunner subclass" in not_a_runner
    [func] = errors(
        stage(0, final_output=False, final_output_type=None),
        stage(1, engine_input_source=[0], custom_process_input_func="tests.helpers:no_such_function"),
    )
    assert func.startswith("deploy.yaml: stage_args[1].custom_process_input_func: cannot import")


def test_models_are_named_and_exist(tmp_path):
    assert errors(stage(stage_type="diffusion", final_output_type="image")) == [
        "deploy.yaml: stage_args[0].model: a diffusion stage needs `model:` (a local model directory or builtin:<name>)"
    ]
    [missing] = errors(stage(stage_type="diffusion", final_output_type="image", model=str(tmp_path / "nope")))
    assert "stage_args[0].model: model directory not found" in missing
    [unknown] = errors(stage(stage_type="text", model="builtin:tiny-gpt"))
    assert "unknown builtin model 'tiny-gpt'" in unknown
    assert errors(stage(stage_type="diffusion", final_output_type="image", model="builtin:tiny-sd")) == []


def test_every_error_of_every_stage_is_reported_at_once():
    source = [
        stage(0, stage_type="diffusion", final_output=False, final_output_type=None, default_sampling_params={"x": 1}),
        stage(1, engine_input_source=[0], stage_type="no.such:Runner"),
    ]
    with pytest.raises(ConfigError) as err:
        resolve_config(parse_config({"stage_args": source}, "deploy.yaml"), "deploy.yaml")
    assert len(err.value.errors) == 3  # stage 0: its params and its model; stage 1: its runner
    assert str(err.value).startswith("deploy.yaml: 3 errors:\n  deploy.yaml: stage_args[0]")


def test_decoding_reports_a_broken_key_in_each_stage():
    data = {"stage_args": [stage(0, engine_args={"max_num_seqs": 0}), stage(1, runtime={"num_replicas": "two"})]}
    with pytest.raises(ConfigError) as err:
        parse_config(data, "deploy.yaml")
    paths = [e.path for e in err.value.errors]
    assert paths == ["stage_args[0].engine_args.max_num_seqs", "stage_args[1].runtime.num_replicas"]


def test_builtin_runner_facts_agree_with_the_runner_classes():
    # The core stage types and those the families bring (the SD split stages).
    assert {"diffusion", "text", "echo", "sd_text_encoder", "sd_denoise", "sd_vae_decode"} <= set(stage_types())
    for name, spec in stage_types().items():
        cls = runner_class(name)
        assert (cls.params_cls, cls.needs_model, cls.max_batch_size) == (
            spec.params_cls,
            spec.needs_model,
            spec.max_batch_size,
        ), name


def test_what_the_engine_gets_per_stage():
    resolved = resolve_config(load_config("tiny-sd-split"))
    assert [s.takes_image_params for s in resolved.stages] == [True, True, True]
    params = resolved.sampling_params(image={"seed": 3, "height": None}, shared={"timeout": 5, "max_tokens": 9})
    assert params == [{"seed": 3, "timeout": 5}] * 3  # max_tokens is no diffusion param; None left out
    omni = resolve_config(load_config("tiny-omni"))
    text, image = omni.stages
    assert text.params_cls.__name__ == "TextSamplingParams" and image.params_cls is DiffusionSamplingParams
    assert omni.sampling_params(image={"seed": 1}, shared={"max_tokens": 8}) == [{"max_tokens": 8}, {"seed": 1}]
    echo = resolve_config(load_config("echo")).stages[0]
    assert echo.params_cls is EchoSamplingParams and echo.input_func is None


def test_a_custom_runner_without_params_of_its_own_takes_every_shared_field():
    custom = stage(stage_type="tests.reliability.runners:AnyParamsRunner", default_sampling_params={"style": "ink"})
    [resolved] = resolve_config(parse_config({"stage_args": [custom]})).stages
    assert resolved.params_cls is GenericSamplingParams and resolved.defaults == {"style": "ink"}
    assert resolved.takes("anything")
