"""The clock the ingress judges lateness by."""

from __future__ import annotations

import asyncio
import time

from ..timing import LOOP_TICK_S
from .row import Clock


class LoopClock:
    """Seconds as this process's event loop lived them: ``time.monotonic()`` less the
    loop's lag, the clock the ``Roster`` judges lateness by in the ingress.

    A ticker task sleeps ``tick_s`` at a time. When it wakes later than due (the loop
    busy building answers, or the process off the CPU) the clock stands still from the
    due time until it runs again. An answer that reached this process while its loop
    was stalled is then taken before anyone's call counts as late for that stall: a
    rank is late only for time in which this ingress could have seen it answer. With
    no running loop (or before the first tick) it is plain monotonic time.
    """

    def __init__(self, tick_s: float = LOOP_TICK_S, wall: Clock = time.monotonic):
        self.tick_s = tick_s
        self.wall = wall
        self.lag = 0.0  # seconds the ticker woke late, in all
        self._due: float | None = None  # when the ticker should wake next
        self._task: asyncio.Task | None = None

    def __call__(self) -> float:
        self._start()
        now = self.wall()
        late = max(0.0, now - self._due) if self._due is not None else 0.0
        return now - self.lag - late

    def _start(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._due = None  # lag of another loop says nothing about this one
            self._task = loop.create_task(self._tick())

    async def _tick(self) -> None:
        self._due = self.wall() + self.tick_s
        while True:
            await asyncio.sleep(self.tick_s)
            woke = self.wall()
            self.lag += max(0.0, woke - self._due)
            self._due = woke + self.tick_s
