"""One decision of the elastic ranks, and the views it is made from (Ray-free, pure).

With elastic ranks (``dp_size: {min, max}``) one process decides how many ranks the app
wants, the app's ``RankScaler`` (``deployments/decider.py``); every ingress replica
follows its ``Decision``. It decides from the work queued on every rank, counted two
ways that cover each other:

- each wanted rank's load report (``records.LoadReport``: the work each ingress replica
  has queued or running on it), which the scaler polls itself every tick;
- each ingress replica's ``IngressView``: the work it has dispatched to each rank and
  not had answered, which includes calls still on their way to the rank. A replica
  sends its view with every request for the decision (about once a second, idle or not).

For each rank and each ingress replica the larger of the two counts, each weighed by
its age (``weight``: whole while fresh, falling to nothing as it grows old), so a report
or a view that nobody refreshed (a rank that stopped answering, an ingress replica that
died) stops counting instead of holding a rank alive at idle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kimi_encoder.cost import CostModel
from kimi_encoder.load import Work

from .row import LIVE, STARTING


def weight(age_s: float, fresh_s: float, stale_s: float) -> float:
    """How much a report or a view ``age_s`` old counts: whole up to ``fresh_s``, then
    less in a straight line, nothing from ``stale_s`` on.

    >>> [weight(a, 1.0, 5.0) for a in (0.0, 1.0, 3.0, 5.0, 240.0)]
    [1.0, 1.0, 0.5, 0.0, 0.0]
    """
    if age_s <= fresh_s:
        return 1.0
    if age_s >= stale_s:
        return 0.0
    return (stale_s - age_s) / (stale_s - fresh_s)


@dataclass(frozen=True)
class IngressView:
    """What one ingress replica (``caller``, as the ranks' reports name it) has dispatched
    to each rank and not had answered."""

    caller: str
    own: Sequence[Work]


@dataclass(frozen=True)
class Seen:
    """A count of queued work and when it was taken (on the scaler's clock)."""

    work: Work
    at: float


def queued_seconds(
    reports: Mapping[int, Mapping[str, Seen]],
    views: Mapping[int, Mapping[str, Seen]],
    model: CostModel,
    now: float,
    fresh_s: float,
    stale_s: float,
) -> dict[int, float]:
    """Seconds of work queued on each rank: for every caller, the larger of what the rank
    reported of it and what the caller said it dispatched there, each weighed by its age.

    ``reports[rank][caller]`` and ``views[rank][caller]`` are the two counts.

    >>> m, w = CostModel.patches(), Work.of([100])
    >>> queued_seconds({0: {"a": Seen(w, 9.0)}}, {0: {"a": Seen(Work(), 9.5)}}, m, 10.0, 1, 5)
    {0: 100.0}
    >>> queued_seconds({0: {"a": Seen(w, 7.0)}}, {}, m, 10.0, 1, 5)  # two seconds stale
    {0: 50.0}
    """
    out: dict[int, float] = {}
    for rank in sorted(set(reports) | set(views)):
        by_rank, by_view = reports.get(rank, {}), views.get(rank, {})
        total = 0.0
        for caller in set(by_rank) | set(by_view):
            counts = [by_rank.get(caller), by_view.get(caller)]
            total += max(
                seen.work.cost(model) * weight(now - seen.at, fresh_s, stale_s)
                for seen in counts
                if seen is not None
            )
        out[rank] = total
    return out


@dataclass(frozen=True)
class Decision:
    """The scaler's decision, as every ingress replica follows it.

    ``phases[r]``: the roster's LIVE (wanted, takes work), DRAINING (live, given no new
    work: it drains, then parks), STARTING or PARKED (no replica); ``why[r]`` the
    reason of its last change. ``by`` names the scaler (its replica), ``instance`` its
    process (a replacement starts its ``seq`` again), ``made_at`` its ``time.time()``;
    ``reports_age_s`` the age of the newest count from each rank and ingress replica it
    weighed.
    """

    instance: str
    seq: int
    by: str
    made_at: float
    phases: tuple[str, ...]
    why: tuple[str, ...]
    queued_s: float
    target_queue_s: float
    dp_min: int
    reports_age_s: Mapping[str, float] = field(default_factory=dict)
    decisions: tuple[Mapping[str, Any], ...] = ()

    @property
    def wanted(self) -> list[int]:
        """Ranks wanted: taking work, or starting."""
        return [r for r, phase in enumerate(self.phases) if phase in (LIVE, STARTING)]

    def info(self, now: float) -> dict[str, Any]:
        """For ``/v1/info``'s ``scaling`` (``now``: this process's ``time.time()``)."""
        return {
            "dp_min": self.dp_min,
            "dp_max": len(self.phases),
            "wanted": self.wanted,
            "decided_by": self.by,
            "decision": self.seq,
            "decision_age_s": round(max(0.0, now - self.made_at), 3),
            "queued_s": round(self.queued_s, 6),
            "target_queue_s": self.target_queue_s,
            "reports_age_s": {k: round(v, 3) for k, v in sorted(self.reports_age_s.items())},
            "decisions": list(self.decisions),
        }
