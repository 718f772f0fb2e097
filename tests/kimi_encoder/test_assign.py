"""Owner assignment: a table of edge cases for the pure function."""

import pytest

from kimi_encoder.assign import assign_owners, group_by_owner


@pytest.mark.parametrize(
    ("costs", "ranks", "loads", "owners"),
    [
        ([], 3, None, []),
        ([8, 5, 3], 2, None, [0, 1, 1]),
        ([1000, 100, 200, 50], 2, None, [0, 1, 1, 1]),
        ([4], 4, None, [0]),
        ([4, 4], 4, None, [0, 1]),  # fewer images than ranks
        ([5, 5, 5], 1, None, [0, 0, 0]),  # one rank
        ([2, 2, 2, 2], 2, None, [0, 1, 0, 1]),  # ties keep input order, lowest rank first
        ([4096] + [256] * 15, 2, None, [0] + [1] * 15),  # one huge image
        ([3, 3], 2, [10, 0], [1, 1]),  # outstanding load counts
        ([3], 3, [1, 0, 0], [1]),
    ],
    ids=[
        "none",
        "reference",
        "vllm-example",
        "one-image",
        "fewer-than-ranks",
        "one-rank",
        "ties",
        "one-huge",
        "loaded",
        "loaded-tie",
    ],
)
def test_assign_owners(costs, ranks, loads, owners):
    assert assign_owners(costs, ranks, loads) == owners


def test_errors():
    with pytest.raises(ValueError, match="num_ranks must be at least 1"):
        assign_owners([1], 0)
    with pytest.raises(ValueError, match="loads has 1 entries for 2 ranks"):
        assign_owners([1], 2, loads=[0])


def test_group_by_owner_keeps_input_order():
    assert group_by_owner([1, 0, 1, 1], 3) == {1: [0, 2, 3], 0: [1]}
