"""An ingress replica's side of the one decision (``scaler.py``): it asks the app's scaler
for the decision, carrying its own view of its dispatched work, and its roster follows
each decision. While the scaler cannot be reached it follows the last one."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Protocol

from ..timing import FOLLOW_RETRY_S, FOLLOW_WAIT_S
from .decision import Decision, IngressView
from .roster import Roster

log = logging.getLogger("ray.serve")


class ScalerClient(Protocol):
    """The app scaler, as an ingress replica calls it (``handles.ScalerHandle``)."""

    def decision(self, instance: str, seen: int, view: IngressView, wait_s: float) -> Any:
        """Its ``Decision`` once it changes from (``instance``, ``seen``) or after ``wait_s``
        (an awaitable); ``view`` is the caller's."""
        ...


class Follower:
    """An ingress replica's side of the one decision: it asks the scaler for it (carrying
    its own view), and its roster follows each decision (module doc)."""

    def __init__(self, roster: Roster, lo: int, scaler: ScalerClient):
        self.roster = roster
        self.lo = lo
        self.scaler = scaler
        self.last: Decision | None = None
        self.heard_at = -math.inf  # time.monotonic() of the last answer
        self.failures = 0  # asks that failed (the scaler being replaced, say)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            last = self.last
            view = IngressView(self.roster.caller, self.roster.own_work())
            instance, seen = (last.instance, last.seq) if last else ("", -1)
            try:
                decision = await self.scaler.decision(instance, seen, view, FOLLOW_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - the scaler is being replaced: keep the last
                self.failures += 1
                if self.failures == 1 or self.failures % 30 == 0:
                    log.warning("elastic ranks: no decision from the scaler (%r); following "
                                "the last one", exc)  # fmt: skip
                await asyncio.sleep(FOLLOW_RETRY_S)
                continue
            self.heard_at = time.monotonic()
            self.follow(decision)

    def follow(self, decision: Decision) -> None:
        """Every elastic rank as ``decision`` says: given work, no new work, or nothing."""
        self.last = decision
        for rank in range(self.lo, min(len(self.roster), len(decision.phases))):
            self.roster.follow(rank, decision.phases[rank], decision.why[rank])

    def info(self) -> dict[str, Any]:
        if self.last is None:
            wanted = list(range(self.lo))
            return {"dp_min": self.lo, "dp_max": len(self.roster), "wanted": wanted,
                    "decided_by": None, "decisions": []}  # fmt: skip
        heard = time.monotonic() - self.heard_at
        return {**self.last.info(time.time()), "heard_s": round(heard, 3)}
