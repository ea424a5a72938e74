"""What an engine output says, as typed events: one small frozen type per kind of news.

An :class:`~omni_runtime.outputs.OmniRequestOutput` from ``AsyncOmni.generate`` carries its news
as flags and optional fields at once (``progress``, ``text_delta``, ``media_delta``,
``stage_finished``, ``finished``, ``error``). :func:`events_of` turns one output into the events it
carries, in this order (one output may carry several: a streamed piece that ends the request, a
final stage's result that is also the request's end):

1. :class:`Progress` (a denoising step) or :class:`StageDone` without a ``result`` (an inner stage
   is done: its output went on to the next stage, not to the caller);
2. :class:`TextDelta`, the newest piece of a stage's streamed text;
3. :class:`MediaDelta`, the media of the newest piece of a chunked stage's output (one chunk's
   audio);
4. :class:`StageDone` with its ``result``: a final stage is done, its whole output delivered;
5. :class:`Final`: the request is over; its output holds every final stage's result.

Errors: ``AsyncOmni.events`` raises a failed request's typed error, after the events it delivered,
as ``generate`` does, so no event of that stream says it failed. An output that carries an error
(``Omni.generate`` returns one per failed prompt) ends its request: its :class:`Final` carries it
(``Final.error``).

Consumers ``match`` on the types::

    async for event in engine.events(prompt, params):
        match event:
            case Progress(stage=s, step=step, steps=steps): ...
            case TextDelta(text=text): ...
            case Final(output=out): ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omni_runtime.exceptions import OmniError
from omni_runtime.media import MediaItem
from omni_runtime.outputs import OmniRequestOutput, StageResult

__all__ = ["Event", "Final", "MediaDelta", "Progress", "StageDone", "TextDelta", "events_of"]


@dataclass(frozen=True, slots=True)
class Progress:
    """Stage ``stage`` finished denoising step ``step`` of ``steps`` (a few per second at most)."""

    stage: int
    step: int
    steps: int


@dataclass(frozen=True, slots=True)
class TextDelta:
    """The newest piece of stage ``stage``'s streamed text (possibly empty)."""

    stage: int
    text: str


@dataclass(frozen=True, slots=True)
class MediaDelta:
    """The media of the newest piece of stage ``stage``'s chunked output (one chunk's audio, in
    chunk order). The stage's whole output comes with its :class:`StageDone`."""

    stage: int
    items: tuple[MediaItem, ...]


@dataclass(frozen=True, slots=True)
class StageDone:
    """Stage ``stage`` is done with the request, having reported ``metrics`` (queue_wait_ms,
    execution_ms, batch_size, batch_id...).

    ``result`` is a final stage's whole output (its text, media, tensors, as in the request's
    ``outputs_by_stage``); None for an inner stage, whose output went on to the next stage only."""

    stage: int
    metrics: dict[str, Any] = field(default_factory=dict)
    result: StageResult | None = None


@dataclass(frozen=True, slots=True)
class Final:
    """The request is over: ``output`` has every requested final stage's result and the request's
    metrics (``e2e_ms``...)."""

    output: OmniRequestOutput

    @property
    def error(self) -> OmniError | None:
        """The typed error that ended the request (an ``Omni.generate`` output); None when it
        succeeded. ``AsyncOmni.events`` raises the error instead of yielding it."""
        return self.output.error


#: Any event :func:`events_of` makes.
Event = Progress | TextDelta | MediaDelta | StageDone | Final


def events_of(out: OmniRequestOutput) -> tuple[Event, ...]:
    """The events one output carries, in the order of the module's docstring; none for a
    streamed piece with neither text nor media (tensors only)."""
    events: list[Event] = []
    progress = out.progress
    if progress is not None:
        if progress.stage_done:
            events.append(StageDone(progress.stage_id, out.metrics))
        elif progress.step is not None and progress.steps is not None:
            events.append(Progress(progress.stage_id, progress.step, progress.steps))
    if out.text_delta is not None:
        events.append(TextDelta(out.stage_id, out.text_delta))
    if out.media_delta:
        events.append(MediaDelta(out.stage_id, tuple(out.media_delta)))
    if out.stage_finished:
        result = out.outputs_by_stage.get(out.stage_id) or StageResult(stage_id=out.stage_id)
        events.append(StageDone(out.stage_id, out.metrics, result))
    if out.finished or out.error is not None:
        events.append(Final(out))
    return tuple(events)
