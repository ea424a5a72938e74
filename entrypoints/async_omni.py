"""AsyncOmni: the asyncio API, for servers. Runs in the caller's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from omni_runtime.config import DeployConfig, load_config, with_engine_overrides
from omni_runtime.engine.async_engine import AsyncOmniEngine
from omni_runtime.messages import EngineOutput, RpcReplicaResult
from omni_runtime.outputs import OmniRequestOutput, StageResult


def build_config(model: str | Path | DeployConfig, engine_args: dict[str, Any]) -> DeployConfig:
    config = model if isinstance(model, DeployConfig) else load_config(model)
    return with_engine_overrides(config, **engine_args)


class AsyncOmni:
    """``async for out in engine.generate(prompt): ...`` over a deploy config.

    ``model``: a bundled config name (``tiny-sd``), a deploy YAML path, a local diffusers model
    directory, or a DeployConfig. Keyword engine args (``max_num_seqs``,
    ``request_batch_max_wait_ms``, ...) override the diffusion stage's YAML values.

    The engine starts in the constructor (stage processes load their models) and stops in
    :meth:`close`, also on ``async with`` / ``with`` exit.
    """

    def __init__(
        self,
        model: str | Path | DeployConfig = "tiny-sd",
        *,
        max_pending: int | None = None,
        default_timeout: float | None = None,
        **engine_args: Any,
    ) -> None:
        self.config = build_config(model, engine_args)
        self.engine = AsyncOmniEngine(self.config, max_pending=max_pending, default_timeout=default_timeout)

    @property
    def model_name(self) -> str:
        return self.config.model or "omni"

    async def generate(
        self,
        prompt: str,
        sampling_params: Any = None,
        request_id: str | None = None,
        *,
        modalities: Sequence[str] | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Yield an output each time a final stage delivers (or streams text); the last has
        ``finished=True``. A failed request raises its typed error (StageDeadError,
        RequestTimeoutError, RequestAbortedError, StageExecutionError...) after what it delivered.
        Cancelling the consumer aborts the request."""
        pending = self.engine.add_request(prompt, sampling_params, request_id, modalities)
        rid = pending.request_id
        out = OmniRequestOutput(request_id=rid, stage_id=-1)
        done = False
        try:
            while not done:
                msg: EngineOutput = await pending.stream.get()
                done = msg.finished
                if msg.error is not None:
                    out.finished = True
                    out.error = msg.error.to_exception()
                    out.metrics = {**out.metrics, **msg.metrics}
                    raise out.error
                apply_output(out, msg)
                yield out.snapshot()
        finally:
            if not done:
                self.engine.abort(rid)

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests wherever they are; their ``generate`` raises RequestAbortedError."""
        self.engine.abort(request_id)

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        stage_ids: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[RpcReplicaResult]:
        """Run a control call on every live replica of the chosen stages (all by default),
        concurrently; one :class:`RpcReplicaResult` per replica, errors included, never a hang
        when ``timeout`` is set."""
        return await self.engine.collective_rpc(method, args, kwargs, stage_ids, timeout)

    def on_dead(self, callback: Any) -> None:
        """Call ``callback(EngineDeadError)`` once if the engine dies for good (see
        :meth:`AsyncOmniEngine.on_dead`); a server uses it to exit and be restarted."""
        self.engine.on_dead(callback)

    def close(self) -> None:
        self.engine.close()

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __enter__(self) -> AsyncOmni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def apply_output(out: OmniRequestOutput, msg: EngineOutput) -> None:
    """Fold one engine output into the caller's accumulated OmniRequestOutput."""
    from PIL import Image

    out.stage_id = msg.stage_id
    out.finished = msg.finished
    out.metrics = dict(msg.metrics)
    result = out.outputs_by_stage.setdefault(msg.stage_id, StageResult(stage_id=msg.stage_id))
    if msg.stage_finished:
        images = [Image.fromarray(a) for a in msg.images]
        result.images, result.tensors, result.metrics = images, dict(msg.tensors), dict(msg.metrics)
        if msg.text is not None:
            result.text = msg.text
        out.text_delta = None
    else:
        result.text = (result.text or "") + (msg.text or "")
        out.text_delta = msg.text
    out.images = [img for r in out.outputs_by_stage.values() for img in r.images]
    texts = [r.text for r in out.outputs_by_stage.values() if r.text is not None]
    out.text = texts[-1] if texts else None
