"""Omni: the blocking Python API. ``Omni(model="tiny-sd").generate([...])``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from omni_runtime.config import DeployConfig
from omni_runtime.events import Progress, StageDone, events_of
from omni_runtime.exceptions import (
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    OmniError,
    StageExecutionError,
)
from omni_runtime.messages import RpcReplicaResult
from omni_runtime.outputs import OmniRequestOutput

from .async_omni import AsyncOmni, ValidRequest

T = TypeVar("T")


class Omni:
    """Blocking front of the engine: one logical request per prompt, results in input order.

    It drives an :class:`AsyncOmni` on a private event loop running in a thread of its own, so
    any number of threads may call it at once (a web app's worker threads do); their requests
    batch together. It must not be called from inside a running event loop (use AsyncOmni there).
    After :meth:`close`, every call raises EngineClosedError.
    """

    def __init__(self, model: str | Path | DeployConfig = "tiny-sd", **kwargs: Any) -> None:
        self._async = AsyncOmni(model, **kwargs)
        self.config = self._async.config
        self._lock = threading.Lock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-blocking-api", daemon=True)
        self._thread.start()
        # Backpressure: at most max_pending of this Omni's requests are admitted at once; the rest
        # wait their turn in arrival order instead of failing with QueueFullError.
        self._slots = asyncio.Semaphore(self._async.health().max_pending)
        self._id_prefix = f"omni-{uuid.uuid4().hex[:8]}"
        self._ids = itertools.count(1)
        self._calls: set[asyncio.Task] = set()  # calls in progress, from any thread

    @property
    def engine(self):
        return self._async.engine

    def _run(self, method: str, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the private loop and wait for it in the calling thread."""
        try:
            _refuse_inside_event_loop(method)
        except EngineError:
            coro.close()
            raise
        with self._lock:
            if self._closed:
                coro.close()
                raise EngineClosedError("the engine is closed")
            task_future = asyncio.run_coroutine_threadsafe(_as_task(coro), self._loop)
            task = task_future.result()  # the Task itself: it can be cancelled from here
            self._calls.add(task)
        try:
            return asyncio.run_coroutine_threadsafe(_wait(task), self._loop).result()
        except (KeyboardInterrupt, SystemExit):
            self._loop.call_soon_threadsafe(task.cancel)  # its requests are aborted on the way out
            raise
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            raise EngineClosedError("the engine was closed during the call") from None
        finally:
            with self._lock:
                self._calls.discard(task)

    def generate(
        self,
        prompts: str | Sequence[str],
        sampling_params_list: Any = None,
        use_tqdm: bool = True,
        *,
        modalities: Sequence[str] | None = None,
        request_ids: Sequence[str] | None = None,
        streaming_input: bool = False,
    ) -> list[OmniRequestOutput]:
        """Submit one request per prompt and wait for all; one output per prompt, in input order.

        ``sampling_params_list`` applies to every prompt: a params object or dict (a one-stage
        pipeline), or a list with one entry per stage (None = that stage's defaults). To give each
        prompt its own, pass a list with one entry per prompt: for a one-stage pipeline each entry
        is a params object or dict, for several stages each entry is itself a per-stage list.
        (For several stages, a flat list is always per stage, even when its length equals the
        number of prompts.) A request that fails has its typed error in ``output.error`` (and its
        ``request_id``); the others are unaffected. More prompts than ``max_pending`` are
        submitted as earlier ones finish. Invalid params raise InvalidRequestError before anything
        is submitted.

        ``request_ids`` names the requests (one per prompt); with ``streaming_input`` each prompt
        is only the first piece of its input: another thread appends more with
        :meth:`add_streaming_update` and ends it with ``final=True``.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        elif not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise InvalidRequestError("request_ids needs one id per prompt", param="request_ids")
        call = self._generate(list(prompts), sampling_params_list, use_tqdm, modalities, request_ids, streaming_input)
        return self._run("generate", call)

    def add_streaming_update(
        self, request_id: str, text: str | None = None, *, inputs: dict[str, Any] | None = None, final: bool = False
    ) -> None:
        """Blocking twin of :meth:`AsyncOmni.add_streaming_update` (it never waits), for a request
        that :meth:`generate` runs in another thread with ``streaming_input``."""
        self._async.add_streaming_update(request_id, text, inputs=inputs, final=final)

    async def _generate(
        self,
        prompts: list[str],
        params: Any,
        use_tqdm: bool,
        modalities: Sequence[str] | None,
        request_ids: Sequence[str] | None = None,
        streaming_input: bool = False,
    ) -> list[OmniRequestOutput]:
        # Each request is validated once, all before the first is submitted: bad params or
        # modalities raise here; a bad prompt is that prompt's error output.
        ids = list(request_ids or ()) or [f"{self._id_prefix}-{next(self._ids)}" for _ in prompts]
        requests: list[ValidRequest | OmniError] = []
        for prompt, own in zip(prompts, self._per_prompt(prompts, params), strict=True):
            try:
                requests.append(self._async.validate(prompt, own, modalities=modalities))
            except InvalidRequestError as e:
                if e.param != "prompt":
                    raise
                requests.append(e)
        progress = None
        if use_tqdm and len(prompts) > 1:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(prompts), desc="generate", unit="req")

        async def one(request: ValidRequest | OmniError, request_id: str) -> OmniRequestOutput:
            last = None
            try:
                if isinstance(request, OmniError):
                    raise request
                async with self._slots:
                    agen = self._async.generate(request, request_id=request_id, streaming_input=streaming_input)
                    async for out in agen:
                        for event in events_of(out):
                            match event:
                                case Progress() | StageDone(result=None):
                                    pass  # progress notices carry nothing to return
                                case _:
                                    last = out
            except OmniError as e:
                last = last or OmniRequestOutput(request_id=request_id, stage_id=-1)
                last.error, last.finished = e, True
            except Exception as e:  # never let one request take the batch down
                last = last or OmniRequestOutput(request_id=request_id, stage_id=-1)
                last.error, last.finished = StageExecutionError(f"{type(e).__name__}: {e}"), True
            if progress is not None:
                progress.update(1)
            assert last is not None  # generate ends with a finished output or raises
            return last

        try:
            return list(await asyncio.gather(*(one(r, rid) for r, rid in zip(requests, ids, strict=True))))
        finally:
            if progress is not None:
                progress.close()

    def _per_prompt(self, prompts: list[str], params: Any) -> list[Any]:
        """Each prompt's params: entry i of a per-prompt list, else ``params`` for all."""
        if isinstance(params, list | tuple) and len(params) == len(prompts) > 1:
            one_stage = len(self.config.stage_args) == 1
            if one_stage or all(isinstance(p, list | tuple) for p in params):
                return list(params)
        return [params] * len(prompts)

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        stage_ids: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[RpcReplicaResult]:
        """Blocking form of :meth:`AsyncOmni.collective_rpc`."""
        return self._run("collective_rpc", self._async.collective_rpc(method, args, kwargs, stage_ids, timeout))

    def close(self) -> None:
        """Stop the engine; calls in flight in other threads return with EngineClosedError
        outputs. Safe from any thread; closing twice is a no-op."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # 1) every pending request and control call ends with EngineClosedError
        self._async.close()
        # 2) let the calls of other threads see that and return (bounded: cancel what is left)
        with self._lock:
            calls = list(self._calls)
        if calls and threading.current_thread() is not self._thread:
            done = asyncio.run_coroutine_threadsafe(asyncio.wait(calls, timeout=10.0), self._loop)
            _, left = done.result()
            for task in left:
                self._loop.call_soon_threadsafe(task.cancel)
        # 3) stop the loop once its own tasks (the engine's output dispatcher) have ended
        if threading.current_thread() is not self._thread:
            asyncio.run_coroutine_threadsafe(_settle(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _settle() -> None:
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=5.0)


async def _as_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(coro)


async def _wait(task: asyncio.Task) -> Any:
    # shield: a caller interrupted while waiting cancels the task explicitly, not by accident.
    return await asyncio.shield(task)


def _refuse_inside_event_loop(method: str) -> None:
    """The blocking API would stall a running loop: say what to use instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise EngineError(f"Omni.{method}() blocks and cannot run inside an event loop; use AsyncOmni there")
