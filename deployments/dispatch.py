"""Owner assignment at one ingress replica: fitted costs, rank loads, cache affinity, dedupe.

Per request, ``Dispatcher.plan`` keys every image (full SHA-256, see
``kimi_encoder.cache.item_key``), keeps one copy of each duplicate, prices the
rest with the ranks' fitted cost model and hands them to
``kimi_encoder.assign.assign_owners`` with the current load of every rank and
the rank that last encoded each repeated image (its cache holds it).

Loads: this replica's own dispatched-and-unanswered work is tracked exactly
(``dispatched``); the other replicas' comes from the ranks' ``load()`` reports,
polled at most every ``dispatch.load_report_interval_ms`` on the request path (awaited
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
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kimi_encoder.assign import assign_owners, group_by_owner
from kimi_encoder.cache import item_key
from kimi_encoder.cost import CostModel
from kimi_encoder.items import EncoderItem
from kimi_encoder.load import Work, rank_loads

from .args import DispatchArgs

REPORT_ANSWER_S = 0.2  # a routed load poll answers within this, or its rank is silent
REPORT_OUTDATED_S = 1.0  # older than this a report is no view at all: a request waits for one
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
        num_ranks: int,
        config: DispatchArgs,
        *,
        model_name: str,
        dtype: str,
        cache_enabled: bool,
    ):
        """``model_name`` and ``dtype`` (the model's, as the ranks run it) key the images as
        the ranks' caches do; ``cache_enabled``: whether the ranks cache (affinity)."""
        self.num_ranks = num_ranks
        self.caller = f"ingress-{uuid.uuid4().hex}"
        self.model_name, self.dtype = model_name, dtype
        self.use_fitted = config.cost_model == "fitted"
        self.report_interval_s = config.load_report_interval_ms / 1e3
        # A poll may wait for routing as long as an encode call may, then must answer.
        self.report_timeout_s = config.route_timeout_s + REPORT_ANSWER_S
        self.tolerance = config.affinity_tolerance
        self.cache_enabled = cache_enabled
        self._own = [Work()] * num_ranks
        self._reports: list[dict[str, Work] | None] = [None] * num_ranks
        self._models: list[CostModel | None] = [None] * num_ranks
        self._reported_at = [-math.inf] * num_ranks
        self._poll: asyncio.Task | None = None
        self._poll_started = -math.inf
        self._holders: OrderedDict[str, int] = OrderedDict()
        # Called with (rank, error) when a rank misses its report deadline, and with
        # (rank, report) for every report taken.
        self.on_silent: Callable[[int, BaseException], None] = lambda rank, error: None
        self.on_report: Callable[[int, dict], None] = lambda rank, report: None

    @property
    def cost_model(self) -> CostModel:
        """The ranks' fitted model (median of each coefficient), or plain patch counts."""
        fitted = [m for m in self._models if m is not None]
        if not self.use_fitted or not fitted:
            return CostModel.patches()
        return CostModel(*(statistics.median(getattr(m, f) for m in fitted) for f in "abc"))

    @property
    def seconds_model(self) -> CostModel | None:
        """The ranks' fitted model in seconds (median of each coefficient), if any rank
        has reported one, whatever ``cost_model`` assignment uses."""
        fitted = [m for m in self._models if m is not None and m != CostModel.patches()]
        if not fitted:
            return None
        return CostModel(*(statistics.median(getattr(m, f) for m in fitted) for f in "abc"))

    async def refresh(self, ranks: Sequence[Any], skip: Collection[int] = ()) -> None:
        """Poll the ranks whose last report is older than the interval (one poll at a time).

        A request waits for the poll only when it has no recent view of some rank at all
        (never heard from, or not for ``REPORT_OUTDATED_S``), and then at most
        ``report_timeout_s`` (``dispatch.route_timeout_s`` + 0.2 s): a rank that misses it
        is reported silent and skipped from then on, so a hung rank holds no request.
        Otherwise the poll runs in the background and the request uses the reports it
        has. Every encode answer carries its rank's report too (``observe``), so a busy
        rank is rarely polled. Ranks in ``skip`` (down) are not. An interval of 0 asks
        for exact loads instead: every request waits (as long) for a poll started after
        it arrived.
        """
        now = time.monotonic()
        stale = [
            r
            for r, t in enumerate(self._reported_at)
            if now - t >= self.report_interval_s and r not in skip
        ]
        if not stale:
            return
        exact = self.report_interval_s == 0
        if self._poll is None or self._poll.done() or (exact and self._poll_started < now):
            self._poll_started = time.monotonic()
            self._poll = asyncio.get_running_loop().create_task(self._poll_ranks(ranks, stale))
        if exact or any(now - self._reported_at[r] >= REPORT_OUTDATED_S for r in stale):
            await asyncio.wait([self._poll], timeout=self.report_timeout_s)

    async def _poll_ranks(self, ranks: Sequence[Any], stale: list[int]) -> None:
        async def one(rank: int) -> None:
            call = ranks[rank].load()
            try:
                report = await asyncio.wait_for(call, self.report_timeout_s)
            except Exception as exc:  # noqa: BLE001 - no report: the rank is silent
                call.cancel()
                self._reports[rank] = None
                self._reported_at[rank] = time.monotonic()
                self.on_silent(rank, exc)
                return
            self.observe(rank, report)

        await asyncio.gather(*(one(r) for r in stale))

    def observe(self, rank: int, report: dict | None) -> None:
        """Take a rank's load report (from a poll or an encode answer)."""
        if report is None:
            return
        self.on_report(rank, report)
        self._reports[rank] = {c: Work.from_list(w) for c, w in report["by_caller"].items()}
        self._models[rank] = CostModel(**report["cost_model"])
        self._reported_at[rank] = time.monotonic()

    def loads(self) -> list[float]:
        return rank_loads(self._own, self._reports, self.caller, self.cost_model)

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
        held = set()
        for i, holder, rank in zip(unique, holders, chosen, strict=True):
            if holder != rank:  # a miss: the rank will queue it
                work[rank] = work[rank] + Work.of([items[i].num_patches])
            else:
                held.add(i)
        return Plan(owners, groups, first, keys, work, held)

    @contextmanager
    def dispatched(self, plan: Plan, rank: int) -> Iterator[None]:
        """Count the plan's work on ``rank`` as this replica's own until the rank answered."""
        work = plan.work[rank]
        self._own[rank] = self._own[rank] + work
        try:
            yield
        finally:
            self._own[rank] = self._own[rank] - work

    def expected_s(self, plan: Plan, rank: int, patches: Sequence[int]) -> float | None:
        """Seconds until ``rank`` answers a call of images of ``patches``, by the fitted model:
        its outstanding work, then these images (None without a fitted model)."""
        model = self.seconds_model
        if model is None:
            return None
        queued = rank_loads(self._own, self._reports, self.caller, model)[rank]
        return queued + sum(model(p) for p in patches)

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
            "caller": self.caller,
            "cost_model": {**self.cost_model.as_dict(), "source": self._source()},
            "loads": [round(v, 6) for v in self.loads()],
            "affinity_tolerance": self.tolerance,
            "load_report_interval_ms": self.report_interval_s * 1e3,
        }

    def _source(self) -> str:
        if not self.use_fitted:
            return "patches"
        return "fitted" if any(m is not None for m in self._models) else "patches (no report yet)"
