"""What a roster says of its ranks in ``/v1/info``: its view of each, each rank's own
report (asked through the gate: a rank that may not be called is reported without a
call, which would keep its replica), and its failover counters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import lifecycle
from .lifecycle import INFO

if TYPE_CHECKING:
    from .roster import Roster


def rank_view(roster: Roster, rank: int) -> dict[str, Any]:
    """The roster's view of ``rank``."""
    row = roster.rows[rank]
    return {
        "rank": rank,
        "state": row.state,
        "scaling_reason": row.why,
        "down_reason": row.reason if row.is_down else None,
    }


async def rank_report(roster: Roster, rank: int, timeout_s: float) -> dict[str, Any]:
    """The rank's own report with the roster's view (only the view for a rank the gate
    keeps from calls)."""
    seen = rank_view(roster, rank)
    if lifecycle.may_call(roster.rows, rank, INFO, roster.holds) is not None:
        return seen
    try:
        return {**await roster.ask(rank, INFO, timeout_s), **seen}
    except Exception as exc:  # noqa: BLE001 - a sick rank is reported, not raised
        return {**seen, "state": "unavailable", "error": f"{type(exc).__name__}: {exc}"}


def failover(roster: Roster) -> dict[str, Any]:
    """The failures, recoveries and re-dispatches the roster has seen."""
    rows = roster.rows
    return {
        "ranks_up": sorted(set(range(len(rows))) - roster.down()),
        "down": {r: row.reason for r, row in enumerate(rows) if row.is_down},
        "replicas": [row.replica for row in rows],
        "unavailable_errors": list(roster.failures),
        "recoveries": list(roster.recoveries),
        "ignored_old_replica_errors": roster.ignored,
        "redispatched_images": roster.redispatched,
        "hedged_images": roster.hedged,
        "cooldown_s": roster.rules.cooldown_s,
    }
