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
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

import msgspec

from omni_runtime.events import Event
from omni_runtime.exceptions import (
    ConfigError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelUnavailableError,
    UnknownModelError,
)
from omni_runtime.messages import RpcReplicaResult
from omni_runtime.outputs import OmniRequestOutput

from .async_omni import AsyncOmni, EngineHealth, ValidRequest, load_resolved
from .model_specs import (
    EvictMode,
    ModelCounts,
    ModelSource,
    ModelSpec,
    ModelState,
    load_models_file,
    parse_model_arg,
)
from .residency import Eviction, ModelUse, ResidencyBudget
from .served_model import ServedModel

__all__ = [
    "EvictMode",
    "Eviction",
    "ModelCounts",
    "ModelSource",
    "ModelSpec",
    "ModelState",
    "ModelUse",
    "MultiOmni",
    "ResidencyBudget",
    "ServedModel",
    "load_models_file",
    "parse_model_arg",
]

logger = logging.getLogger(__name__)

#: Seconds a sleep, wake-up or stats call waits for a model's replicas.
RPC_TIMEOUT_S = 600.0


class MultiOmni:
    """Several named models behind one API: ``async for out in multi.generate(prompt, model="x")``.

    ``models``: specs, or sources (a bundled config name, deploy YAML, model dir, DeployConfig),
    each served under its config's ``model:`` name unless its spec names it; a name served twice
    is a ConfigError. Every config is validated in the constructor (ConfigError at once);
    :meth:`start` loads all models not declared lazy concurrently and returns once each is
    ``loaded`` or ``failed`` (a failed load never raises: that model's requests fail with
    :class:`ModelUnavailableError`). ``max_pending`` is each model's admission limit unless its
    spec sets one; the keyword engine args apply to every model.

    The budget: at most ``max_loaded_models`` models loaded (or loading) and at most
    ``max_resident_bytes`` weight bytes resident (as the runners report them) at once. Before a
    model loads or wakes, and whenever a request gives one back, the least recently used idle
    model is evicted (its spec's ``evict``: sleep or stop) until the budget holds; a model busy
    with requests is never evicted (the budget is then exceeded until it is idle). A request for
    an unloaded or asleep model (:meth:`acquire`, :meth:`generate`) waits for it to come back, at
    most ``load_timeout`` seconds (None: no bound); concurrent ones share one load.
    """

    def __init__(
        self,
        models: Sequence[ModelSpec | ModelSource],
        *,
        max_pending: int | None = None,
        default_timeout: float | None = None,
        ray_address: str | None = None,
        max_loaded_models: int | None = None,
        max_resident_bytes: int | None = None,
        load_timeout: float | None = None,
        **engine_args: Any,
    ) -> None:
        self.budget = ResidencyBudget(max_loaded_models, max_resident_bytes)
        self._default_timeout = default_timeout
        self.load_timeout = load_timeout
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
            self.models[name] = ServedModel(name, resolved, limit, lazy=spec.lazy, evict=spec.evict)
        if not self.models:
            raise ConfigError("no model to serve")
        self._closed = False
        self._lock = threading.Lock()
        #: Held while the budget picks and evicts models.
        self._evicting = asyncio.Lock()
        self._tasks: set[asyncio.Future[None]] = set()
        #: Called on the loop that ran :meth:`start` when a loaded model dies for good.
        self.on_dead: list[Callable[[ServedModel, EngineDeadError], None]] = []

    @property
    def names(self) -> list[str]:
        return list(self.models)

    @property
    def max_loaded_models(self) -> int | None:
        return self.budget.max_loaded_models

    @max_loaded_models.setter
    def max_loaded_models(self, value: int | None) -> None:
        self.budget.max_loaded_models = value

    @property
    def max_resident_bytes(self) -> int | None:
        return self.budget.max_resident_bytes

    @max_resident_bytes.setter
    def max_resident_bytes(self, value: int | None) -> None:
        self.budget.max_resident_bytes = value

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load every model not lazy at once (stage processes start off the loop); returns when
        each is ``loaded`` or ``failed``."""
        eager = [m for m in self.models.values() if not m.lazy]
        await asyncio.gather(*(self._bring_up(m) for m in eager))

    def _bring_up(self, model: ServedModel) -> asyncio.Future[None]:
        """The one task loading or waking ``model``: every request waiting for it shares it."""
        if model.coming_up is None or model.coming_up.done():
            model.coming_up = asyncio.ensure_future(self._up(model))
        return model.coming_up

    async def _up(self, model: ServedModel) -> None:
        async with model.lock:
            if model.state in ("loaded", "failed", "dead", "closed") or self._closed:
                return
            # 1) make room first, so the memory is free before it loads  2) load or wake
            await self._make_room(model)
            if model.engine is not None:
                await self._wake(model)
            else:
                await self._load(model)
        # 3) its real size may be over what was estimated
        await self._make_room()

    async def _load(self, model: ServedModel) -> None:
        model.state = "loading"
        try:
            engine = await asyncio.get_running_loop().run_in_executor(None, self._make_engine, model)
        except Exception as e:
            model.state, model.error = "failed", e
            return
        if engine is None:  # closed while loading
            return
        model.loads += 1
        model.last_used = time.monotonic()
        model.capabilities = model.capabilities.loaded(engine.constraints(), engine.max_input_pixels())
        engine.on_dead(lambda error: self._died(model, engine, error))
        await self._measure(model)

    def _make_engine(self, model: ServedModel) -> AsyncOmni | None:
        """In a worker thread: ``model``'s engine, handed over as it is made; None when the manager
        was closed meanwhile, in which case the engine is closed here. The hand-over is this
        thread's, not the task's that waits for it: a loop that ended meanwhile (cancelling that
        task) must not leave the engine to nobody."""
        engine = AsyncOmni(model.resolved, max_pending=model.max_pending, default_timeout=self._default_timeout)
        with self._lock:  # close() either sees this engine or left it to us
            if not self._closed:
                model.engine, model.state = engine, "loaded"
                return engine
        engine.close()
        model.state = "closed"
        return None

    async def _wake(self, model: ServedModel) -> None:
        engine = model.engine
        assert engine is not None
        model.state = "loading"
        results = await engine.collective_rpc("wake_up", timeout=RPC_TIMEOUT_S)
        errors = [r.error for r in results if not r.ok]
        if errors or not results:
            model.state = "failed"
            model.error = EngineError(f"waking up failed: {errors[0] if errors else 'no live replica'}")
            return
        model.state = "loaded"
        model.wakes += 1
        model.last_used = time.monotonic()
        await self._measure(model)

    async def _measure(self, model: ServedModel) -> None:
        """Its resident weight bytes, summed over the replicas whose runner reports them."""
        engine = model.engine
        if engine is None:
            return
        try:
            results = await engine.collective_rpc("get_stats", timeout=RPC_TIMEOUT_S)
        except Exception:  # a size it cannot tell is no reason to fail the load
            return
        sizes = [r.result.get("weight_bytes") for r in results if r.ok and isinstance(r.result, dict)]
        known = [b for b in sizes if isinstance(b, int) and not isinstance(b, bool)]
        if known:
            model.resident_bytes = sum(known)

    def _died(self, model: ServedModel, engine: AsyncOmni, error: EngineDeadError) -> None:
        if model.engine is not engine:  # an engine the budget stopped
            return
        model.state, model.error = "dead", error
        for callback in self.on_dead:
            callback(model, error)

    def close(self) -> None:
        """Close every engine (idempotent); a model still loading is closed once loaded."""
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

    # ------------------------------------------------------------------ the budget

    def _uses(self) -> list[ModelUse]:
        return [m.usage() for m in self.models.values()]

    async def _make_room(self, coming: ServedModel | None = None) -> None:
        """Evict what the budget names, one model at a time, until it holds or no model can go
        (``coming``: a model about to load or wake)."""
        async with self._evicting:
            name = coming.name if coming is not None else None
            while (step := self.budget.next_eviction(self._uses(), name)).victim is not None:
                await self._evict(self.models[step.victim])
        if step.over:
            logger.debug("over the budget until a model is idle: %s", step.reason)

    async def _evict(self, model: ServedModel) -> None:
        """Put ``model`` to sleep or stop it. Its state changes before the first await, so a
        request arriving meanwhile waits for it to come back rather than reach a sleeping engine."""
        async with model.lock:
            engine = model.engine
            if model.state != "loaded" or engine is None or not model.idle():
                return
            model.evictions += 1
            if model.evict == "stop":
                model.state, model.engine = "unloaded", None
                await asyncio.get_running_loop().run_in_executor(None, engine.close)
                return
            model.state = "asleep"
            results = await engine.collective_rpc("sleep", timeout=RPC_TIMEOUT_S)
            for r in results:
                if not r.ok:  # its wake-up reloads what is left anyway
                    logger.warning("%s: stage %d replica %d did not sleep: %s", model.name, r.stage_id,
                                   r.replica_id, r.error)  # fmt: skip

    async def acquire(self, name: str | None = None, timeout: float | None = None) -> ServedModel:
        """The model ``name``, loaded, held by the caller until :meth:`release` (the budget does
        not evict it meanwhile). An unloaded or asleep model is brought back first, waiting at
        most ``timeout`` seconds (default ``load_timeout``); ModelUnavailableError when it cannot
        serve (failed, dead, closed, unplaced, or not back in time)."""
        model = self.model(name)
        limit = timeout if timeout is not None else self.load_timeout
        deadline = time.monotonic() + limit if limit is not None else None
        model.waiters += 1
        try:
            while model.state != "loaded":
                if model.state in ("failed", "dead", "closed") or self._closed:
                    raise model.unavailable()
                left = deadline - time.monotonic() if deadline is not None else None
                try:
                    if left is not None and left <= 0:
                        raise TimeoutError
                    await asyncio.wait_for(asyncio.shield(self._bring_up(model)), left)
                except TimeoutError:
                    raise ModelUnavailableError(model.name, "loading", f"not loaded within {limit:g} s") from None
        finally:
            model.waiters -= 1
        unplaced = model.unplaced()
        if unplaced is not None:  # loaded, but no node can host one of its stages now: fail at once
            raise ModelUnavailableError(model.name, "unplaced", unplaced)
        # No await between the checks above and this: the budget cannot evict it in between.
        model.leases += 1
        model.last_used = time.monotonic()
        return model

    def release(self, model: ServedModel) -> None:
        """Give back what :meth:`acquire` held; the budget may now evict it (on the loop)."""
        model.leases -= 1
        model.last_used = time.monotonic()
        if not self._closed and self.budget.excess(m.usage() for m in self.models.values()) is not None:
            task = asyncio.ensure_future(self._make_room())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @contextlib.asynccontextmanager
    async def use(self, name: str | None = None, timeout: float | None = None) -> AsyncIterator[AsyncOmni]:
        """``async with multi.use("x") as engine``: :meth:`acquire` and :meth:`release` around a block."""
        model = await self.acquire(name, timeout)
        try:
            assert model.engine is not None
            yield model.engine
        finally:
            self.release(model)

    def counts(self) -> dict[str, ModelCounts]:
        """Each model's loads, wakes and evictions so far, and its state, by name."""
        return {
            n: ModelCounts(state=m.state, loads=m.loads, wakes=m.wakes, evictions=m.evictions,
                           resident_bytes=m.resident_bytes)
            for n, m in self.models.items()
        }  # fmt: skip

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
        stages: Sequence[int] | None = None,
        entry_stages: Sequence[int] | None = None,
    ) -> ValidRequest:
        """:meth:`AsyncOmni.validate` on ``model``'s engine."""
        return self.engine(model).validate(
            prompt, sampling_params, modalities=modalities, stages=stages, entry_stages=entry_stages
        )

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
        model that validated it), bringing the model back first when unloaded or asleep; the
        model is held (not evicted) until the generator ends."""
        async with self.use(model) as engine:
            async for out in engine.generate(prompt, sampling_params, request_id, modalities=modalities):
                yield out

    async def events(
        self,
        prompt: str | ValidRequest,
        sampling_params: Any = None,
        request_id: str | None = None,
        *,
        model: str | None = None,
        modalities: Sequence[str] | None = None,
    ) -> AsyncGenerator[Event, None]:
        """:meth:`AsyncOmni.events` on ``model``'s engine: :meth:`generate`'s request (the model
        brought back and held the same way), as typed events."""
        async with self.use(model) as engine:
            async for event in engine.events(prompt, sampling_params, request_id, modalities=modalities):
                yield event

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
