"""MultiOmni: several named models, each its own :class:`AsyncOmni`, behind one asyncio API.
Runs in the caller's event loop; each model's engine runs its own orchestrator and stages.

``AsyncOmni`` stays a one-model object. What serves many holds one per model and routes by
name: every call takes ``model=`` (optional when one model is served). Each model keeps its own
engine, queues, batching and admission limit (``max_pending``), so one model's overload (429),
failed load or death fails that model's requests only, with a typed error naming it, while the
others serve. The HTTP server holds one of these; tests drive it without HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from omni_runtime.config import DeployConfig
from omni_runtime.exceptions import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    ModelUnavailableError,
    UnknownModelError,
)
from omni_runtime.messages import RpcReplicaResult
from omni_runtime.outputs import OmniRequestOutput
from omni_runtime.resolve import ResolvedConfig

from .async_omni import AsyncOmni, EngineHealth, ValidRequest, load_resolved

__all__ = ["ModelSpec", "ModelState", "MultiOmni", "ServedModel", "load_models_file", "parse_model_arg"]

#: Where a model is in its life: loading (its stages start), loaded (serving), failed (its load
#: raised; ``error`` says why), dead (its engine died for good), closed; unplaced is reported (by
#: :meth:`ServedModel.status`) for a loaded model while no node can host one of its stages (on Ray,
#: its declaring workers are gone): its requests fail at once until a node takes it again.
ModelState = Literal["loading", "loaded", "failed", "dead", "closed", "unplaced"]

ModelSource = str | Path | DeployConfig | ResolvedConfig


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model to serve: where its config comes from, the name it is served under (None: the
    config's ``model:``), and its own admission limit (None: the server-wide one)."""

    source: ModelSource
    name: str | None = None
    max_pending: int | None = None


def parse_model_arg(arg: str) -> ModelSpec:
    """``NAME=CONFIG`` (served as NAME) or ``CONFIG`` (served under the config's own name); an
    existing path containing ``=`` is a path."""
    name, sep, source = arg.partition("=")
    if not sep or Path(arg).exists() or not name or "/" in name:
        return ModelSpec(source=arg)
    return ModelSpec(source=source, name=name)


def load_models_file(path: str | Path) -> list[ModelSpec]:
    """The models of a models file: a YAML mapping of served name to a config (a bundled name, a
    deploy YAML or a model dir, relative paths from the file's folder), or to a mapping with
    ``config`` and optional ``max_pending``. ConfigError naming the entry otherwise."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the models file: {e}", source=str(path)) from None
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
        unknown = set(entry) - {"config", "max_pending"}
        if unknown:
            raise ConfigError(f"unknown field `{sorted(unknown)[0]}`", path=where, source=str(path))
        limit = entry.get("max_pending")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ConfigError(f"expected int >= 1, got {limit!r}", path=f"{where}.max_pending", source=str(path))
        config = entry["config"]
        local = path.parent / config
        specs.append(ModelSpec(source=str(local) if local.exists() else config, name=name, max_pending=limit))
    return specs


class ServedModel:
    """One named model of a :class:`MultiOmni`: its config, its engine once loaded, its state."""

    def __init__(self, name: str, resolved: ResolvedConfig, max_pending: int | None) -> None:
        self.name = name
        self.resolved = resolved
        self.config = resolved.config
        self.max_pending = max_pending
        self.state: ModelState = "loading"
        #: Why it failed or died, or None.
        self.error: BaseException | None = None
        self.engine: AsyncOmni | None = None
        finals = [s for s in self.config.stage_args if s.final_output]
        self.image_stage = next((s.stage_id for s in finals if s.final_output_type == "image"), None)
        self.video_stage = next((s.stage_id for s in finals if s.final_output_type == "video"), None)
        self.audio_stage = next((s.stage_id for s in finals if s.final_output_type == "audio"), None)
        #: What it makes: its final stages' output types (image, video, audio, text).
        self.kinds = sorted({s.final_output_type for s in finals if s.final_output_type})

    def health(self) -> EngineHealth | None:
        """Its engine's health, or None while it has no engine (loading, failed)."""
        return self.engine.health() if self.engine is not None else None

    def unplaced(self) -> str | None:
        """Why this loaded model cannot serve now because no node can host one of its stages
        (a stage without a live replica whose restart waits for a node), or None."""
        h = self.health() if self.state == "loaded" else None
        if h is None:
            return None
        return next((s.unplaced for s in h.stages if s.live_replicas == 0 and s.unplaced), None)

    def status(self) -> ModelState:
        """Its state as reported: ``unplaced`` while :meth:`unplaced`, else :attr:`state`."""
        return "unplaced" if self.unplaced() is not None else self.state

    def unavailable(self) -> ModelUnavailableError:
        return ModelUnavailableError(self.name, self.state, str(self.error) if self.error is not None else None)


