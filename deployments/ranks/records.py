"""What a rank answers the ingress, as typed records: ``deployments/rank.py`` (and its
``RankBatcher``) builds them, the ingress reads them (``handles``, ``roster``,
``dispatch``, ``fanout``, ``metrics``).

They cross processes pickled by Ray, so they hold plain values only: numpy arrays,
object refs, ``Work`` and ``CostModel`` records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, Union

import numpy as np

from kimi_encoder.cost import CostModel
from kimi_encoder.load import Work

if TYPE_CHECKING:  # names only: this module imports no runtime code
    from ray import ObjectRef

    from ..sinks import Written
    from ..stored import StoredFeatures

# What a rank answers for one image, one of five forms: its features as an array; their
# object-store ref (the rank's cache on); ``StoredFeatures`` (kept for a hand-off the
# rank pushes itself); ``Written`` (what it delivered to a sink: vLLM's files, pushes);
# or None (sent by digest, no longer cached: listed in ``RankReply.missing``).
Feature: TypeAlias = Union[np.ndarray, "ObjectRef", "StoredFeatures", "Written", None]


@dataclass(frozen=True)
class Progress:
    """How far a rank process has come: a replacement is another ``instance`` and counts
    its ``answered`` calls from 0 again."""

    instance: str
    answered: int


@dataclass(frozen=True)
class LoadReport:
    """A rank's outstanding work (queued or running, cache misses only) by the ingress
    replica that sent it, its fitted cost model, and its progress."""

    by_caller: Mapping[str, Work]
    cost_model: CostModel
    progress: Progress

    @property
    def idle(self) -> bool:
        """Nothing queued or running: there is no work to make progress on."""
        return not self.by_caller


@dataclass(frozen=True)
class RankReply:
    """A rank's answer to one encode call.

    ``features`` holds one ``Feature`` per image of the call, in its order (None for an
    image listed in ``missing``: the ingress sends it again with its bytes). ``refs`` is
    the ingress's: after it has read the refs in place, the ref each array came from
    (None for an array sent as it was).
    """

    rank: int
    features: list[Feature]
    dtype: str  # the feature dtype the call asked for
    encode_ms: float
    stages_ms: Mapping[str, float]
    done_at: float  # the rank's time.time() when it answered
    load: LoadReport | None = None  # the rank's load report: saves the ingress a poll
    missing: list[int] = field(default_factory=list)
    refs: list[Any] | None = None

    def replace(self, **changes: Any) -> RankReply:
        return dataclasses.replace(self, **changes)
