"""Outstanding work of a rank, in a form any quadratic cost model can price.

A rank reports the images it has queued or running as three sums over their
patch counts p: the count, sum p and sum p^2. Any ``CostModel``
``a*p^2 + b*p + c`` prices the whole set exactly from them, so a rank never
needs to know which cost model a caller uses, and a report stays three numbers
however deep the queue is.

With several ingress replicas, each knows its own dispatched work exactly (it
sent it and has not had the answer yet) and learns the others' from the
ranks' reports, which say who sent what. ``rank_loads`` combines the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .cost import CostModel


@dataclass(frozen=True)
class Work:
    """Moments of the patch counts of a set of images."""

    images: int = 0
    patches: int = 0
    patches_sq: int = 0

    @classmethod
    def of(cls, patch_counts: Iterable[int]) -> Work:
        counts = [int(p) for p in patch_counts]
        return cls(len(counts), sum(counts), sum(p * p for p in counts))

    def __add__(self, other: Work) -> Work:
        return Work(
            self.images + other.images,
            self.patches + other.patches,
            self.patches_sq + other.patches_sq,
        )

    def __sub__(self, other: Work) -> Work:
        out = Work(
            self.images - other.images,
            self.patches - other.patches,
            self.patches_sq - other.patches_sq,
        )
        assert min(out.images, out.patches, out.patches_sq) >= 0, (self, other)
        return out

    def cost(self, model: CostModel) -> float:
        """Total cost of the set under ``model``.

        >>> Work.of([2, 3]).cost(CostModel(a=1.0, b=10.0, c=100.0))
        263.0
        """
        return model.a * self.patches_sq + model.b * self.patches + model.c * self.images

    def as_list(self) -> list[int]:
        return [self.images, self.patches, self.patches_sq]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> Work:
        images, patches, patches_sq = (int(v) for v in values)
        return cls(images, patches, patches_sq)


def rank_loads(
    own: Sequence[Work],
    reports: Sequence[Mapping[str, Work] | None],
    me: str,
    model: CostModel,
) -> list[float]:
    """Outstanding cost of each rank as ingress ``me`` should see it.

    ``own[r]``: work ``me`` sent to rank r and has no answer for yet (exact,
    including calls still on their way). ``reports[r]``: rank r's last report,
    ``{caller: work queued or running}``, or None when it has not answered.
    ``me``'s own entry in a report is ignored (``own`` is fresher); every other
    caller's is added.

    >>> m = CostModel.patches()
    >>> rank_loads([Work.of([8]), Work()], [{"me": Work.of([8]), "b": Work.of([4])}, None], "me", m)
    [12.0, 0.0]
    """
    if len(own) != len(reports):
        raise ValueError(f"{len(own)} own entries but {len(reports)} reports.")
    loads = []
    for mine, report in zip(own, reports, strict=True):
        others = sum(
            (work for caller, work in (report or {}).items() if caller != me), start=Work()
        )
        loads.append((mine + others).cost(model))
    return loads
