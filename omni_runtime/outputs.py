"""What callers get back: :class:`OmniRequestOutput` (built in the caller's thread)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from omni_runtime.exceptions import OmniError


@dataclass
class StageResult:
    """One final stage's output for one request."""

    stage_id: int
    text: str | None = None
    #: PIL images.
    images: list[Any] = field(default_factory=list)
    #: Named numpy arrays / torch tensors (``latents``, float ``images``...).
    tensors: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class OmniRequestOutput:
    """The result of one request (one prompt).

    ``Omni.generate`` returns one per prompt, in input order, with every requested final output.
    ``AsyncOmni.generate`` yields one each time a final stage delivers (and for each streamed text
    delta); fields accumulate, and the last one has ``finished=True``.
    """

    request_id: str
    #: The stage that produced the latest part of this output.
    stage_id: int
    finished: bool = False
    images: list[Any] = field(default_factory=list)
    text: str | None = None
    #: The newest streamed piece of ``text`` (AsyncOmni streaming); None otherwise.
    text_delta: str | None = None
    #: None, or the typed error that ended this request.
    error: OmniError | None = None
    #: Of the stage that delivered last: queue_wait_ms, admission_wait_ms, execution_ms,
    #: batch_size, batch_id, seed, e2e_ms...
    metrics: dict[str, Any] = field(default_factory=dict)
    outputs_by_stage: dict[int, StageResult] = field(default_factory=dict)
    #: On an output that only reports progress (``finished=False``, nothing new to read):
    #: ``{"stage_id", "step", "steps"}`` after a denoising step (sent at most every 0.3 s or so), or
    #: ``{"stage_id", "stage_done": True}`` when a stage that is not a final one is done. None on
    #: every other output.
    progress: dict[str, Any] | None = None

    def snapshot(self) -> OmniRequestOutput:
        """A copy whose containers later deliveries do not change (AsyncOmni yields these)."""
        return replace(
            self,
            images=list(self.images),
            metrics=dict(self.metrics),
            outputs_by_stage={k: replace(v) for k, v in self.outputs_by_stage.items()},
        )

    @property
    def tensors(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for result in self.outputs_by_stage.values():
            merged.update(result.tensors)
        return merged
