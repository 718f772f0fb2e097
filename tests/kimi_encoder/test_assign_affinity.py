"""Cache affinity and makespan helpers of owner assignment (the base rule:
tests/kimi_encoder/test_assign.py)."""

from __future__ import annotations

import pytest

from kimi_encoder.assign import assign_owners, makespan, makespan_lower_bound


@pytest.mark.parametrize(
    ("costs", "ranks", "loads", "holders", "tolerance", "owners"),
    [
        ([5, 5], 2, None, [None, None], 0.0, [0, 1]),  # no holder: the base rule
        ([5, 5], 2, None, [1, 1], 0.0, [1, 1]),  # both cached on rank 1: hits add nothing
        ([5, 5], 2, [3, 0], [0, None], 0.0, [0, 1]),  # holder busy, but less than a miss
        ([5], 2, [30, 0], [0], 0.5, [1]),  # holder too busy: encoded elsewhere
        ([5], 2, [7, 0], [0], 0.5, [0]),  # 7 <= 1.5 * (0 + 5)
        ([5], 2, [8, 0], [0], 0.5, [1]),  # 8 > 7.5
        ([5], 2, [5, 0], [0], 0.0, [0]),  # exactly the miss's finish: stays
        ([], 2, None, [], 0.0, []),  # no images
        # the call to the holder returns with the big image: hits would wait for it
        ([9, 1, 1], 3, None, [None, 0, 0], 0.0, [0, 1, 2]),
    ],
    ids=[
        "no-holder",
        "all-held",
        "holder-busy-ok",
        "holder-too-busy",
        "within-tolerance",
        "over-tolerance",
        "tie-stays",
        "no-images",
        "holder-has-the-big-one",
    ],
)
def test_affinity(costs, ranks, loads, holders, tolerance, owners):
    got = assign_owners(costs, ranks, loads, holders=holders, tolerance=tolerance)
    assert got == owners


def test_affinity_errors():
    with pytest.raises(ValueError, match="holders has 1 entries for 2 images"):
        assign_owners([1, 1], 2, holders=[0])
    with pytest.raises(ValueError, match="holder 2 of image 0 is outside"):
        assign_owners([1], 2, holders=[2])
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        assign_owners([1], 2, holders=[0], tolerance=-1)


def test_makespan_and_lower_bound():
    costs = [4096] + [256] * 15
    owners = assign_owners(costs, 2)
    assert makespan(costs, owners, 2) == 4096 == makespan_lower_bound(costs, 2)
    assert makespan_lower_bound([3, 3, 3], 2) == 4.5
    assert makespan([], [], 2) == 0.0 == makespan_lower_bound([], 2)
