"""Owner assignment for vision data parallelism: a pure function of costs and loads."""

from __future__ import annotations

from collections.abc import Sequence


def assign_owners(
    costs: Sequence[float],
    num_ranks: int,
    loads: Sequence[float] | None = None,
    *,
    holders: Sequence[int | None] | None = None,
    tolerance: float = 0.0,
) -> list[int]:
    """Owner rank of each image: largest first, to the least-loaded rank.

    Images are visited by cost, descending (stable, so equal costs keep input
    order); each goes to the rank with the smallest total load so far, ties to
    the lowest rank. ``loads`` is each rank's work already outstanding (zero
    when omitted), in the same unit as ``costs`` (patch counts ``t*h*w``, or
    the seconds of a fitted ``CostModel``).

    ``holders[i]`` is the rank whose feature cache already holds image i, or
    None. A hit there costs (almost) nothing, so image i goes to its holder
    when the holder's load is at most ``(1 + tolerance)`` times the load at
    which encoding it elsewhere would finish (least load plus its cost), and
    adds nothing to the holder's load; otherwise it is placed like a miss.

    >>> assign_owners([8, 5, 3], 2)
    [0, 1, 1]
    >>> assign_owners([1000, 100, 200, 50], 2)
    [0, 1, 1, 1]
    >>> assign_owners([4, 4], 2, loads=[10, 0])
    [1, 1]
    >>> assign_owners([5, 5], 2, loads=[3, 0], holders=[0, None])
    [0, 1]
    >>> assign_owners([5], 2, loads=[30, 0], holders=[0], tolerance=0.5)
    [1]
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}.")
    total = [0.0] * num_ranks if loads is None else [float(v) for v in loads]
    if len(total) != num_ranks:
        raise ValueError(f"loads has {len(total)} entries for {num_ranks} ranks.")
    held = [None] * len(costs) if holders is None else list(holders)
    if len(held) != len(costs):
        raise ValueError(f"holders has {len(held)} entries for {len(costs)} images.")
    for index, holder in enumerate(held):
        if holder is not None and not 0 <= holder < num_ranks:
            raise ValueError(f"holder {holder} of image {index} is outside [0, {num_ranks}).")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}.")
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min(range(num_ranks), key=lambda r: (total[r], r))
        holder = held[index]
        if holder is not None and total[holder] <= (1 + tolerance) * (total[rank] + costs[index]):
            owners[index] = holder  # a cache hit: no work added
            continue
        owners[index] = rank
        total[rank] += costs[index]
    return owners


def makespan(costs: Sequence[float], owners: Sequence[int], num_ranks: int) -> float:
    """Largest per-rank total cost of an assignment."""
    totals = [0.0] * num_ranks
    for cost, rank in zip(costs, owners, strict=True):
        totals[rank] += cost
    return max(totals, default=0.0)


def makespan_lower_bound(costs: Sequence[float], num_ranks: int) -> float:
    """No assignment of whole images beats max(largest image, total / ranks)."""
    return max(max(costs, default=0.0), sum(costs) / num_ranks)


def group_by_owner(owners: Sequence[int], num_ranks: int) -> dict[int, list[int]]:
    """{rank: [item indices in input order]} for the ranks that own something."""
    groups: dict[int, list[int]] = {}
    for index, rank in enumerate(owners):
        if not 0 <= rank < num_ranks:
            raise AssertionError(f"owner {rank} of item {index} outside [0, {num_ranks})")
        groups.setdefault(rank, []).append(index)
    return groups