class MultiOmni:
    """Several named models behind one API: ``async for out in multi.generate(prompt, model="x")``.

    ``models``: specs, or sources (a bundled config name, deploy YAML, model dir, DeployConfig),
    each served under its config's ``model:`` name unless its spec names it; a name served twice
    is a ConfigError. Every config is validated in the constructor (ConfigError at once);
    :meth:`start` loads all models concurrently and returns once each is ``loaded`` or
    ``failed`` (a failed load never raises: that model's requests fail with
    :class:`ModelUnavailableError`). ``max_pending`` is each model's admission limit unless its
    spec sets one; the keyword engine args apply to every model.
    """

    def __init__(
        self,
        models: Sequence[ModelSpec | ModelSource],
        *,
        max_pending: int | None = None,
        default_timeout: float | None = None,
        ray_address: str | None = None,
        **engine_args: Any,
    ) -> None:
        self._default_timeout = default_timeout
        self.models: dict[str, ServedModel] = {}
        for item in models:
            spec = item if isinstance(item, ModelSpec) else ModelSpec(source=item)
            resolved = load_resolved(spec.source, dict(engine_args), ray_address)
            name = spec.name or resolved.config.model or "omni"
            if resolved.config.model != name:  # its engine knows it by the name it is served under
                resolved = replace(resolved, config=msgspec.structs.replace(resolved.config, model=name))
            if name in self.models:
                raise ConfigError(
                    f"the model `{name}` is given twice; serve the other under a name of its own (NAME=CONFIG)"
                )
            limit = spec.max_pending if spec.max_pending is not None else max_pending
            self.models[name] = ServedModel(name, resolved, limit)
        if not self.models:
            raise ConfigError("no model to serve")
        self._closed = False
        self._lock = threading.Lock()
        #: Called on the loop that ran :meth:`start` when a loaded model dies for good.
        self.on_dead: list[Callable[[ServedModel, EngineDeadError], None]] = []

    @property
    def names(self) -> list[str]:
        return list(self.models)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load every model at once (stage processes start off the loop); returns when each is
        ``loaded`` or ``failed``."""
        await asyncio.gather(*(self._load(m) for m in self.models.values()))

    async def _load(self, model: ServedModel) -> None:
        loop = asyncio.get_running_loop()
        try:
            engine = await loop.run_in_executor(
                None,
                lambda: AsyncOmni(model.resolved, max_pending=model.max_pending, default_timeout=self._default_timeout),
            )
        except Exception as e:
            model.state, model.error = "failed", e
            return
        with self._lock:  # close() in another thread either sees this engine or left it to us
            closed = self._closed
            if not closed:
                model.engine, model.state = engine, "loaded"
        if closed:  # closed while loading
            await loop.run_in_executor(None, engine.close)
            model.state = "closed"
            return
        engine.on_dead(lambda error: self._died(model, error))

    def _died(self, model: ServedModel, error: EngineDeadError) -> None:
        model.state, model.error = "dead", error
        for callback in self.on_dead:
            callback(model, error)

    def close(self) -> None:
        """Close every loaded engine (idempotent); a model still loading is closed once loaded."""
        with self._lock:
            self._closed = True
            engines = [m for m in self.models.values() if m.engine is not None and m.state != "closed"]
        for model in engines:
            assert model.engine is not None
            model.engine.close()
            model.state = "closed"

    async def __aenter__(self) -> MultiOmni:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    # ------------------------------------------------------------------ routing

    def model(self, name: str | None) -> ServedModel:
        """The model named ``name`` (any state); None names the only model when one is served.
        UnknownModelError (listing the served ones), or InvalidRequestError when several are
        served and none is named."""
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            names = ", ".join(f"`{n}`" for n in self.models)
            raise InvalidRequestError(f"`model` is required: this server serves {names}", param="model")
        model = self.models.get(name)
        if model is None:
            raise UnknownModelError(name, tuple(self.models))
        return model

    def engine(self, name: str | None = None) -> AsyncOmni:
        """The loaded engine of ``name``, or ModelUnavailableError saying why there is none."""
        model = self.model(name)
        if model.engine is None or model.state != "loaded":
            raise model.unavailable()
        unplaced = model.unplaced()
        if unplaced is not None:
            raise ModelUnavailableError(model.name, "unplaced", unplaced)
        return model.engine

    # ------------------------------------------------------------------ AsyncOmni's protocol, by model

    def validate(
        self,
        prompt: str,
        sampling_params: Any = None,
        *,
        model: str | None = None,
        modalities: Sequence[str] | None = None,
    ) -> ValidRequest:
        """:meth:`AsyncOmni.validate` on ``model``'s engine."""
        return self.engine(model).validate(prompt, sampling_params, modalities=modalities)

    async def generate(
        self,
        prompt: str | ValidRequest,
        sampling_params: Any = None,
        request_id: str | None = None,
        *,
        model: str | None = None,
        modalities: Sequence[str] | None = None,
    ) -> AsyncGenerator[OmniRequestOutput, None]:
        """:meth:`AsyncOmni.generate` on ``model``'s engine (a ValidRequest goes back to the
        model that validated it)."""
        async for out in self.engine(model).generate(prompt, sampling_params, request_id, modalities=modalities):
            yield out

    def abort(
        self, request_id: str | Sequence[str], reason: BaseException | None = None, *, model: str | None = None
    ) -> None:
        """Abort requests of ``model``, or of every loaded model when None (ids unknown to a
        model are ignored by it)."""
        targets = [self.model(model)] if model is not None else list(self.models.values())
        for target in targets:
            if target.engine is not None:
                target.engine.abort(request_id, reason)

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        stage_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        *,
        model: str | None = None,
    ) -> list[RpcReplicaResult]:
        """:meth:`AsyncOmni.collective_rpc` on ``model``'s engine."""
        return await self.engine(model).collective_rpc(method, args, kwargs, stage_ids, timeout)

    def sampling_params(
        self, *, model: str | None = None, image: dict[str, Any] | None = None, shared: dict[str, Any] | None = None
    ) -> list[dict[str, Any] | None]:
        """:meth:`AsyncOmni.sampling_params` of ``model``'s config."""
        return self.model(model).resolved.sampling_params(image=image, shared=shared)

    def health(self) -> dict[str, EngineHealth | None]:
        """Each model's engine health, by name (None: no engine, see its ``state``)."""
        return {name: model.health() for name, model in self.models.items()}

    def states(self) -> dict[str, ModelState]:
        return {name: model.status() for name, model in self.models.items()}

    def __repr__(self) -> str:
        return f"MultiOmni({', '.join(f'{n}: {s}' for n, s in self.states().items())})"
