"""Owner assignment at one ingress replica: fitted costs, rank loads, cache affinity, dedupe.

Per request, ``Dispatcher.plan`` keys every image (full SHA-256, see
``kimi_encoder.cache.item_key``), keeps one copy of each duplicate, prices the
rest with the ranks' fitted cost model and hands them to
``kimi_encoder.assign.assign_owners`` with the current load of every rank and
the rank that last encoded each repeated image (its cache holds it).

Loads: this replica's own dispatched-and-unanswered work is tracked exactly
(``dispatched``); the other replicas' comes from the ranks' ``load()`` reports,
polled at most every ``load_report_interval_ms`` on the request path (awaited
when stale, shared by concurrent requests; nothing runs while idle). With one
ingress replica the reports only carry the cost model.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
import uuid
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from kimi_encoder.assign import assign_owners, group_by_owner
from kimi_encoder.cache import item_key
from kimi_encoder.cost import CostModel
from kimi_encoder.items import EncoderItem
from kimi_encoder.load import Work, rank_loads

REPORT_TIMEOUT_S = 2.0  # a rank that does not report in time counts as idle
HOLDERS_CAPACITY = 1 << 16  # image keys remembered for cache affinity


@dataclass
class Plan:
    """Who encodes what: ``groups`` holds only the first copy of each duplicate."""

    owners: list[int]  # every item's owner rank (duplicates share their first copy's)
    groups: dict[int, list[int]]  # rank -> item indices it encodes
    first: list[int]  # index of the copy that is encoded, per item
    keys: list[str]
    work: list[Work]  # per rank: images expected to be encoded (not cache hits)


class Dispatcher:
    def __init__(
        self,
        num_ranks: int,
        *,
        model_name: str,
        dtype: str,
        cost_model: str,
        report_interval_ms: float,
        affinity_tolerance: float,
        cache_enabled: bool,
    ):
        self.num_ranks = num_ranks
        self.caller = f"ingress-{uuid.uuid4().hex}"
        self.model_name, self.dtype = model_name, dtype
        self.use_fitted = cost_model == "fitted"
        self.report_interval_s = report_interval_ms / 1e3
        self.tolerance = affinity_tolerance
        self.cache_enabled = cache_enabled
        self._own = [Work()] * num_ranks
        self._reports: list[dict[str, Work] | None] = [None] * num_ranks
        self._models: list[CostModel | None] = [None] * num_ranks
        self._reported_at = [-math.inf] * num_ranks
        self._poll: asyncio.Task | None = None
        self._holders: OrderedDict[str, int] = OrderedDict()

    @property
    def cost_model(self) -> CostModel:
        """The ranks' fitted model (median of each coefficient), or plain patch counts."""
        fitted = [m for m in self._models if m is not None]
        if not self.use_fitted or not fitted:
            return CostModel.patches()
        return CostModel(*(statistics.median(getattr(m, f) for m in fitted) for f in "abc"))

    async def refresh(self, ranks: Sequence[Any], skip: Collection[int] = ()) -> None:
        """Poll the ranks whose last report is older than the interval (one poll at a time).

        Every encode answer carries its rank's report too (``observe``), so a busy rank
        is rarely polled. Ranks in ``skip`` (down, deployments/failover.py) are not.
        """
        now = time.monotonic()
        stale = [
            r
            for r, t in enumerate(self._reported_at)
            if now - t >= self.report_interval_s and r not in skip
        ]
        if not stale:
            return
        if self._poll is None or self._poll.done():
            self._poll = asyncio.get_running_loop().create_task(self._poll_ranks(ranks, stale))
        await asyncio.shield(self._poll)

    async def _poll_ranks(self, ranks: Sequence[Any], stale: list[int]) -> None:
        async def one(rank: int) -> None:
            try:
                report = await asyncio.wait_for(ranks[rank].load(), REPORT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a sick rank: no report; the encode call will say
                self._reports[rank] = None
                self._reported_at[rank] = time.monotonic()
                return
            self.observe(rank, report)

        await asyncio.gather(*(one(r) for r in stale))

    def observe(self, rank: int, report: dict | None) -> None:
        """Take a rank's load report (from a poll or an encode answer)."""
        if report is None:
            return
        self._reports[rank] = {c: Work.from_list(w) for c, w in report["by_caller"].items()}
        self._models[rank] = CostModel(**report["cost_model"])
        self._reported_at[rank] = time.monotonic()

    def loads(self) -> list[float]:
        return rank_loads(self._own, self._reports, self.caller, self.cost_model)

    def plan(
        self, items: Sequence[EncoderItem], feature_dtype: str, exclude: Collection[int] = ()
    ) -> Plan:
        """Owners of ``items`` (their features wanted in ``feature_dtype``); ranks in
        ``exclude`` (down) get none."""
        keys = [item_key(item, self.model_name, f"{self.dtype}->{feature_dtype}") for item in items]
        seen: dict[str, int] = {}
        first = [seen.setdefault(key, i) for i, key in enumerate(keys)]
        unique = sorted(seen.values())
        model = self.cost_model
        costs = [model(items[i].num_patches) for i in unique]
        holders = [self._holders.get(keys[i]) if self.cache_enabled else None for i in unique]
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
        for i, holder, rank in zip(unique, holders, chosen, strict=True):
            if holder != rank:  # a miss: the rank will queue it
                work[rank] = work[rank] + Work.of([items[i].num_patches])
        return Plan(owners, groups, first, keys, work)

    @contextmanager
    def dispatched(self, plan: Plan) -> Iterator[None]:
        """Count the plan's work as this replica's own until the ranks have answered."""
        for rank, work in enumerate(plan.work):
            self._own[rank] = self._own[rank] + work
        try:
            yield
        finally:
            for rank, work in enumerate(plan.work):
                self._own[rank] = self._own[rank] - work

    def record(self, plan: Plan, only: Collection[int] | None = None) -> None:
        """Remember which rank now caches each image (for later requests); ``only`` the
        ranks that answered, when given."""
        if not self.cache_enabled:
            return
        for rank, indices in plan.groups.items():
            if only is not None and rank not in only:
                continue
            for i in indices:
                self._holders[plan.keys[i]] = rank
                self._holders.move_to_end(plan.keys[i])
        while len(self._holders) > HOLDERS_CAPACITY:
            self._holders.popitem(last=False)

    def info(self) -> dict[str, Any]:
        return {
            "cost_model": {**asdict(self.cost_model), "source": self._source()},
            "loads": [round(v, 6) for v in self.loads()],
            "affinity_tolerance": self.tolerance,
            "load_report_interval_ms": self.report_interval_s * 1e3,
        }

    def _source(self) -> str:
        if not self.use_fitted:
            return "patches"
        return "fitted" if any(m is not None for m in self._models) else "patches (no report yet)"
