"""Health rules over a ``Row``: when a call is late, when a rank is down and when it is up
again, when missed load reports make it silent (pure: no clock of their own, no I/O).

Load is not failure. Both waits of a call (for a replica to take it, for its answer)
count from the later of its send time and the rank's last progress: an encode answer,
or a load report saying it answered more calls than before or holds no work. A rank
that keeps answering is busy, not hung, however long its queue makes a call wait.

Health is kept in the order things happened: a rank marked down gets no work until an
answer to a call sent *after* the failure, or from another replica of the rank (its
replacement), brings it back; a failure of a replica the rank has since replaced does
not mark the replacement down. Being late says less than failing: a late mark never
overwrites a failure's reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..args import DispatchArgs
from .calls import RankUnavailableError
from .row import Row


@dataclass(frozen=True)
class Lateness:
    """The lateness settings (``dispatch``)."""

    cooldown_s: float
    route_timeout_s: float
    slow_after_s: float
    slow_factor: float

    @classmethod
    def of(cls, dispatch: DispatchArgs) -> Lateness:
        d = dispatch
        return cls(d.cooldown_s, d.route_timeout_s, d.slow_after_s, d.slow_factor)


def late_after_s(rules: Lateness, expected_s: float | None) -> float:
    """How long a call may go without an answer while its rank shows no progress:
    ``slow_factor`` x the time the fitted model expects, at least ``slow_after_s``.

    >>> late_after_s(Lateness(2, 0.3, 1, 3), None), late_after_s(Lateness(2, 0.3, 1, 3), 2.0)
    (1, 6.0)
    """
    return max(rules.slow_after_s, rules.slow_factor * (expected_s or 0.0))


def late_at(rules: Lateness, row: Row, sent: float, routed: bool, after_s: float) -> float:
    """When a call sent at ``sent`` counts as late, as its rank's progress stands: while no
    replica has taken it, ``route_timeout_s`` after it was sent unless its rank showed
    progress within ``slow_after_s`` (then it waits in a busy rank's or a busy caller's
    queue, not for a replacement); once taken, ``after_s`` past the later of its send
    time and its rank's last progress."""
    if not routed:
        return max(sent + rules.route_timeout_s, row.heard + rules.slow_after_s)
    return max(sent, row.heard) + after_s


def late_error(rank: int, replica: str | None, waited_s: float, routed: bool, after_s: float):
    """The error that marks a late call's rank slow."""
    if not routed:
        why = f"no replica took the call in {waited_s:.2f} s"
    else:
        why = f"no answer within {after_s:.2f} s, past what its load predicts"
    return RankUnavailableError(
        rank, f"{why}, and no progress from the rank meanwhile", replica, slow=True
    )


# What marking a rank down did.
IGNORED, DOWN_NOW, STILL_DOWN = "ignored", "down", "still down"


def mark_down(
    rules: Lateness, row: Row, error: RankUnavailableError, started: float, now: float
) -> str:
    """``error`` ended a call sent at ``started``: the row is down until ``now`` plus the
    cool-down, unless the failure is an old replica's (its replacement answered a call
    sent after it): ``IGNORED``. ``DOWN_NOW`` when it was up."""
    if (
        error.replica is not None
        and row.replica is not None
        and error.replica != row.replica
        and row.replica_since > started
    ):
        return IGNORED
    was_up = row.down_until is None
    row.down_until = now + rules.cooldown_s
    if was_up or row.slow or not error.slow:  # being late says less than failing
        row.down_at, row.reason, row.failed = now, str(error), error.replica
        row.slow = error.slow
    return DOWN_NOW if was_up else STILL_DOWN


def mark_up(row: Row, replica: str | None, started: float) -> bool:
    """An answer from ``replica`` to a call sent at ``started``: the row is up unless the
    call was sent before it was marked down, to the same replica. True when it was down
    and is up now."""
    stale = started < row.down_at and not row.slow  # a late answer proves it lives
    if stale and (replica is None or row.failed is None or replica == row.failed):
        return False  # a result that began before the failure says nothing of now
    if started >= row.replica_since:
        row.replica, row.replica_since = replica, started
    if row.down_until is None:
        return False
    row.down_until = None
    return True


def missed_report(
    rules: Lateness, rank: int, row: Row, error: BaseException, now: float
) -> tuple[RankUnavailableError, float] | None:
    """A rank missed its load report: what to mark it down with (and from when), or None.

    Unavailable if the poll failed (the replica died). Otherwise (not routed in time, or
    quiet) a poll waits in a busy rank's or a busy caller's queue as any call does, so one
    miss says little: while this roster has calls in flight on the rank, their own
    lateness judges it; without, the rank is slow once its polls have gone on missing for
    ``slow_after_s`` with no progress from it in between."""
    if row.down_until is not None:
        return None
    if isinstance(error, RankUnavailableError) and not error.slow:
        return error, now
    if row.calls:
        return None
    if row.missed is None or row.heard > row.missed:
        row.missed = now  # the first miss since the rank last showed progress
        return None
    if now - row.missed < rules.slow_after_s:
        return None
    first, row.missed = row.missed, None  # once back up, its next miss is a first one
    why = f"no load report for {now - first:.2f} s ({error!r})"
    return RankUnavailableError(rank, why, slow=True), first


def retry_after_s(rows: Iterable[Row], now: float) -> int:
    """Whole seconds until the first down rank is probed again (at least 1).

    >>> retry_after_s([Row(down_until=12.5), Row()], 10.0)
    3
    """
    pending = [r.down_until for r in rows if r.down_until is not None]
    return max(1, math.ceil(min(pending, default=0.0) - now))
