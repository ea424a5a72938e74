"""A job's record, typed: :class:`JobRecord`. The stores keep it as a flat dict of JSON values (one
Redis hash field per key); :meth:`JobRecord.from_store` and :meth:`JobRecord.to_store` are the
one place it is converted, and :meth:`JobRecord.public` the one view clients get."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

#: Keys clients never see: the stored request, where it came from, its trace and its owner.
HIDDEN = frozenset({"request", "base_url", "traceparent", "trace", "owner", "cancel_requested"})


@dataclass(kw_only=True)
class JobRecord:
    """A job as the store holds it (docs/jobs.md, "The job"). Field order is the order of
    the keys in the JSON a client gets."""

    job_id: str
    object: str = "job"
    task: str | None = None
    model: str | None = None
    status: str = "queued"
    priority: int = 0
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    #: The last step: ``{"stage_id", "step", "steps"}``.
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    #: The gateway that runs the job; with ``attempts``, the fence of its writes.
    owner: str | None = None
    attempts: int = 1
    #: The request as submitted (a ``GenerateRequest`` as JSON), to run it again after a takeover.
    request: dict[str, Any] = field(default_factory=dict)
    base_url: str = ""
    traceparent: str | None = None
    trace_id: str | None = None
    trace: list[dict[str, Any]] = field(default_factory=list)
    #: Keys of the stored dict that are no field here (``cancel_requested``, set by a store).
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_store(cls, stored: dict[str, Any]) -> JobRecord:
        known = {k: v for k, v in stored.items() if k in _FIELDS}
        return cls(**known, extra={k: v for k, v in stored.items() if k not in _FIELDS})

    def to_store(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in _FIELDS}
        return out | self.extra

    def update(self, fields: dict[str, Any]) -> None:
        """Merge store fields (what an event writes with it) into this record."""
        for key, value in fields.items():
            if key in _FIELDS:
                setattr(self, key, value)
            else:
                self.extra[key] = value

    @property
    def cancel_requested(self) -> bool:
        return bool(self.extra.get("cancel_requested"))

    def public(self) -> dict[str, Any]:
        """What clients see of the job."""
        return {k: v for k, v in self.to_store().items() if k not in HIDDEN}


_FIELDS = tuple(f.name for f in dataclasses.fields(JobRecord) if f.name != "extra")
