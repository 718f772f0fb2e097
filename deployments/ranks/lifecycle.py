"""Lifecycle rules over the rows: which ranks take work, which may be called at all, and
how a rank moves between live, draining, starting and parked (pure: no I/O).

With a fixed ``dp_size`` every rank is live (or down for now). Elastic ranks
(``scaler.py``) start parked; a wanted one is woken (``starting``) and takes work once
it answers (``live``); one let go gets no new work (``draining``) and, once Serve has
released its replica, is ``parked``.

**The gate** (``may_call``): a rank Serve may stop gets no call at all, from anyone, or
Serve would keep it (and its GPU). Parked ranks get none; a starting one only its wake,
from the roster that holds ranks (the app's scaler); a draining one only while no wanted
rank is up (then the draining ones serve); a hold only from the holder, and only on a
wanted elastic rank. Every rank call goes through ``Roster.call``, which asks the gate.
"""

from __future__ import annotations

from collections.abc import Sequence

from .row import LIVE, PARKED, STARTING, Row

# Why a rank is called (the gate's question).
ENCODE, POLL, PROBE, INFO, PUSH, HEALTH, HOLD, WAKE = (
    "encode",
    "load poll",
    "probe",
    "info",
    "push",
    "health poll",
    "hold",
    "wake",
)
PURPOSES = (ENCODE, POLL, PROBE, INFO, PUSH, HEALTH, HOLD, WAKE)


def takes_work(rows: Sequence[Row]) -> set[int]:
    """Live, wanted and up: the ranks new work goes to."""
    return {r for r, row in enumerate(rows) if row.state == LIVE}


def down(rows: Sequence[Row]) -> set[int]:
    return {r for r, row in enumerate(rows) if row.is_down}


def failed(rows: Sequence[Row]) -> set[int]:
    """Ranks down for failing (not merely for being late or silent)."""
    return {r for r, row in enumerate(rows) if row.is_down and not row.slow}


def live(rows: Sequence[Row]) -> set[int]:
    return {r for r, row in enumerate(rows) if row.phase == LIVE}


def excluded(rows: Sequence[Row]) -> set[int]:
    """Ranks to give no new work: all but those taking work; when none does, the live ones
    that are draining may; when none of those is up either, the slow ones still work (only
    later than hoped). Starting and parked ranks never get work.

    >>> excluded([Row(), Row(wanted=False, fixed=False)])
    {1}
    >>> excluded([Row(down_until=5.0), Row(wanted=False, fixed=False)])
    {0}
    """
    everyone = set(range(len(rows)))
    for usable in (takes_work(rows), live(rows) - down(rows), live(rows) - failed(rows)):
        if usable:
            return everyone - usable
    return everyone


def up(rows: Sequence[Row]) -> set[int]:
    """The ranks new work may go to that are not down (late, silent or failed)."""
    return set(range(len(rows))) - excluded(rows) - down(rows)


def may_call(rows: Sequence[Row], rank: int, purpose: str, holder: bool) -> str | None:
    """None when ``rank`` may be called for ``purpose`` by a roster (``holder``: the one
    that holds and wakes elastic ranks); otherwise why not (the module's gate).

    >>> rows = [Row(), Row(phase=PARKED, wanted=False, fixed=False)]
    >>> may_call(rows, 0, ENCODE, False) is None, may_call(rows, 1, POLL, False)
    (True, 'rank 1 is parked: it gets no call until it is wanted and woken')
    """
    assert purpose in PURPOSES, purpose
    row = rows[rank]
    if purpose == WAKE:
        if holder and row.phase == STARTING:
            return None
        return f"rank {rank} is {row.state}: only the scaler wakes a starting rank"
    if purpose == HOLD:
        if holder and not row.fixed and row.phase == LIVE and row.wanted:
            return None
        return f"rank {rank} is {row.state}: only the scaler holds a wanted elastic rank"
    if row.fixed:
        return None
    if row.phase == PARKED:
        return f"rank {rank} is parked: it gets no call until it is wanted and woken"
    if row.phase == STARTING:
        return f"rank {rank} is starting: it gets no call but its wake until it answers"
    if row.wanted or rank in up(rows):  # draining ones serve while no wanted rank is up
        return None
    return f"rank {rank} is draining: Serve may stop it once it gets no call"


def set_phase(row: Row, phase: str, wanted: bool, why: str) -> None:
    """Move an elastic rank to ``phase``, wanted or not, for ``why``; leaving LIVE, its
    replica (and its cache) is gone or going: a new generation."""
    if phase != LIVE and row.phase == LIVE:
        row.generation += 1
    row.phase, row.wanted, row.why = phase, wanted, why


def released(row: Row, why: str) -> None:
    """The rank has no replica any more: parked, and what it reported is forgotten."""
    if row.phase != PARKED:
        set_phase(row, PARKED, False, why)
    row.down_until, row.report, row.progress, row.replica = None, None, None, None
    row.heard = float("-inf")
