"""Tasks started and not awaited by their starter (a control call, closing a dead replica).

The event loop holds tasks only weakly: one nobody references can be collected mid-flight. A
:class:`BackgroundTasks` keeps each alive until it ends, and lets its owner wait for all of them
when it closes, so none is cut off or left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any


class BackgroundTasks:
    """The running background tasks of one owner, on the owner's event loop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self) -> None:
        """Until every task (also those started meanwhile) has ended; their errors are theirs."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
