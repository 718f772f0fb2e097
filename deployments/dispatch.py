"""Owner assignment at one ingress replica: fitted costs, rank loads, cache affinity, dedupe.

Per request, ``Dispatcher.plan`` keys every image (full SHA-256, see
``kimi_encoder.cache.item_key``), keeps one copy of each duplicate, prices the
rest with the ranks' fitted cost model and hands them to
``kimi_encoder.assign.assign_owners`` with the current load of every rank and
the rank that last encoded each repeated image (its cache holds it, unless its
replica has been released since: ``Roster.generation``).

Everything known of the ranks (their loads, reports, cost models, which take work)
is the ``Roster``'s; the dispatcher only assigns. Ray-free.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kimi_encoder.assign import assign_owners, group_by_owner
from kimi_encoder.cache import item_key
from kimi_encoder.cost import CostModel
from kimi_encoder.items import EncoderItem
from kimi_encoder.load import Work

from .args import DispatchArgs
from .ranks.roster import Roster

HOLDERS_CAPACITY = 1 << 16  # image keys remembered for cache affinity


@dataclass
class Plan:
    """Who encodes what: ``groups`` holds only the first copy of each duplicate."""

    owners: list[int]  # every item's owner rank (duplicates share their first copy's)
    groups: dict[int, list[int]]  # rank -> item indices it encodes
    first: list[int]  # index of the copy that is encoded, per item
    keys: list[str]
    work: list[Work]  # per rank: images expected to be encoded (not cache hits)
    held: set[int]  # items their owner's cache holds (expected hits)


class Dispatcher:
    """Owner assignment of one ingress replica, by its ``dispatch`` section of the args."""

    def __init__(
        self,
        roster: Roster,
        config: DispatchArgs,
        *,
        model_name: str,
        dtype: str,
        cache_enabled: bool,
    ):
        """``model_name`` and ``dtype`` (the model's, as the ranks run it) key the images as
        the ranks' caches do; ``cache_enabled``: whether the ranks cache (affinity)."""
        self.roster = roster
        self.num_ranks = len(roster)
        self.model_name, self.dtype = model_name, dtype
        self.use_fitted = config.cost_model == "fitted"
        self.tolerance = config.affinity_tolerance
        self.cache_enabled = cache_enabled
        # image key -> (the rank whose cache holds it, that rank's generation then)
        self._holders: OrderedDict[str, tuple[int, int]] = OrderedDict()

    @property
    def caller(self) -> str:
        return self.roster.caller

    @property
    def cost_model(self) -> CostModel:
        """The ranks' fitted model (median of each coefficient), or plain patch counts."""
        fitted = self.roster.fitted_models()
        if not self.use_fitted or not fitted:
            return CostModel.patches()
        return _median(fitted)

    @property
    def seconds_model(self) -> CostModel | None:
        """The ranks' fitted model in seconds, whatever ``cost_model`` assignment uses."""
        return seconds_model(self.roster.fitted_models())

    def loads(self) -> list[float]:
        return self.roster.loads(self.cost_model)

    def keys(self, items: Sequence[EncoderItem], feature_dtype: str) -> list[str]:
        """Each item's feature-cache key: the key its owner rank's cache keeps its features
        in ``feature_dtype`` under (``kimi_encoder.cache.item_key``)."""
        return [item_key(item, self.model_name, self.dtype, feature_dtype) for item in items]

    def plan(
        self,
        items: Sequence[EncoderItem],
        feature_dtype: str,
        exclude: Collection[int] = (),
        keys: Sequence[str] | None = None,
    ) -> Plan:
        """Owners of ``items`` (their features wanted in ``feature_dtype``); ranks in
        ``exclude`` (down) get none. ``keys``: the items' ``keys``, if already computed."""
        keys = list(keys) if keys is not None else self.keys(items, feature_dtype)
        seen: dict[str, int] = {}
        first = [seen.setdefault(key, i) for i, key in enumerate(keys)]
        unique = sorted(seen.values())
        model = self.cost_model
        costs = [model(items[i].num_patches) for i in unique]
        holders = [self._holder(keys[i]) for i in unique]
        loads = [math.inf if r in exclude else load for r, load in enumerate(self.loads())]
        assert len(exclude) < self.num_ranks, (exclude, self.num_ranks)
        chosen = assign_owners(
            costs, self.num_ranks, loads, holders=holders, tolerance=self.tolerance
        )
        owner_of = dict(zip(unique, chosen, strict=True))
        owners = [owner_of[first[i]] for i in range(len(items))]
        groups = group_by_owner(chosen, self.num_ranks)
        groups = {rank: [unique[j] for j in idx] for rank, idx in groups.items()}
        work = [Work()] * self.num_ranks
        held = set()
        for i, holder, rank in zip(unique, holders, chosen, strict=True):
            if holder != rank:  # a miss: the rank will queue it
                work[rank] = work[rank] + Work.of([items[i].num_patches])
            else:
                held.add(i)
        return Plan(owners, groups, first, keys, work, held)

    def _holder(self, key: str) -> int | None:
        """The rank whose cache holds ``key``'s features, as far as this replica knows."""
        if not self.cache_enabled or (held := self._holders.get(key)) is None:
            return None
        rank, generation = held
        return rank if generation == self.roster.generation(rank) else None

    @contextmanager
    def dispatched(self, plan: Plan, rank: int) -> Iterator[None]:
        """Count the plan's work on ``rank`` as this replica's own until the rank answered."""
        with self.roster.dispatched(rank, plan.work[rank]):
            yield

    def expected_s(self, rank: int, patches: Sequence[int]) -> float | None:
        """Seconds until ``rank`` answers a call of images of ``patches``, by the fitted model:
        its outstanding work, then these images (None without a fitted model)."""
        model = self.seconds_model
        if model is None:
            return None
        return self.roster.loads(model)[rank] + sum(model(p) for p in patches)

    def record(self, plan: Plan, only: Collection[int] | None = None) -> None:
        """Remember which rank now caches each image (for later requests); ``only`` the
        ranks that answered, when given."""
        if not self.cache_enabled:
            return
        for rank, indices in plan.groups.items():
            if only is not None and rank not in only:
                continue
            for i in indices:
                self._holders[plan.keys[i]] = (rank, self.roster.generation(rank))
                self._holders.move_to_end(plan.keys[i])
        while len(self._holders) > HOLDERS_CAPACITY:
            self._holders.popitem(last=False)

    def info(self) -> dict[str, Any]:
        return {
            "caller": self.caller,
            "cost_model": {**self.cost_model.as_dict(), "source": self._source()},
            "loads": [round(v, 6) for v in self.loads()],
            "affinity_tolerance": self.tolerance,
            "load_report_interval_ms": self.roster.report_interval_s * 1e3,
        }

    def _source(self) -> str:
        if not self.use_fitted:
            return "patches"
        return "fitted" if self.roster.fitted_models() else "patches (no report yet)"


def seconds_model(models: Sequence[CostModel]) -> CostModel | None:
    """The fitted models (in seconds) of ``models`` as one (median of each coefficient),
    if any rank has reported one."""
    fitted = [m for m in models if m != CostModel.patches()]
    return _median(fitted) if fitted else None


def _median(models: Sequence[CostModel]) -> CostModel:
    return CostModel(*(statistics.median(getattr(m, f) for m in models) for f in "abc"))
