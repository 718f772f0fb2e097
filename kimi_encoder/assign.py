"""Owner assignment for vision data parallelism: a pure function of costs and loads."""

from __future__ import annotations

from collections.abc import Sequence


def assign_owners(
    costs: Sequence[float], num_ranks: int, loads: Sequence[float] | None = None
) -> list[int]:
    """Owner rank of each image: largest first, to the least-loaded rank.

    Images are visited by cost, descending (stable, so equal costs keep input
    order); each goes to the rank with the smallest total load so far, ties to
    the lowest rank. ``loads`` is each rank's work already outstanding (zero
    when omitted); the cost of an image is its patch count ``t*h*w``.

    >>> assign_owners([8, 5, 3], 2)
    [0, 1, 1]
    >>> assign_owners([1000, 100, 200, 50], 2)
    [0, 1, 1, 1]
    >>> assign_owners([4, 4], 2, loads=[10, 0])
    [1, 1]
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}.")
    total = [0.0] * num_ranks if loads is None else [float(v) for v in loads]
    if len(total) != num_ranks:
        raise ValueError(f"loads has {len(total)} entries for {num_ranks} ranks.")
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min(range(num_ranks), key=lambda r: (total[r], r))
        owners[index] = rank
        total[rank] += costs[index]
    return owners


def group_by_owner(owners: Sequence[int], num_ranks: int) -> dict[int, list[int]]:
    """{rank: [item indices in input order]} for the ranks that own something."""
    groups: dict[int, list[int]] = {}
    for index, rank in enumerate(owners):
        if not 0 <= rank < num_ranks:
            raise AssertionError(f"owner {rank} of item {index} outside [0, {num_ranks})")
        groups.setdefault(rank, []).append(index)
    return groups
