"""Outstanding work as moments, and the loads one ingress replica sees."""

from __future__ import annotations

import pytest

from kimi_encoder.cost import CostModel
from kimi_encoder.load import Work, rank_loads

QUADRATIC = CostModel(a=1e-6, b=1e-3, c=0.01)


def test_moments_price_any_quadratic_exactly():
    sizes = [4096, 256, 256, 64]
    assert Work.of(sizes).cost(QUADRATIC) == pytest.approx(sum(QUADRATIC(p) for p in sizes))
    assert Work.of(sizes).cost(CostModel.patches()) == sum(sizes)
    assert (Work.of(sizes) - Work.of([256])) == Work.of([4096, 256, 64])
    assert Work.from_list(Work.of(sizes).as_list()) == Work.of(sizes)


def test_removing_more_than_outstanding_is_a_bug():
    with pytest.raises(AssertionError):
        Work.of([4]) - Work.of([8])


@pytest.mark.parametrize(
    ("own", "reports", "loads"),
    [
        ([Work(), Work()], [None, None], [0.0, 0.0]),  # nothing anywhere
        ([Work.of([8]), Work()], [None, None], [8.0, 0.0]),  # own work before any report
        # a report's entry for this replica is stale: its own ledger wins
        ([Work(), Work()], [{"me": Work.of([8])}, None], [0.0, 0.0]),
        # another replica's work counts
        ([Work.of([2]), Work()], [{"me": Work.of([2])}, {"other": Work.of([5, 1])}], [2.0, 6.0]),
        ([Work()], [{"a": Work.of([1]), "b": Work.of([3])}], [4.0]),  # several other callers
    ],
    ids=["idle", "own-only", "own-entry-ignored", "other-replica", "two-others"],
)
def test_rank_loads(own, reports, loads):
    assert rank_loads(own, reports, "me", CostModel.patches()) == loads


def test_rank_loads_needs_one_report_per_rank():
    with pytest.raises(ValueError, match="2 own entries but 1 reports"):
        rank_loads([Work(), Work()], [None], "me", CostModel.patches())
