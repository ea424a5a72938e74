"""Deploy config loading: every error names the file and the YAML path."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_runtime.config import load_config, parse_config, with_engine_overrides
from omni_runtime.exceptions import ConfigError
from tests.strategies import ANY_TEXT, JSON_VALUES

FINAL = {"final_output": True, "final_output_type": "image"}


def stage(**kw):
    return {"stage_id": 0, "stage_type": "diffusion", "model": "builtin:tiny-sd", **FINAL, **kw}


def error_of(data, source="deploy.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source)
    return str(info.value)


def test_bundled_configs_load():
    config = load_config("tiny-sd")
    assert config.model == "tiny-sd"
    assert config.stage_args[0].engine_args.max_num_seqs == 4
    assert load_config("echo").stage_args[0].stage_type == "echo"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"stage_args": [stage(engine_args={"max_num_seqs": 0})]},
            "deploy.yaml: stage_args[0].engine_args.max_num_seqs: Expected `int` >= 1, got 0",
        ),
        (
            {"stage_args": [stage(engine_args={"max_num_seqs": "four"})]},
            "deploy.yaml: stage_args[0].engine_args.max_num_seqs: Expected `int`, got `str`",
        ),
        (
            {"stage_args": [stage(engine_args={"request_batch_max_wait_ms": -1})]},
            "deploy.yaml: stage_args[0].engine_args.request_batch_max_wait_ms: Expected `float` >= 0.0, got -1",
        ),
        (
            {"stage_args": [stage(engine_args={"progress_interval_s": 61})]},
            "deploy.yaml: stage_args[0].engine_args.progress_interval_s: Expected `float` <= 60.0, got 61",
        ),
        (
            {"stage_args": [stage(runtime={"num_replicas": 0})]},
            "deploy.yaml: stage_args[0].runtime.num_replicas: Expected `int` >= 1, got 0",
        ),
        ({"stage_args": [stage(bogus=1)]}, "deploy.yaml: stage_args[0].bogus: unknown key"),
        (
            {"stage_args": [stage(engine_args={"max_num_sqes": 2})]},
            "deploy.yaml: stage_args[0].engine_args.max_num_sqes: unknown key",
        ),
        ({"stage_args": []}, "deploy.yaml: stage_args: Expected `array` of length >= 1"),
        ({"stages": []}, "deploy.yaml: stages: unknown key"),
        ({"stage_args": [stage(stage_type="banana")]}, "deploy.yaml: stage_args[0].stage_type: unknown stage_type"),
        ({"stage_args": [stage(final_output_type=None)]}, "stage_args[0].final_output_type"),
        ({"stage_args": [stage(final_output=False)]}, "no stage has final_output: true"),
        ({"stage_args": [stage(), stage()]}, "stage_args[1].stage_id: duplicate stage_id 0"),
        (
            {"stage_args": [stage(engine_input_source=[7])]},
            "stage_args[0].engine_input_source[0]: unknown upstream stage id 7",
        ),
        ({"stage_args": [stage(engine_input_source=[0])]}, "a stage cannot feed itself"),
        (
            {"stage_args": [stage(engine_input_source=[1]), stage(stage_id=1, engine_input_source=[0], **FINAL)]},
            "has a cycle",
        ),
        (
            {"stage_args": [stage(), {"stage_id": 1, "stage_type": "echo"}]},
            "stage_args[1]: stage 1 has no path to a final output",
        ),
        (["not", "a", "mapping"], "expected a mapping"),
    ],
)
def test_config_errors_name_file_and_path(data, expected):
    assert expected in error_of(data)


def test_yaml_file_errors_name_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "stage_args:\n  - stage_id: 0\n    stage_type: echo\n    final_output: true\n"
        "    final_output_type: text\n    engine_args: {max_num_seqs: 0}\n"
    )
    with pytest.raises(ConfigError, match=r"^mine.yaml: stage_args\[0\].engine_args.max_num_seqs"):
        load_config(path)
    path.write_text("stage_args: [unclosed")
    with pytest.raises(ConfigError, match=r"mine\.yaml: not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_model_resolution(tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        load_config("nope")
    with pytest.raises(ConfigError, match="not a diffusers model"):
        load_config(tmp_path)
    (tmp_path / "model_index.json").write_text("{}")
    config = load_config(tmp_path)
    assert config.stage_args[0].stage_type == "diffusion"
    assert config.stage_args[0].model == str(tmp_path.resolve())
    assert config.model == tmp_path.name


def test_step_execution_and_the_quiet_window_are_engine_args():
    config = with_engine_overrides(load_config("tiny-sd"), step_execution=True, batch_quiet_window_ms=12)
    args = config.stage_args[0].engine_args
    assert args.step_execution is True and args.batch_quiet_window_ms == 12
    assert load_config("tiny-sd").stage_args[0].engine_args.step_execution is False  # off by default
    assert load_config("tiny-sd").stage_args[0].engine_args.batch_quiet_window_ms is None  # adaptive
    assert "batch_quiet_window_ms: Expected `float` >= 0" in error_of(
        {"stage_args": [stage(engine_args={"batch_quiet_window_ms": -1})]}
    )
    assert "step_execution: Expected `bool`" in error_of({"stage_args": [stage(engine_args={"step_execution": 1})]})


def test_batch_policy_and_latency_target_are_engine_args():
    args = load_config("tiny-sd").stage_args[0].engine_args
    assert (args.batch_policy, args.slo_ms, args.slo_shed) == ("window", None, False)
    config = with_engine_overrides(load_config("tiny-sd"), batch_policy="learned", slo_ms=500, slo_shed=True)
    args = config.stage_args[0].engine_args
    assert (args.batch_policy, args.slo_ms, args.slo_shed) == ("learned", 500, True)
    assert "engine_args.batch_policy: Invalid enum value 'bigger'" in error_of(
        {"stage_args": [stage(engine_args={"batch_policy": "bigger"})]}
    )
    assert "engine_args.slo_ms: Expected `float` > 0" in error_of({"stage_args": [stage(engine_args={"slo_ms": 0})]})


def test_engine_overrides_apply_to_diffusion_stage():
    config = with_engine_overrides(load_config("tiny-sd"), max_num_seqs=8, request_batch_max_wait_ms=5)
    assert config.stage_args[0].engine_args.max_num_seqs == 8
    assert config.stage_args[0].engine_args.request_batch_max_wait_ms == 5
    with pytest.raises(ConfigError, match="max_num_seqs: Expected `int` >= 1, got 0"):
        with_engine_overrides(config, max_num_seqs=0)
    with pytest.raises(ConfigError, match="unknown engine argument"):
        with_engine_overrides(config, max_seqs=3)


def test_placement_overrides_set_the_runtime_of_the_diffusion_stages_only():
    config = with_engine_overrides(
        load_config("tiny-omni"), devices="cpu", num_replicas=2, torch_threads=1, dtype="float32"
    )
    by_type = {s.stage_type: s for s in config.stage_args}
    diffusion = by_type["diffusion"]
    assert diffusion.runtime.num_replicas == 2 and diffusion.runtime.torch_threads == 1
    assert diffusion.runtime.devices == "cpu" and diffusion.engine_args.dtype == "float32"
    others = [s for s in config.stage_args if s.stage_type != "diffusion"]
    assert others and all(s.runtime.num_replicas == 1 for s in others)
    with pytest.raises(ConfigError, match="num_replicas"):
        with_engine_overrides(config, num_replicas=0)


@given(
    field=st.sampled_from(["default_sampling_params", "runner_args"]),
    value=st.dictionaries(ANY_TEXT, JSON_VALUES, max_size=3),
    name=ANY_TEXT,
)
def test_hostile_yaml_values_are_a_config_error_or_a_config_every_process_can_get(field, value, name):
    """Whatever a YAML file holds, loading it gives a ConfigError naming the path, or a config that
    can be sent to every stage process (never a failure to start a replica)."""
    data = {"model": name, "stage_args": [stage(**{field: value})]}
    try:
        config = parse_config(data, "hostile.yaml")
    except ConfigError as e:
        assert str(e).startswith("hostile.yaml: ")
        return
    msgspec.msgpack.encode(msgspec.to_builtins(config))


def test_an_unencodable_yaml_value_names_its_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "stage_args:\n  - {stage_id: 0, stage_type: echo, final_output: true, final_output_type: text,\n"
        '     runner_args: {note: "half \\ud83d", n: 100000000000000000000000}}\n'
    )
    with pytest.raises(ConfigError, match=r"bad.yaml: stage_args\[0\].runner_args.note: contains U\+D83D"):
        load_config(path)


@pytest.mark.parametrize(
    ("runtime", "backend"),
    [
        ({}, "process"),
        ({"backend": "inproc"}, "inproc"),
        ({"process": False}, "inproc"),
        ({"process": True}, "process"),
    ],
)
def test_runtime_backend_and_its_older_spelling(runtime, backend):
    config = parse_config({"stage_args": [stage(runtime=runtime)]}, "deploy.yaml")
    assert config.stage_args[0].runtime.backend == backend
    assert config.stage_args[0].runtime.process is None  # resolved into backend


def test_a_contradicting_older_spelling_names_the_new_key():
    message = error_of({"stage_args": [stage(runtime={"process": False, "backend": "process"})]})
    assert "stage_args[0].runtime" in message and "keep `backend` only" in message


@pytest.mark.parametrize("depth", [1_200, 20_000])
def test_a_config_nested_past_the_recursion_limit_is_a_config_error(tmp_path, depth):
    """YAML (and the checks after it) walk a document recursively: a deep one raised RecursionError
    out of load_config instead of saying what is wrong with the file."""
    from entrypoints.model_specs import load_models_file

    deep = tmp_path / "deep.yaml"
    deep.write_text("stage_args:\n  - runner_args: " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(ConfigError, match=r"deep\.yaml.*(nested too deeply|not valid YAML)"):
        load_config(deep)
    with pytest.raises(ConfigError, match="models file"):
        load_models_file(deep)
    nested: list = []
    for _ in range(depth):
        nested = [nested]
    with pytest.raises(ConfigError, match=r"nested too deeply|stage_args"):
        parse_config({"stage_args": [{"stage_id": 0, "stage_type": "echo", "runner_args": {"x": nested}}]})
