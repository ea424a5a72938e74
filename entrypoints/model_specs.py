"""What to serve: each model's spec (its config, the name it is served under, its admission limit,
whether it loads lazily and how the budget evicts it), read from ``--model`` arguments or a models
file, and the states a served model goes through. Nothing here imports an engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import yaml

from omni_runtime.config import DeployConfig
from omni_runtime.exceptions import ConfigError
from omni_runtime.resolve import ResolvedConfig

__all__ = [
    "EvictMode",
    "ModelCounts",
    "ModelSource",
    "ModelSpec",
    "ModelState",
    "load_models_file",
    "parse_model_arg",
]

#: Where a model is in its life: unloaded (lazy and not asked for yet, or stopped by the budget:
#: no processes), loading (its stages start, or wake up), loaded (serving), asleep (evicted by the
#: budget: weights released, processes kept), failed (its load raised; ``error`` says why), dead
#: (its engine died for good), closed. A request for an unloaded or asleep model brings it back.
#: unplaced is reported (by :meth:`ServedModel.status`) for a loaded model while no node can host
#: one of its stages (on Ray, its declaring workers are gone): its requests fail at once until a
#: node takes it again.
ModelState = Literal["unloaded", "loading", "loaded", "asleep", "failed", "dead", "closed", "unplaced"]

#: How the budget evicts a model: ``sleep`` (runners release their weights, the stage processes
#: stay: the cheaper way back for models whose processes are slow to start) or ``stop`` (the engine
#: closes: all its memory and processes go; the way back is a cold load).
EvictMode = Literal["sleep", "stop"]

ModelSource = str | Path | DeployConfig | ResolvedConfig


class ModelCounts(msgspec.Struct, kw_only=True, frozen=True):
    """A model's state and what the budget did to it so far (``MultiOmni.counts``)."""

    state: ModelState
    loads: int
    wakes: int
    evictions: int
    #: Weight bytes its runners reported resident when last loaded (None: none reported).
    resident_bytes: int | None


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model to serve: where its config comes from, the name it is served under (None: the
    config's ``model:``), and its own admission limit (None: the server-wide one)."""

    source: ModelSource
    name: str | None = None
    max_pending: int | None = None
    #: Loaded on its first request instead of at start.
    lazy: bool = False
    #: How the budget evicts it (see :data:`EvictMode`).
    evict: EvictMode = "sleep"


def parse_model_arg(arg: str) -> ModelSpec:
    """``NAME=CONFIG`` (served as NAME) or ``CONFIG`` (served under the config's own name); an
    existing path containing ``=`` is a path. A trailing ``@lazy`` loads it on its first request;
    ``@stop`` makes the budget stop it rather than put it to sleep (``@lazy@stop`` both)."""
    lazy = evict_stop = False
    while not Path(arg).exists():
        if arg.endswith("@lazy"):
            arg, lazy = arg[: -len("@lazy")], True
        elif arg.endswith("@stop"):
            arg, evict_stop = arg[: -len("@stop")], True
        else:
            break
    evict: EvictMode = "stop" if evict_stop else "sleep"
    name, sep, source = arg.partition("=")
    if not sep or Path(arg).exists() or not name or "/" in name:
        return ModelSpec(source=arg, lazy=lazy, evict=evict)
    return ModelSpec(source=source, name=name, lazy=lazy, evict=evict)


def load_models_file(path: str | Path) -> list[ModelSpec]:
    """The models of a models file: a YAML mapping of served name to a config (a bundled name, a
    deploy YAML or a model dir, relative paths from the file's folder), or to a mapping with
    ``config`` and optional ``max_pending``, ``lazy`` (bool) and ``evict`` (``sleep`` or
    ``stop``). ConfigError naming the entry otherwise."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the models file: {e}", source=str(path)) from None
    except RecursionError:
        raise ConfigError("cannot read the models file: nested too deeply", source=str(path)) from None
    if not isinstance(data, dict) or not data:
        raise ConfigError("expected a mapping of model name to config", source=str(path))
    specs: list[ModelSpec] = []
    for name, entry in data.items():
        where = f"{name}"
        if isinstance(entry, str):
            entry = {"config": entry}
        if not isinstance(name, str) or not isinstance(entry, dict) or not isinstance(entry.get("config"), str):
            raise ConfigError("expected `NAME: CONFIG` or `NAME: {config: CONFIG, max_pending: N}`", path=where,
                              source=str(path))  # fmt: skip
        unknown = set(entry) - {"config", "max_pending", "lazy", "evict"}
        if unknown:
            raise ConfigError(f"unknown field `{sorted(unknown)[0]}`", path=where, source=str(path))
        limit = entry.get("max_pending")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ConfigError(f"expected int >= 1, got {limit!r}", path=f"{where}.max_pending", source=str(path))
        lazy = entry.get("lazy", False)
        if not isinstance(lazy, bool):
            raise ConfigError(f"expected true or false, got {lazy!r}", path=f"{where}.lazy", source=str(path))
        evict = entry.get("evict", "sleep")
        if evict not in ("sleep", "stop"):
            raise ConfigError(f"expected sleep or stop, got {evict!r}", path=f"{where}.evict", source=str(path))
        config = entry["config"]
        local = path.parent / config
        source = str(local) if local.exists() else config
        specs.append(ModelSpec(source=source, name=name, max_pending=limit, lazy=lazy, evict=evict))
    return specs
