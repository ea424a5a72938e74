"""The resolve pass: a DeployConfig made ready to run, every mistake found at load.

Decoding (:mod:`omni_runtime.config`) checks shapes and ranges. Resolving checks what needs more
than the file: that each ``stage_type`` names a runner, that ``default_sampling_params`` are
valid params of that runner, that ``custom_process_input_func`` imports, that a model the runner
needs is named and exists. It reports every such error at once, each naming its YAML path, and
gives the engine what it needs per stage (:class:`ResolvedStage`), so that nothing later checks
again and no request fails for what the file got wrong. ``omni-runtime validate`` runs it too.

Builtin stage types are resolved without importing their runners (torch and diffusers have no
place in a process that only routes); a custom ``module:Class`` is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from omni_runtime.backend_registry import backend_class
from omni_runtime.config import DeployConfig, StageConfig
from omni_runtime.exceptions import ConfigError, InvalidRequestError
from omni_runtime.models.builtin import builders, builtin_names
from omni_runtime.models.families import import_family_modules
from omni_runtime.params import DiffusionSamplingParams, params_to_dict, resolve_params
from omni_runtime.stage.runners.base import runner_class
from omni_runtime.stage.runners.stage_types import stage_type


@dataclass(frozen=True)
class ResolvedStage:
    """One stage as the engine runs it."""

    config: StageConfig
    #: The sampling-params class requests to this stage are validated with.
    params_cls: type[msgspec.Struct]
    #: ``default_sampling_params``, validated: the fields that are set.
    defaults: dict[str, Any]
    #: ``custom_process_input_func``, imported (None: the default mapping).
    input_func: Callable[..., dict[str, Any]] | None
    #: What the runner class declares it can take in one forward (None: no limit of its own).
    max_batch_size: int | None

    @property
    def stage_id(self) -> int:
        return self.config.stage_id

    @property
    def takes_image_params(self) -> bool:
        """Whether it takes diffusion params (seed, size, steps...): a diffusion stage, or a
        stage of a split pipeline (its text encoder takes the negative prompt)."""
        return issubclass(self.params_cls, DiffusionSamplingParams)

    def takes(self, field: str) -> bool:
        return field in self.params_cls.__struct_fields__ or not self.params_cls.__struct_config__.forbid_unknown_fields


@dataclass(frozen=True)
class ResolvedConfig:
    """A deploy config and its resolved stages, in ``stage_args`` order."""

    config: DeployConfig
    stages: tuple[ResolvedStage, ...]

    def stage(self, stage_id: int) -> ResolvedStage:
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise KeyError(stage_id)

    def sampling_params(
        self, *, image: dict[str, Any] | None = None, shared: dict[str, Any] | None = None
    ) -> list[dict[str, Any] | None]:
        """One params entry per stage (None = the stage's defaults): ``image`` params go to every
        stage that takes image params, and each ``shared`` field to every stage that has it.
        Unset (None) values are left out. What the HTTP routes and the CLI build requests with."""
        image = {k: v for k, v in (image or {}).items() if v is not None}
        shared = {k: v for k, v in (shared or {}).items() if v is not None}
        entries: list[dict[str, Any] | None] = []
        for stage in self.stages:
            entry = dict(image) if stage.takes_image_params else {}
            entry.update({k: v for k, v in shared.items() if stage.takes(k)})
            entries.append(entry or None)
        return entries


def resolve_config(config: DeployConfig, source: str = "<config>") -> ResolvedConfig:
    """Resolve every stage; raise one ConfigError listing every mistake (``.errors`` holds each)."""
    errors: list[ConfigError] = []
    stages = []
    for i, stage in enumerate(config.stage_args):
        found: list[ConfigError] = []
        resolved = _resolve_stage(stage, f"stage_args[{i}]", source, found)
        errors.extend(found)
        if resolved is not None:
            stages.append(resolved)
    # What a backend checks across its stages (the ray stages must join one cluster).
    for name in dict.fromkeys(s.runtime.backend_name for s in config.stage_args):
        mine = [s for s in config.stage_args if s.runtime.backend_name == name]
        errors.extend(ConfigError(m, path="stage_args", source=source) for m in backend_class(name).check_stages(mine))
    if errors:
        raise ConfigError.of(errors, source=source)
    return ResolvedConfig(config, tuple(stages))


def config_errors(config: DeployConfig, source: str = "<config>") -> list[ConfigError]:
    """Every resolve error of ``config`` (empty: it is ready to run)."""
    try:
        resolve_config(config, source)
    except ConfigError as e:
        return list(e.errors)
    return []


def _resolve_stage(stage: StageConfig, at: str, source: str, errors: list[ConfigError]) -> ResolvedStage | None:
    def fail(path: str, message: str) -> None:
        errors.append(ConfigError(message, path=f"{at}.{path}", source=source))

    # 1) the runner: a builtin's facts from the table, a custom one imported
    builtin = stage_type(stage.stage_type)
    if builtin is not None:
        params_cls, needs_model, max_batch = builtin.params_cls, builtin.needs_model, builtin.max_batch_size
        try:  # a stage type whose runner_args choose its params (an external program's)
            params_cls = builtin.params_for(stage.runner_args)
        except ConfigError as e:
            fail(f"runner_args.{e.path}" if e.path else "runner_args", str(e).removeprefix(f"{e.path}: "))
            return None
    else:
        try:
            cls = runner_class(stage.stage_type)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            fail("stage_type", f"cannot load the runner {stage.stage_type!r}: {type(e).__name__}: {e}")
            return None
        params_cls, needs_model, max_batch = cls.params_cls, cls.needs_model, cls.max_batch_size
    # 2) default_sampling_params are params of that runner
    defaults: dict[str, Any] = {}
    try:
        defaults = params_to_dict(resolve_params(params_cls, {}, stage.default_sampling_params, fill=False))
    except InvalidRequestError as e:
        where = f"default_sampling_params.{e.param}" if e.param else "default_sampling_params"
        message = str(e).removeprefix("invalid sampling param ").removeprefix(f"`{e.param}`: ")
        fail(where, "unknown key" if "unknown field" in message else message)
    # 3) the input function imports
    func = None
    if stage.custom_process_input_func:
        try:
            func = _import_function(stage.custom_process_input_func)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            fail("custom_process_input_func", f"cannot import {stage.custom_process_input_func!r}: {e}")
    # 4) a model the runner needs is named and there
    if stage.model is None:
        if needs_model:
            fail("model", f"a {stage.stage_type} stage needs `model:` (a local model directory or builtin:<name>)")
    else:
        families = (stage.runner_args.get("families") or []) if stage.stage_type == "diffusion" else []
        try:  # model families registered from outside the package name their builtins too
            import_family_modules(families)
        except ImportError as e:
            fail("runner_args.families", f"cannot import {families!r}: {e}")
        problem = _model_problem(stage.model)
        if problem:
            fail("model", problem)
    if errors:
        return None
    return ResolvedStage(stage, params_cls, defaults, func, max_batch)


def _import_function(spec: str) -> Callable[..., Any]:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError("expected module:function")
    func = getattr(importlib.import_module(module), name)
    if not callable(func):
        raise TypeError(f"{spec} is not callable")
    return func


def _model_problem(spec: str) -> str | None:
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in builders():
            return f"unknown builtin model {name!r}; expected one of {', '.join(builtin_names())}"
        return None
    if not Path(spec).expanduser().exists():
        return (
            f"model directory not found: {spec} (models are loaded from local directories; "
            "use builtin:<name> for a bundled tiny model)"
        )
    return None
