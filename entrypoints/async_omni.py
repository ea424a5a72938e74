"""AsyncOmni: the asyncio API, for servers. Runs in the caller's event loop (any loop).

Its public surface is what the HTTP server and the CLI use, and all they use: :meth:`validate`
(a request checked once, which :meth:`generate` then takes as it is), :meth:`generate` (and
:meth:`events`, the same request read as typed events), :meth:`abort`, :meth:`collective_rpc`,
:meth:`health`, :meth:`sampling_params` (which stages take which params) and :meth:`on_dead`.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

from omni_runtime.config import DeployConfig, load_config, with_engine_overrides, with_ray_address
from omni_runtime.engine.async_engine import AsyncOmniEngine, EngineHealth, PendingRequest, ValidRequest
from omni_runtime.events import Event, events_of
from omni_runtime.exceptions import EngineDeadError
from omni_runtime.messages import EngineOutput, RpcReplicaResult, StageConstraints
from omni_runtime.outputs import OmniRequestOutput, RequestProgress, StageResult
from omni_runtime.resolve import ResolvedConfig, resolve_config

__all__ = ["AsyncOmni", "EngineHealth", "ValidRequest", "apply_output", "load_resolved"]


def load_resolved(
    model: str | Path | DeployConfig | ResolvedConfig, engine_args: dict[str, Any], ray_address: str | None = None
) -> ResolvedConfig:
    """``model`` (a bundled config name, a deploy YAML, a model directory or a config) with the
    keyword engine args applied (and ``ray_address`` for its ray stages), resolved: every mistake
    in it is a ConfigError now."""
    if isinstance(model, ResolvedConfig):
        if ray_address is None and all(v is None for v in engine_args.values()):
            return model
        model = model.config
    config = model if isinstance(model, DeployConfig) else load_config(model)
    config = with_ray_address(with_engine_overrides(config, **engine_args), ray_address)
    return resolve_config(config, source=config.model or "config")


class AsyncOmni:
    """``async for out in engine.generate(prompt): ...`` over a deploy config.

    ``model``: a bundled config name (``tiny-sd``), a deploy YAML path, a local diffusers model
    directory, or a DeployConfig. Keyword engine args (``max_num_seqs``,
    ``request_batch_max_wait_ms``, ...) override the diffusion stage's YAML values;
    ``ray_address`` the cluster of its ``backend: ray`` stages.

    The engine starts in the constructor (stage processes load their models) and stops in
    :meth:`close`, also on ``async with`` / ``with`` exit.
    """

    def __init__(
        self,
        model: str | Path | DeployConfig | ResolvedConfig = "tiny-sd",
        *,
        max_pending: int | None = None,
        default_timeout: float | None = None,
        ray_address: str | None = None,
        **engine_args: Any,
    ) -> None:
        self.resolved = load_resolved(model, engine_args, ray_address)
        self.config = self.resolved.config
        self.engine = AsyncOmniEngine(self.resolved, max_pending=max_pending, default_timeout=default_timeout)

    @property
    def model_name(self) -> str:
        return self.config.model or "omni"

    def validate(
        self,
        prompt: str,
        sampling_params: Any = None,
        *,
        modalities: Sequence[str] | None = None,
        stages: Sequence[int] | None = None,
        entry_stages: Sequence[int] | None = None,
    ) -> ValidRequest:
        """Check a request completely without queueing it (InvalidRequestError naming the field);
        :meth:`generate` takes the result as it is, so nothing is checked twice. ``stages`` (not
        with ``modalities``) answers with those stages' outputs, any of the pipeline's (a
        speech-recognition stage's transcript, say): only the stages they need run.
        ``entry_stages``: the prompt enters the pipeline at these stages, as it is, and the stages
        before them do not run (a transcript already heard goes straight to the LM)."""
        return self.engine.validate(prompt, sampling_params, modalities, stages, entry_stages)

    async def generate(
        self,
        prompt: str | ValidRequest,
        sampling_params: Any = None,
        request_id: str | None = None,
        *,
        modalities: Sequence[str] | None = None,
        streaming_input: bool = False,
    ) -> AsyncGenerator[OmniRequestOutput, None]:
        """Yield an output each time a final stage delivers (or streams text); the last has
        ``finished=True``. A failed request raises its typed error (StageDeadError,
        RequestTimeoutError, RequestAbortedError, StageExecutionError...) after what it delivered.
        Cancelling the consumer aborts the request.

        With ``streaming_input`` the prompt is only the first piece of the input: the caller
        appends more with :meth:`add_streaming_update` and ends it with ``final=True``; each source
        stage takes the input a sentence at a time as it comes, and the chain goes on from there.
        The request is admitted when the first output is awaited (as every ``generate``)."""
        pending = self.engine.add_request(prompt, sampling_params, request_id, modalities, streaming_input)
        outputs = self._outputs(pending)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    async def events(
        self,
        prompt: str | ValidRequest,
        sampling_params: Any = None,
        request_id: str | None = None,
        *,
        modalities: Sequence[str] | None = None,
        streaming_input: bool = False,
    ) -> AsyncGenerator[Event, None]:
        """:meth:`generate`'s request, yielding what each output says as typed events
        (``omni_runtime.events``: Progress, TextDelta, MediaDelta, StageDone, then one Final with
        the whole output) instead of the outputs. Admission, errors (raised after the events
        delivered), cancellation and ``streaming_input`` are :meth:`generate`'s."""
        outputs = self.generate(
            prompt, sampling_params, request_id, modalities=modalities, streaming_input=streaming_input
        )
        try:
            async for out in outputs:
                for event in events_of(out):
                    yield event
        finally:
            await outputs.aclose()

    def open_streaming(
        self,
        prompt: str | ValidRequest,
        sampling_params: Any = None,
        request_id: str | None = None,
        *,
        modalities: Sequence[str] | None = None,
    ) -> AsyncGenerator[OmniRequestOutput, None]:
        """``generate(..., streaming_input=True)``, admitted now rather than when its first output
        is awaited: :meth:`add_streaming_update` can be called at once. Admission errors raise
        here. A stream dropped without being read to its end aborts its request (its place in
        ``max_pending`` is free again on the loop's next turn)."""
        pending = self.engine.add_request(prompt, sampling_params, request_id, modalities, True)
        outputs = self._outputs(pending)
        # A generator never started runs no ``finally`` when it goes, and the loop's finalizer
        # hook sees only started ones: without this the request would stay pending for good.
        weakref.finalize(outputs, self.engine.abort_dropped, pending).atexit = False
        return outputs

    async def _outputs(self, pending: PendingRequest) -> AsyncGenerator[OmniRequestOutput, None]:
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
                    out.metrics = {**out.metrics, **msg.payload.metrics.as_dict()}
                    raise out.error
                apply_output(out, msg)
                yield out.snapshot()
        finally:
            if not done:
                self.engine.abort(rid)

    def add_streaming_update(
        self, request_id: str, text: str | None = None, *, inputs: dict[str, Any] | None = None, final: bool = False
    ) -> None:
        """Append ``text`` (and ``inputs``, which go with the next chunk) to a running request
        opened with ``generate(..., streaming_input=True)``; ``final=True`` says the input is
        complete. From any thread; never waits. Raises UnknownRequestError (not in flight, or not
        streaming), StreamClosedError (after the final update), InvalidRequestError (a value no
        message can carry) or QueueFullError."""
        self.engine.add_streaming_update(request_id, text, inputs, final)

    def abort(self, request_id: str | Sequence[str], reason: BaseException | None = None) -> None:
        """Abort requests wherever they are, at once, from any thread; their ``generate`` raises
        ``reason`` (default RequestAbortedError). Unknown or finished ids are ignored."""
        self.engine.abort(request_id, reason)

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

    def health(self) -> EngineHealth:
        """Whether the engine serves (``status``: ok, unhealthy, dead, closed), the pending count
        and its limit, and each stage's replicas and queues."""
        return self.engine.health()

    def max_input_pixels(self) -> int:
        """The most pixels an input image may have for this model (its stages' ``max_pixels``):
        what a server checks an upload's declared size against before decoding it."""
        return self.engine.max_input_pixels()

    def constraints(self) -> dict[int, StageConstraints]:
        """What each loaded stage allows (its READY constraints), by stage id."""
        return self.engine.constraints()

    def frames_step(self) -> int | None:
        """A video model's frame step (``step * k + 1`` frames); None for a model without video."""
        return self.engine.frames_step()

    def sampling_params(
        self, *, image: dict[str, Any] | None = None, shared: dict[str, Any] | None = None
    ) -> list[dict[str, Any] | None]:
        """A per-stage params list: ``image`` params for every stage that takes them (a split
        pipeline has several), each ``shared`` field for every stage that has it."""
        return self.resolved.sampling_params(image=image, shared=shared)

    def on_dead(self, callback: Callable[[EngineDeadError], Any]) -> None:
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
    payload = msg.payload
    out.stage_id = msg.stage_id
    out.finished = msg.finished
    out.metrics = payload.metrics.as_dict()
    out.progress = None
    out.stage_finished = msg.stage_finished
    out.media_delta = [] if msg.stage_finished else list(payload.media)
    if not msg.stage_finished and payload.text is None:
        if payload.progress is not None:
            p = payload.progress
            out.progress = RequestProgress(stage_id=msg.stage_id, step=p.step, steps=p.steps)
            out.text_delta = None
            return
        if payload.stage_done:
            out.progress = RequestProgress(stage_id=msg.stage_id, stage_done=True)
            out.text_delta = None
            return
    result = out.outputs_by_stage.setdefault(msg.stage_id, StageResult(stage_id=msg.stage_id))
    if msg.stage_finished:
        # A new result, not the old one changed: earlier snapshots keep what they showed.
        result = out.outputs_by_stage[msg.stage_id] = StageResult(
            stage_id=msg.stage_id,
            text=payload.text if payload.text is not None else result.text,
            media=list(payload.media),
            tensors=dict(payload.tensors),
            metrics=payload.metrics.as_dict(),
        )
        out.text_delta = None
    else:
        if payload.text is not None:  # a chunk of audio is no text: the stage keeps none
            result.text = (result.text or "") + payload.text
        out.text_delta = payload.text
    out.media = [m for r in out.outputs_by_stage.values() for m in r.media]
    texts = [r.text for r in out.outputs_by_stage.values() if r.text is not None]
    out.text = texts[-1] if texts else None
