"""A ``subprocess`` stage's ``runner_args`` checked at load, each mistake a ConfigError naming its
YAML path; its argv templates (plain ``{name}`` placeholders only, a value one argument); the params
class its ``params:`` chooses, and so what the task layer says the model serves (text2speech for
the bundled espeak); the speed range of a speech stage checked before queueing."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrypoints.capabilities import ModelCapabilities
from omni_runtime.config import load_config, parse_config
from omni_runtime.exceptions import ConfigError, InvalidRequestError
from omni_runtime.external import fill, placeholders, program_args
from omni_runtime.messages import SpeechBound, StageConstraints
from omni_runtime.params import GenericSamplingParams, SpeechSamplingParams, check_constraints
from omni_runtime.resolve import config_errors, resolve_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def stage(**runner_args: Any) -> dict[str, Any]:
    args = {"argv": ["prog", "{output}"], "outputs": [{"path": "out.txt"}], **runner_args}
    return {
        "stage_id": 0,
        "stage_type": "subprocess",
        "final_output": True,
        "final_output_type": "text",
        "runner_args": args,
    }


def errors(**runner_args: Any) -> list[str]:
    return [str(e) for e in config_errors(parse_config({"stage_args": [stage(**runner_args)]}, "x.yaml"), "x.yaml")]


def test_placeholders_are_plain_names_and_a_value_is_one_argument() -> None:
    assert placeholders("--voice={voice}") == ["voice"]
    assert placeholders("{{literal}} {a}{b}") == ["a", "b"]
    assert fill("--opt={a} {{x}}", {"a": "1 2; rm -rf / $(x)"}) == "--opt=1 2; rm -rf / $(x) {x}"
    for bad in ("{a.b}", "{a[0]}", "{0}", "{a!r}", "{a:>4}", "{}", "{a"):
        with pytest.raises(ValueError):
            placeholders(bad)


@given(st.text(max_size=30))
def test_fill_puts_any_value_in_as_it_is(value: str) -> None:
    assert fill("{v}", {"v": value}) == value
    assert fill("x={v}", {"v": value}) == "x=" + value


@pytest.mark.parametrize(
    ("runner_args", "where"),
    [
        ({"argv": ["prog", "{a.b}"]}, "stage_args[0].runner_args.argv[1]"),
        ({"argv": ["prog", "{prompt}"]}, "stage_args[0].runner_args.argv[1]"),
        ({"argv": ["{python}"]}, "stage_args[0].runner_args.argv[0]"),
        ({"argv": []}, "stage_args[0].runner_args.argv"),
        ({"outputs": [{"path": "../escape.txt"}]}, "stage_args[0].runner_args.outputs[0].path"),
        ({"outputs": [{"path": "/tmp/abs.txt"}]}, "stage_args[0].runner_args.outputs[0].path"),
        ({"outputs": [{"path": "out.xyz"}]}, "stage_args[0].runner_args.outputs[0].kind"),
        ({"outputs": [{"name": "workdir", "path": "a.txt"}]}, "stage_args[0].runner_args.outputs[0].name"),
        ({"timeout_s": 0}, "stage_args[0].runner_args.timeout_s"),
        ({"shell": True}, "stage_args[0].runner_args.shell"),
        ({"cwd": "relative"}, "stage_args[0].runner_args.cwd"),
        ({"voices": {"a": "b"}}, "stage_args[0].runner_args.params"),
        ({"params": "speech"}, "stage_args[0].runner_args.outputs"),
        (
            {"params": "speech", "outputs": [{"path": "o.wav"}]},
            "stage_args[0].runner_args.seconds_per_char",
        ),
        (
            {"params": "speech", "outputs": [{"path": "o.wav"}], "seconds_per_char": 0.1, "argv": ["p", "{pitch}"]},
            "stage_args[0].runner_args.argv",
        ),
        # What no process can be started with: each failed every request, at its start.
        ({"argv": ["prog", "a\x00b"]}, "stage_args[0].runner_args.argv[1]"),
        ({"env": {"A=B": "x"}}, "stage_args[0].runner_args.env.A=B"),
        ({"env": {"": "x"}}, "stage_args[0].runner_args.env."),
        ({"env": {"A": "x\x00"}}, "stage_args[0].runner_args.env.A"),
        ({"cwd": "/tmp/\x00"}, "stage_args[0].runner_args.cwd"),
        # A key of the wrong type: the mapping's path (it was runner_args alone).
        ({"env": {1: "x"}}, "stage_args[0].runner_args.env"),
        # An infinite rate: round(scale x speed) raised on every request.
        *(
            (
                {
                    "params": "speech",
                    "outputs": [{"path": "o.wav"}],
                    "seconds_per_char": 0.1,
                    "argv": ["p", "{rate}"],
                    "speed": {"placeholder": "rate", "scale": 1.0, "min": 1.0, "max": 2.0, field: value},
                },
                f"stage_args[0].runner_args.speed.{field}",
            )
            for field in ("scale", "min", "max")
            for value in (math.inf, 1e308)
        ),
    ],
)
def test_a_mistake_is_a_config_error_naming_its_path(runner_args: dict[str, Any], where: str) -> None:
    (error,) = errors(**runner_args)
    assert error.startswith(f"x.yaml: {where}: "), error


def worker_errors(**runner_args: Any) -> list[str]:
    data = {**stage(**runner_args), "stage_type": "worker"}
    return [str(e) for e in config_errors(parse_config({"stage_args": [data]}, "x.yaml"), "x.yaml")]


@pytest.mark.parametrize(
    ("runner_args", "where"),
    [
        ({"argv": ["prog", "{output}"]}, "argv[1]"),  # started once: no request's values
        ({"argv": ["prog", "{voice}"]}, "argv[1]"),
        ({"argv": ["prog"], "prompt": "file"}, "prompt"),
        ({"argv": ["prog"], "startup_timeout_s": 0}, "startup_timeout_s"),
    ],
)
def test_a_worker_stage_takes_its_own_keys(runner_args: dict[str, Any], where: str) -> None:
    (error,) = worker_errors(**runner_args)
    assert error.startswith(f"x.yaml: stage_args[0].runner_args.{where}: "), error
    assert not worker_errors(argv=["prog", "--flag"], startup_timeout_s=5, restart_backoff_s=1)
    # A subprocess stage does not take a worker's keys.
    assert "unknown key" in errors(startup_timeout_s=5)[0]


def test_the_example_worker_config_resolves() -> None:
    config = load_config(REPO / "examples" / "external_worker" / "worker.yaml")
    assert resolve_config(config).stages[0].params_cls is GenericSamplingParams


def test_params_choose_the_params_class_and_so_the_tasks() -> None:
    generic = resolve_config(parse_config({"stage_args": [stage(argv=["prog", "{anything}"])]}))
    assert generic.stages[0].params_cls is GenericSamplingParams
    assert "text2speech" not in ModelCapabilities.of(generic).tasks
    espeak = resolve_config(load_config("espeak"))
    assert espeak.stages[0].params_cls is SpeechSamplingParams
    capabilities = ModelCapabilities.of(espeak)
    assert "text2speech" in capabilities.tasks and capabilities.stage("text2speech") == 0


def test_the_bundled_espeak_maps_voices_and_speed() -> None:
    args = program_args(load_config("espeak").stage_args[0].runner_args)
    assert args.argv[0] == "espeak-ng" and args.params == "speech" and args.prompt == "stdin"
    assert args.voices["alloy"] == "en-us" and next(iter(args.voices)) == "alloy"
    assert args.speed is not None and (args.speed.scale, args.speed.min, args.speed.max) == (175, 80, 450)


def test_a_speed_outside_the_stage_range_is_refused_before_queueing() -> None:
    bound = SpeechBound(max_seconds=60, token_frames=750, frame_s=0.001, tokens_per_char=1, speeds=(0.5, 2.5))
    limits = StageConstraints(voices=("alloy",), speech=bound)
    check_constraints({"speed": 2.5, "voice": "alloy"}, limits)
    for speed in (0.25, 2.6):
        with pytest.raises(InvalidRequestError) as e:
            check_constraints({"speed": speed}, limits)
        assert e.value.param == "speed"
    with pytest.raises(ConfigError):
        program_args({"argv": ["p"], "params": "speech"})
