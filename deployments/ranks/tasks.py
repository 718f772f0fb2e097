"""The roster's background calls: load polls, the probe of a down rank, the look-up of a
slow rank's replica, the hold of a wanted elastic rank, the wake of a starting one, and
the hand-off's health poll. Each calls through ``Roster.ask`` (the gate, the book).

They take the roster as the ``RosterView`` below, what they use of it, so this module
names no type of the roster's module, which calls it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from kimi_encoder.load import Work

from . import lifecycle
from .calls import RankUnavailableError
from .health import Lateness
from .lifecycle import HEALTH, HOLD, POLL, PROBE, WAKE
from .row import LIVE, PARKED, STARTING, Row

log = logging.getLogger("ray.serve")


class RosterView(Protocol):
    """What the background calls use of ``roster.Roster``."""

    rows: list[Row]
    rules: Lateness
    holds: bool
    hold_s: float
    report_timeout_s: float
    probe_timeout_s: float

    def clock(self) -> float: ...
    def up(self) -> set[int]: ...
    async def ask(self, rank: int, purpose: str, timeout_s: float | None, *args: Any) -> Any: ...
    async def replica_alive(self, rank: int, replica: Any) -> bool: ...
    def mark_down(self, error: RankUnavailableError, started: float) -> None: ...
    def dispatched(self, rank: int, work: Work) -> AbstractContextManager[None]: ...
    def set_phase(self, rank: int, phase: str, wanted: bool, why: str) -> None: ...


async def poll(roster: RosterView, ranks: list[int]) -> None:
    """A load report of each of ``ranks``; a miss is booked as one."""

    async def one(rank: int) -> None:
        with contextlib.suppress(Exception):  # booked: a missed report
            await roster.ask(rank, POLL, roster.report_timeout_s)

    await asyncio.gather(*(one(r) for r in ranks))


async def any_answers(roster: RosterView, timeout_s: float) -> bool:
    """Whether a rank that is up answers its load report within ``timeout_s``; every
    answer and failure is booked."""
    ranks = sorted(roster.up())
    tasks = [asyncio.ensure_future(roster.ask(r, HEALTH, timeout_s)) for r in ranks]
    try:
        for arrival in asyncio.as_completed(tasks, timeout=timeout_s):
            try:
                await arrival
                return True
            except Exception:  # noqa: BLE001 - that rank is down: ask the others
                continue
    except asyncio.TimeoutError:
        pass
    finally:
        for task in tasks:
            task.cancel()
    return False


async def look_up(roster: RosterView, rank: int, replica: Any) -> None:
    """A slow rank whose last replica no longer exists has failed."""
    if await roster.replica_alive(rank, replica):
        return
    row = roster.rows[rank]
    if row.is_down and row.slow and row.replica == replica:
        why = f"its replica {replica} is gone"
        roster.mark_down(RankUnavailableError(rank, why, replica), roster.clock())


async def recover(roster: RosterView, rank: int) -> None:
    """While ``rank`` is down, probe it every cool-down until it answers."""
    row = roster.rows[rank]
    while (until := row.down_until) is not None:
        await asyncio.sleep(max(0.0, until - roster.clock()))
        if row.down_until is None:
            return
        if row.phase != LIVE:  # parked meanwhile: nothing to probe, it starts afresh
            row.down_until = None
            return
        try:
            await roster.ask(rank, PROBE, roster.probe_timeout_s)
        except Exception:  # noqa: BLE001 - still down: another cool-down
            if row.down_until is not None:
                row.down_until = roster.clock() + roster.rules.cooldown_s


async def hold(roster: RosterView, rank: int) -> None:
    """Keep one call open on a wanted elastic rank, so Serve keeps its replica however
    long it has no work; each answer is a load report."""
    while lifecycle.may_call(roster.rows, rank, HOLD, roster.holds) is None:
        try:
            await roster.ask(rank, HOLD, None, roster.hold_s)
        except Exception:  # noqa: BLE001 - booked; held again after a cool-down
            await asyncio.sleep(roster.rules.cooldown_s)


async def wake(roster: RosterView, rank: int, timeout_s: float, failed: Callable[[int], None]):
    """The call that starts a starting rank, routed for at most ``timeout_s``; the rank
    is live once it answers, parked again (and ``failed(rank)``) if it does not."""
    row, started = roster.rows[rank], roster.clock()
    try:
        with roster.dispatched(rank, Work()):
            await roster.ask(rank, WAKE, timeout_s)
    except Exception as exc:  # noqa: BLE001 - it did not start: the live ranks serve
        if row.phase != STARTING:
            return
        if isinstance(exc, asyncio.TimeoutError):
            why = f"no replica answered within start_timeout_s={timeout_s:g} s"
        else:
            why = f"its start failed ({type(exc).__name__}: {exc})"
        serve_says = f"; Serve: {row.note}" if row.note else ""
        log.warning("rank %d could not start: %s%s", rank, why, serve_says)
        roster.set_phase(rank, PARKED, False, f"could not start: {why}{serve_says}")
        failed(rank)
        return
    if row.phase == STARTING:
        roster.set_phase(rank, LIVE, True, f"started in {roster.clock() - started:.1f} s")
