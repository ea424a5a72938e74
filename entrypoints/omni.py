"""Omni: the blocking Python API. ``Omni(model="tiny-sd").generate([...])``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omni_runtime.config import DeployConfig
from omni_runtime.exceptions import EngineError, OmniError, StageExecutionError
from omni_runtime.messages import RpcReplicaResult
from omni_runtime.outputs import OmniRequestOutput

from .async_omni import AsyncOmni


class Omni:
    """Blocking front of the engine: one logical request per prompt, results in input order.

    It drives an :class:`AsyncOmni` on a private event loop in the caller's thread, so it must not
    be called from inside a running event loop (use AsyncOmni there).
    """

    def __init__(self, model: str | Path | DeployConfig = "tiny-sd", **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._async = AsyncOmni(model, **kwargs)
        self.config = self._async.config

    @property
    def engine(self):
        return self._async.engine

    def generate(
        self,
        prompts: str | Sequence[str],
        sampling_params_list: Any = None,
        use_tqdm: bool = True,
        *,
        modalities: Sequence[str] | None = None,
    ) -> list[OmniRequestOutput]:
        """Submit one request per prompt and wait for all; one output per prompt, in input order.

        ``sampling_params_list``: one entry per stage (None = defaults), or a single params object
        or dict for a one-stage pipeline; the same params apply to every prompt. A request that
        fails has its typed error in ``output.error``; the others are unaffected. Invalid params
        raise InvalidRequestError before anything is submitted.
        """
        _refuse_inside_event_loop("generate")
        if isinstance(prompts, str):
            prompts = [prompts]
        return self._loop.run_until_complete(self._generate(list(prompts), sampling_params_list, use_tqdm, modalities))

    async def _generate(
        self, prompts: list[str], params: Any, use_tqdm: bool, modalities: Sequence[str] | None
    ) -> list[OmniRequestOutput]:
        engine = self._async.engine
        engine.resolve_params(params)  # validate once, before anything is submitted
        progress = None
        if use_tqdm and len(prompts) > 1:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(prompts), desc="generate", unit="req")

        async def one(prompt: str) -> OmniRequestOutput:
            last = None
            try:
                async for out in self._async.generate(prompt, params, modalities=modalities):
                    last = out
            except OmniError as e:
                last = last or OmniRequestOutput(request_id="", stage_id=-1)
                last.error, last.finished = e, True
            except Exception as e:  # never let one request take the batch down
                last = last or OmniRequestOutput(request_id="", stage_id=-1)
                last.error, last.finished = StageExecutionError(f"{type(e).__name__}: {e}"), True
            if progress is not None:
                progress.update(1)
            return last

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            if progress is not None:
                progress.close()

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        stage_ids: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[RpcReplicaResult]:
        """Blocking form of :meth:`AsyncOmni.collective_rpc`."""
        _refuse_inside_event_loop("collective_rpc")
        return self._loop.run_until_complete(self._async.collective_rpc(method, args, kwargs, stage_ids, timeout))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._async.close()
        # Let the dispatcher task see its cancellation before the loop goes.
        self._loop.run_until_complete(asyncio.sleep(0))
        self._loop.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse_inside_event_loop(method: str) -> None:
    """The blocking API would stall a running loop (and asyncio forbids nesting): say what to use."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise EngineError(f"Omni.{method}() blocks and cannot run inside an event loop; use AsyncOmni there")
