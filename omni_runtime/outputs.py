"""What callers get back: :class:`OmniRequestOutput` (built in the caller's thread)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from omni_runtime.exceptions import OmniError
from omni_runtime.media import AudioItem, ImageItem, MediaItem, VideoItem


@dataclass
class StageResult:
    """One final stage's output for one request."""

    stage_id: int
    text: str | None = None
    #: Images (and the other media kinds) this stage made, in order.
    media: list[MediaItem] = field(default_factory=list)
    #: Named numpy arrays / torch tensors (``latents``, float ``images``...).
    tensors: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    _images: list[Any] | None = field(default=None, repr=False, compare=False)

    @property
    def images(self) -> list[Any]:
        """This stage's images as PIL images (made once, on first use)."""
        if self._images is None:
            self._images = [m.to_pil() for m in self.media if isinstance(m, ImageItem)]
        return self._images

    @property
    def videos(self) -> list[VideoItem]:
        """This stage's videos: ``.frames`` (uint8 FxHxWx3), ``.fps``, ``.save(path)``."""
        return [m for m in self.media if isinstance(m, VideoItem)]

    @property
    def audios(self) -> list[AudioItem]:
        """This stage's audio clips: ``.samples`` (float32 channels x n), ``.sample_rate``, ``.save(path)``."""
        return [m for m in self.media if isinstance(m, AudioItem)]


@dataclass(frozen=True)
class RequestProgress:
    """What an output that only reports progress says: ``step`` of ``steps`` of stage
    ``stage_id`` are done, or (``stage_done``) that inner stage is done with the request."""

    stage_id: int
    step: int | None = None
    steps: int | None = None
    stage_done: bool = False


@dataclass
class OmniRequestOutput:
    """The result of one request (one prompt).

    ``Omni.generate`` returns one per prompt, in input order, with every requested final output.
    ``AsyncOmni.generate`` yields one each time a final stage delivers (and for each streamed text
    delta); fields accumulate, and the last one has ``finished=True``. ``omni_runtime.events``
    reads one as typed events (``AsyncOmni.events`` yields those instead).
    """

    request_id: str
    #: The stage that produced the latest part of this output.
    stage_id: int
    finished: bool = False
    #: Every final stage's media items, in stage order (``images`` is the images among them, as
    #: PIL images; ``videos`` the videos, ``audios`` the audio clips).
    media: list[MediaItem] = field(default_factory=list)
    text: str | None = None
    #: The newest streamed piece of ``text`` (AsyncOmni streaming); None otherwise.
    text_delta: str | None = None
    #: The media of the newest streamed piece of a chunked stage's output (AsyncOmni streaming:
    #: one chunk's audio, in chunk order); empty otherwise. The stage's whole output, in
    #: ``media``, comes once its last chunk is done.
    media_delta: list[MediaItem] = field(default_factory=list)
    #: None, or the typed error that ended this request.
    error: OmniError | None = None
    #: Of the stage that delivered last: queue_wait_ms, admission_wait_ms, execution_ms,
    #: batch_size, batch_id, replica_id, seed, finished_at, e2e_ms... A plain dict for callers:
    #: the keys a stage reports vary with its runner (docs/architecture.md lists them).
    metrics: dict[str, Any] = field(default_factory=dict)
    outputs_by_stage: dict[int, StageResult] = field(default_factory=dict)
    #: On an output that only reports progress (``finished=False``, nothing new to read): a step
    #: (sent at most every 0.3 s or so), or that a stage that is not a final one is done. None on
    #: every other output.
    progress: RequestProgress | None = None
    #: True when this output completes stage ``stage_id``: its whole result is in
    #: ``outputs_by_stage`` (a final stage's output, not a streamed piece or a progress notice).
    stage_finished: bool = False

    @property
    def images(self) -> list[Any]:
        """The images of every final stage, as PIL images (each made once per output)."""
        return [img for r in self.outputs_by_stage.values() for img in r.images]

    @property
    def videos(self) -> list[VideoItem]:
        """The videos of every final stage: ``.frames`` (uint8 FxHxWx3), ``.fps`` and
        ``.save("clip.mp4")`` (the format from the suffix, through the encoder registry)."""
        return [video for r in self.outputs_by_stage.values() for video in r.videos]

    @property
    def audios(self) -> list[AudioItem]:
        """The audio clips of every final stage: ``.samples`` (float32 ``channels x n``, mono
        too), ``.sample_rate`` and ``.save("clip.wav")`` (the format from the suffix)."""
        return [clip for r in self.outputs_by_stage.values() for clip in r.audios]

    def snapshot(self) -> OmniRequestOutput:
        """A copy whose containers later deliveries do not change (AsyncOmni yields these)."""
        return replace(
            self,
            media=list(self.media),
            metrics=dict(self.metrics),
            outputs_by_stage={k: replace(v) for k, v in self.outputs_by_stage.items()},
        )

    @property
    def tensors(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for result in self.outputs_by_stage.values():
            merged.update(result.tensors)
        return merged
