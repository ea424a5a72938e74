"""How a job's event stream ends: after the final event, never before it, even when the job ends
between the stream's two reads of the store."""

from __future__ import annotations

from omni_runtime.entrypoints.jobs.store import MemoryJobStore
from omni_runtime.entrypoints.openai.job_manager import JobManager


class _EndsWhileRead(MemoryJobStore):
    """A store whose job finishes right as the stream looks at its record (the race)."""

    raced = False

    async def get(self, job_id: str) -> dict | None:
        if not self.raced:
            self.raced = True
            await self.append_event(job_id, "completed", {}, {"status": "completed"})
        return await super().get(job_id)


async def _follow(store: MemoryJobStore, after: str | None) -> list[str]:
    manager = JobManager(state=None, store=store)  # type: ignore[arg-type]
    return [e.type async for e in manager.follow("job-1", after, keepalive_s=5) if e is not None]


async def test_a_job_that_ends_between_two_reads_still_delivers_its_final_event():
    store = _EndsWhileRead()
    first = await store.create({"job_id": "job-1", "status": "running"}, ("queued", {}))
    assert await _follow(store, first) == ["completed"]


async def test_a_stream_of_a_finished_job_replays_and_ends():
    store = MemoryJobStore()
    await store.create({"job_id": "job-1", "status": "running"}, ("queued", {}))
    await store.append_event("job-1", "step", {})
    last = await store.append_event("job-1", "cancelled", {}, {"status": "cancelled"})
    assert await _follow(store, None) == ["queued", "step", "cancelled"]
    assert await _follow(store, last) == []
    assert await _follow(MemoryJobStore(), None) == []  # an unknown (or expired) job: nothing
