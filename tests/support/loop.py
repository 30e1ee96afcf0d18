"""The event-loop lag probe of the asyncio tests: "never blocks the loop" as a figure.

``async with LagProbe() as probe:`` runs, on the running loop, a task that sleeps
``tick`` seconds (default 5 ms) again and again and records by how much each sleep
overshot: ``probe.max_lag`` (seconds, the largest overshoot: how long the loop was kept
from running it) and ``probe.ticks`` (sleeps completed). A blocking call on the loop (a
sync Redis or ORM call, ``time.sleep``) shows up as a lag of its duration.
"""

from __future__ import annotations

import asyncio
import time


class LagProbe:
    """An async context manager measuring the running loop's lag while its block runs."""

    def __init__(self, tick: float = 0.005):
        self.tick = tick
        #: The largest overshoot of a ``tick`` sleep seen so far (seconds).
        self.max_lag = 0.0
        #: How many sleeps completed.
        self.ticks = 0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.tick)
            self.max_lag = max(self.max_lag, time.perf_counter() - start - self.tick)
            self.ticks += 1

    async def __aenter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.sleep(0)  # the probe's first sleep starts before the block
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
