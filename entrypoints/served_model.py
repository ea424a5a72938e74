"""One named model that a :class:`~omni_runtime.entrypoints.multi_omni.MultiOmni` serves: its
config, its engine once loaded, its state and error, what it can do, and what the residency budget
reads of it (:meth:`ServedModel.usage`)."""

from __future__ import annotations

import asyncio

from omni_runtime.exceptions import ModelUnavailableError
from omni_runtime.resolve import ResolvedConfig

from .async_omni import AsyncOmni, EngineHealth
from .capabilities import ModelCapabilities
from .model_specs import EvictMode, ModelState
from .residency import ModelUse

__all__ = ["ServedModel"]


class ServedModel:
    """One named model of a :class:`MultiOmni`: its config, its engine once loaded, its state, and
    what the budget needs (requests holding it, when it was last used, its resident bytes)."""

    def __init__(
        self,
        name: str,
        resolved: ResolvedConfig,
        max_pending: int | None,
        *,
        lazy: bool = False,
        evict: EvictMode = "sleep",
    ) -> None:
        self.name = name
        self.resolved = resolved
        self.config = resolved.config
        self.max_pending = max_pending
        self.lazy = lazy
        self.evict: EvictMode = evict
        self.state: ModelState = "unloaded" if lazy else "loading"
        #: Why it failed or died, or None.
        self.error: BaseException | None = None
        self.engine: AsyncOmni | None = None
        #: What it can do: worked out from its config now, completed with its stages' limits
        #: once its engine has loaded (see :meth:`ModelCapabilities.loaded`).
        self.capabilities = ModelCapabilities.of(resolved)
        #: Requests holding it (acquired, not released) and requests waiting for it to come back:
        #: the budget evicts only a model with neither (and no request in its engine).
        self.leases = 0
        self.waiters = 0
        #: When a request last took or gave it back (monotonic seconds): the budget evicts the
        #: least recently used idle model first.
        self.last_used = 0.0
        #: Weight bytes its runners reported resident (``get_stats`` ``weight_bytes``) when last
        #: loaded; kept while evicted as what bringing it back will take. None: none reported.
        self.resident_bytes: int | None = None
        #: Cold loads (engine started), wakes from sleep, and evictions (sleep or stop) so far.
        self.loads = 0
        self.wakes = 0
        self.evictions = 0
        #: Held through each transition (load, wake, sleep, stop): one at a time per model.
        self.lock = asyncio.Lock()
        #: The task bringing it back, shared by every request that waits for it.
        self.coming_up: asyncio.Future[None] | None = None

    @property
    def kinds(self) -> list[str]:
        """What it makes: its final stages' output types (image, video, audio, text)."""
        return list(self.capabilities.kinds)

    def health(self) -> EngineHealth | None:
        """Its engine's health, or None while it has no engine (loading, failed)."""
        return self.engine.health() if self.engine is not None else None

    @property
    def starting(self) -> bool:
        """In its first load at start (not lazy): the server is not ready until it is done."""
        return self.state == "loading" and not self.lazy and self.loads == 0

    def usage(self) -> ModelUse:
        """What the budget reads of it now (its engine is asked for the requests running in it
        only when no request holds it or waits for it)."""
        health = None if self.leases or self.waiters else self.health()
        return ModelUse(name=self.name, state=self.state, last_used=self.last_used, resident_bytes=self.resident_bytes,
                        leases=self.leases, waiters=self.waiters, running=health.pending if health else 0,
                        changing=self.lock.locked())  # fmt: skip

    def idle(self) -> bool:
        """No request holds it, waits for it, or runs in its engine."""
        return self.usage().idle

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
