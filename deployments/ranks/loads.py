"""Load rules over the rows: the work a roster has dispatched to each rank, the ranks'
load reports, the progress a report shows, which reports are old enough to poll again
(pure: no I/O).

A rank's load is this roster's own work on it (exact: dispatched, not answered) plus
the other callers' from its last report (``kimi_encoder.load.rank_loads``). A report
shows progress when the rank has answered calls since its last one (or is another
process), or holds no work to make progress on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kimi_encoder.cost import CostModel
from kimi_encoder.load import rank_loads

from .records import LoadReport
from .row import Row


def observe(row: Row, report: LoadReport, now: float, at: float) -> bool:
    """Take ``report`` (``now`` on the roster's clock, ``at`` on its monotonic one): True
    when it shows progress.

    >>> from kimi_encoder.load import Work
    >>> from deployments.ranks.records import Progress
    >>> row, busy = Row(), {"a": Work.of([4])}
    >>> observe(row, LoadReport(busy, CostModel.patches(), Progress("p", 1)), 1.0, 1.0)
    True
    >>> observe(row, LoadReport(busy, CostModel.patches(), Progress("p", 1)), 2.0, 2.0)
    False
    """
    mark = (report.progress.instance, report.progress.answered)
    progress = report.idle or mark != row.progress
    if progress:
        row.heard = now
    row.progress, row.report, row.reported_at = mark, report, at
    return progress


def stale(rows: Sequence[Row], ranks: Iterable[int], at: float, interval_s: float) -> list[int]:
    """Of ``ranks``, those whose last report is at least ``interval_s`` old at ``at``."""
    return [r for r in sorted(ranks) if at - rows[r].reported_at >= interval_s]


def loads(rows: Sequence[Row], caller: str, model: CostModel) -> list[float]:
    """Outstanding cost of each rank under ``model``: ``caller``'s own work (exact) and the
    other callers' from the rank's last report."""
    reports = [row.report.by_caller if row.report else None for row in rows]
    return rank_loads([row.own for row in rows], reports, caller, model)
