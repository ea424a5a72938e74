"""The runner interface: what a stage does with a batch of requests.

A runner lives in the stage worker (its own process, or in-process). The worker's scheduler
decides which requests run together; the runner executes them in one ``execute()`` call in an
executor thread, so the worker's socket keeps answering aborts and control calls meanwhile.

A runner that can also run requests one denoising step at a time (``engine_args.step_execution``)
implements the ``step_*`` methods: the worker then drives the loop, one step per executor call,
and decides between steps who joins, who leaves and who steps (the runner decides how).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from omni_runtime.config import StageConfig
from omni_runtime.media import MediaItem
from omni_runtime.messages import StageConstraints
from omni_runtime.params import GenericSamplingParams, resolve_params
from omni_runtime.stage.runners.stage_types import stage_type as builtin_stage_type

#: The params class of a runner's requests.
P = TypeVar("P")


@dataclass
class RunnerRequest(Generic[P]):
    """One logical request as the runner sees it."""

    request_id: str
    #: The caller's prompt (text), or the output of this stage's input function.
    prompt: Any
    #: The request's resolved params: an object of the runner's ``params_cls`` as
    #: :func:`~omni_runtime.params.resolve_params` made it (the stage's defaults and the class's
    #: fallbacks filled in), read by attribute. A generic custom runner's undeclared fields are in
    #: its ``extra`` mapping (:class:`~omni_runtime.params.GenericSamplingParams`).
    params: P
    #: Upstream outputs: ``text``, and tensors/arrays by name (``prompt_embeds``, ``latents``...).
    inputs: dict[str, Any] = field(default_factory=dict)
    #: Higher runs first; in step execution it may take the slot of a lower one at a step boundary.
    priority: int = 0


@dataclass
class RunnerOutput:
    """What a runner returns for one request (or ``error`` for that request alone)."""

    text: str | None = None
    #: Images (ImageItems with uint8 HxWx3 arrays, one per image), later video and audio.
    media: list[MediaItem] = field(default_factory=list)
    #: Named numpy arrays or torch tensors (``latents``, ``prompt_embeds``, float ``images``...).
    tensors: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float | int] = field(default_factory=dict)
    error: BaseException | None = None


@dataclass
class StepResult:
    """What one step did for one request (step execution)."""

    #: Steps taken so far, and in all.
    step: int
    steps: int
    #: Set once the request is done: its final output (images...), or its error. Its state is gone.
    output: RunnerOutput | None = None


class ExecuteContext:
    """Passed to ``execute()``: abort checks and partial-output streaming for the running wave."""

    def __init__(
        self,
        is_aborted: Callable[[str], bool],
        emit: Callable[[str, RunnerOutput], None] | None = None,
        progress: Callable[[list[str], int, int], None] | None = None,
    ) -> None:
        self._is_aborted = is_aborted
        self._emit = emit
        self._progress = progress

    def is_aborted(self, request_id: str) -> bool:
        """True once the request has been aborted (or timed out); checked at every step."""
        return self._is_aborted(request_id)

    def emit(self, request_id: str, partial: RunnerOutput) -> None:
        """Send a partial (not finished) output, e.g. a text delta, to the caller now."""
        if self._emit is not None:
            self._emit(request_id, partial)

    def step_progress(self, request_ids: list[str], step: int, steps: int) -> None:
        """Report that ``request_ids`` finished step ``step`` of ``steps``. Cheap to call at every
        step: the worker sends progress outputs only when its throttle says one is due."""
        if self._progress is not None:
            self._progress(request_ids, step, steps)


class StageRunner(ABC):
    """Base of the stage runners. Subclasses set ``params_cls`` and implement ``execute``."""

    #: Sampling-params class of this stage type; validated in the caller's thread.
    params_cls: ClassVar[type[msgspec.Struct]] = GenericSamplingParams
    #: Most requests one ``execute()`` can take (None: only ``max_num_seqs`` limits it). A
    #: pipeline that cannot take list inputs sets 1, and the worker caps its waves.
    max_batch_size: int | None = None
    #: Which replica of its stage this runner serves (set by the worker before ``load``).
    replica_id: int = 0
    #: Whether the stage must name a ``model:`` (checked when the config is resolved, not in load).
    needs_model: ClassVar[bool] = False

    def __init__(self, stage: StageConfig) -> None:
        self.stage = stage
        self.device = stage.runtime.devices

    @classmethod  # noqa: B027 - optional hook
    def preload(cls, stage: StageConfig) -> None:
        """Import, in the engine's stage launcher, the libraries ``load`` will need, so that the
        replicas forked from it start with them imported (see :mod:`omni_runtime.stage.launcher`).
        Imports only: no threads, no devices, no files written. Importing this class's module
        has happened already."""

    def load(self) -> None:  # noqa: B027 - optional hook
        """Load the model (called once in the worker before READY)."""

    def constraints(self) -> StageConstraints:
        """Checks the caller must make before enqueue (``size_multiple``, ``max_pixels``...)."""
        return StageConstraints()

    def batch_key(self, request: RunnerRequest) -> Hashable:
        """Requests with equal keys may run in one ``execute()``. The default fuses everything."""
        return ()

    def profile_request(self) -> RunnerRequest | None:
        """A representative request for the start-up profile of the cost of a batch
        (``engine_args.batch_profile``): the key most requests are expected to have. None: this
        runner is not profiled."""
        return None

    def _default_request(self, prompt: str, request_id: str = "batch-profile", **params: Any) -> RunnerRequest:
        """``prompt`` with the stage's default sampling params, and ``params`` over them, resolved
        as a caller's request is."""
        resolved = resolve_params(self.params_cls, self.stage.default_sampling_params, params)
        return RunnerRequest(request_id=request_id, prompt=prompt, params=resolved)

    def runs_inline(self, batch: list[RunnerRequest]) -> bool:
        """True if ``execute(batch)`` is so cheap (microseconds, no blocking) that the worker may
        run it on its event loop instead of the forward thread. Models never are."""
        return False

    @abstractmethod
    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        """Run a batch; return one output per request, in order. Raising fails the whole batch
        (the worker then retries each request alone, so only the failing one gets the error)."""

    # ------------------------------------------------------------------ step execution (optional)

    def step_support(self) -> str | None:
        """None if this runner (with its loaded model) can run requests step by step, else why not:
        the worker then falls back to request-level batching and logs the reason."""
        return f"{type(self).__name__} does not run requests step by step"

    def step_key(self, request: RunnerRequest) -> Hashable:
        """Requests with equal keys may take a step together (in one batched call)."""
        return self.batch_key(request)

    def step_count(self, request: RunnerRequest) -> int | None:
        """How many steps the request will take (what a deadline-aware scheduler predicts its
        remaining time from); None: unknown."""
        return None

    def step_batch_cap(self, request: RunnerRequest) -> int | None:
        """Most requests that may take a step together while this one does (a memory bound of the
        runner's); None: only ``max_num_seqs`` bounds the step's batch."""
        return None

    def step_admit(self, requests: list[RunnerRequest], ctx: ExecuteContext) -> dict[str, RunnerOutput]:
        """Take requests into the running set: encode them (batched) and prepare their state.
        Returns an error output for each request that could not be admitted (only that one fails)."""
        raise NotImplementedError

    def step_run(self, request_ids: list[str], ctx: ExecuteContext) -> dict[str, StepResult]:
        """One step for admitted requests of one key, batched. A request that finishes (or fails)
        gets its output in its :class:`StepResult` and its state is freed. Raising fails them all."""
        raise NotImplementedError

    def step_drop(self, request_ids: list[str]) -> None:  # noqa: B027 - optional hook
        """Free the state of admitted requests (aborted); unknown ids are ignored."""

    def sleep(self) -> dict[str, Any]:
        """Release the model's memory (``collective_rpc("sleep")``)."""
        return {}

    def wake_up(self) -> dict[str, Any]:
        """Restore what ``sleep`` released."""
        return {}

    def stats(self) -> dict[str, Any]:
        """The runner's part of the worker's ``get_stats`` (called from the worker's event loop)."""
        return {}


def runner_class(stage_type: str) -> type[StageRunner]:
    """The runner class for a ``stage_type``: a builtin name or ``module:Class``. Raises
    ImportError, AttributeError or TypeError (not a StageRunner) for a bad ``module:Class``."""
    builtin = builtin_stage_type(stage_type)
    module_name, _, class_name = (builtin.path if builtin else stage_type).partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, StageRunner)):
        raise TypeError(f"{stage_type} is not a StageRunner subclass")
    return cls
