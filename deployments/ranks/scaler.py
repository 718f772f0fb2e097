"""Elastic vision DP: how many ranks the app wants taking work, decided in one place, and
the loops that get them there through Ray Serve's autoscaling.

With ``dp_size: {min: M, max: N}`` there are N rank deployments (``deployments/app.py``):
the first M with one replica always, the others each autoscaled between 0 and 1 replicas
by Serve's default policy. That policy is all Serve needs to do it, because the ingress
decides and the calls it sends carry the decision:

- a call that waits for a replica of a rank scaled to zero makes Serve start one at once
  (its router tells the controller as soon as a call queues for a deployment with no
  replica); the scaler wakes a rank with such a call (``RankClient.wake``, a load report
  routed for up to ``scaling.start_timeout_s``), and the ingress replicas give it work
  once it answers;
- a rank that gets no call for its look-back window and ``scaling.park_after_s`` has its
  replica released by Serve, after the calls it holds finish (graceful shutdown): its
  process, GPU and CPUs are free in Ray's resource view, and the Ray autoscaler may take
  the node away. A rank not wanted is sent nothing at all, by anyone (no work, no load
  poll): it drains, then parks. Every wanted elastic rank has one call of the scaler open
  at all times (``RankClient.hold``: answered after a few seconds, then sent again), so
  Serve never parks a rank the app counts on, however idle.

**One decision.** The app's ``RankScaler`` (``deployments/decider.py``, one replica)
runs ``Elastic``: it polls the wanted ranks' load reports itself, takes each ingress
replica's view of what it dispatched (``decision.IngressView``), weighs both by their
age (``decision.queued_seconds``), decides, wakes, holds and lets go, and publishes a
``decision.Decision``. Each ingress replica runs a ``Follower``: it asks the scaler for
the decision (a call that waits until the decision changes, or about a second, and
carries the replica's view), and gives work only to the ranks the decision says take
work. An ingress replica that dies or restarts changes nothing for the others (its view
ages out); a scaler that dies is replaced by Serve, and its successor starts by wanting
every rank that runs, so no rank with work is dropped and none is woken by mistake.

Why not Serve's own queue-length policy on one N-replica deployment: encoder load is
patches, not requests (a 4K photo costs a hundred thumbnails), and one deployment per
rank keeps the ingress's choice of owner (deployments/app.py says more). Why not a custom
autoscaling policy: it runs in Serve's controller, sees one deployment's metrics at a
time, and would have to be importable there; the default policy with 0..1 replicas
reads exactly the signal the scaler sends. Why one scaler and not a decision per ingress
replica: each would decide from what it last heard, and a rank stays alive as long as
any one of them still calls it (an idle replica's last report held a rank for minutes).

The rule is ``rule.Scaler``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kimi_encoder.cost import CostModel

from ..args import ScalingArgs
from ..timing import SYNC_S
from .decision import Decision, IngressView, Seen, queued_seconds
from .roster import Roster
from .row import DRAINING, LIVE, PARKED, STARTING
from .rule import Scaler

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Replicas:
    """Serve's view of one rank's deployment: running replicas and its status message
    (why a replica does not start: no resources, a failing constructor...)."""

    running: int
    message: str = ""


class Directory(Protocol):
    """Serve's own view of the ranks' replicas (``handles.ServeDirectory``)."""

    async def replicas(self) -> dict[int, Replicas]: ...


class Elastic:
    """The app scaler's loop: keeps the wanted ranks in step with the load (module doc)."""

    def __init__(
        self,
        roster: Roster,
        lo: int,
        config: ScalingArgs,
        seconds_model: Callable[[], CostModel | None],
        directory: Directory | None = None,
        by: str = "",
    ):
        self.roster = roster
        self.lo = lo
        self.config = config
        self.scaler = Scaler(lo, len(roster), config)
        self.seconds_model = seconds_model
        self.directory = directory
        self.by = by  # who decides: the scaler's replica
        self.instance = uuid.uuid4().hex  # this process: a successor counts again
        self.decisions: deque[dict[str, Any]] = deque(maxlen=16)  # the latest, for /v1/info
        self.queued_s = 0.0  # the last sample
        self.ready = directory is None  # the first look at Serve's replicas is done
        self.views: dict[str, tuple[IngressView, float]] = {}  # caller -> view, when received
        self.seq = 0  # the decision's number: +1 on every change a follower must see
        self._published: tuple | None = None
        self._changed: asyncio.Event | None = None
        self._failed_start: dict[int, float] = {}  # rank -> when its start was given up
        self._task: asyncio.Task | None = None
        self._synced = -1e18

    def start(self) -> None:
        """Run the loop on the running event loop (once)."""
        if self._task is None or self._task.done():
            self._changed = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while not self.ready:
            try:
                self.begin(await self.directory.replicas())
            except Exception:  # Serve's controller not reachable yet: look again
                log.exception("elastic ranks: Serve's view of the ranks is not readable yet")
                await asyncio.sleep(SYNC_S)
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                await self.roster.refresh()
                self.step()
                if self.directory is not None and self.roster.clock() - self._synced >= SYNC_S:
                    self._synced = self.roster.clock()
                    self.sync(await self.directory.replicas())
                self.publish()
            except Exception:  # the loop must go on; the next tick retries
                log.exception("elastic ranks: a scaling step failed")

    def begin(self, replicas: dict[int, Replicas]) -> None:
        """The scaler's first look at Serve's replicas: every elastic rank that runs is
        wanted (held, given work), whoever started it. A scaler that replaced a dead one
        so drops no rank that may have work; the load then lets go those it does not need,
        after ``scaling.downscale_after_s``."""
        for rank, seen in sorted(replicas.items()):
            if self.lo <= rank < len(self.roster) and seen.running > 0:
                self.roster.adopt(rank, "running when this scaler started")
                self.roster.want(rank, "wanted: running when this scaler started")
        self.scaler.restart(self.roster.clock())
        self.ready = True
        self.publish()

    def wanted(self) -> list[int]:
        """Ranks wanted: live and taking work (or down for now), or starting."""
        roster = self.roster
        return [r for r in range(len(roster)) if roster.is_wanted(r)]

    def view(self, view: IngressView) -> None:
        """An ingress replica's view of what it has dispatched (kept with when it came)."""
        self.views[view.caller] = (view, self.roster.monotonic())

    def queued(self, model: CostModel) -> dict[int, float]:
        """Seconds of work queued on each rank taking work: the ranks' reports and the
        ingress replicas' views (and this roster's own calls), weighed by their age."""
        roster = self.roster
        now, takes = roster.monotonic(), roster.takes_work()
        reports: dict[int, dict[str, Seen]] = {r: {} for r in takes}
        for rank, (report, at) in roster.reports().items():
            if rank in takes:
                reports[rank] = {c: Seen(w, at) for c, w in report.by_caller.items()}
        views: dict[int, dict[str, Seen]] = {r: {} for r in takes}
        mine = IngressView(roster.caller, roster.own_work())
        for view, at in [*self.views.values(), (mine, now)]:
            for rank in takes:
                if rank < len(view.own) and view.own[rank].images:
                    views[rank][view.caller] = Seen(view.own[rank], at)
        fresh, stale = self.config.report_fresh_s, self.config.report_stale_s
        return queued_seconds(reports, views, model, now, fresh, stale)

    def step(self) -> None:
        """Sample the queued work, decide, and act: wake ranks, or take one's work away."""
        roster, now = self.roster, self.roster.clock()
        model = self.seconds_model()
        if model is not None:
            self.queued_s = sum(self.queued(model).values())
            self.scaler.observe(now, self.queued_s)
        wanted = self.wanted()
        starting = any(roster.state(r) == STARTING for r in wanted)
        target, why = self.scaler.decide(now, len(wanted), starting)
        for _ in range(target - len(wanted)):
            self._grow(why, now)
        if target < len(wanted):
            self._shrink(why)

    def _grow(self, why: str, now: float) -> None:
        """Want one rank more: a live one given no work lately first (it takes work at
        once), else the lowest parked one whose start has not just failed (none: the
        live ranks go on alone)."""
        roster = self.roster
        spare = [
            r
            for r in range(self.lo, len(roster))
            if not roster.is_wanted(r)
            and now - self._failed_start.get(r, -1e18) >= self.config.start_timeout_s
        ]
        if not spare:
            return
        live = [r for r in spare if roster.phase(r) == LIVE]
        rank = (live or spare)[0]
        self._decided("up", rank, why)
        roster.want(rank, f"wanted: {why}")
        if roster.state(rank) == STARTING:
            roster.wake(rank, self.config.start_timeout_s, self._start_failed)

    def _shrink(self, why: str) -> None:
        """Take the highest wanted rank's work away: it drains, then Serve parks it."""
        roster = self.roster
        live = [r for r in self.wanted() if r >= self.lo and roster.phase(r) == LIVE]
        if live:
            self._decided("down", live[-1], why)
            roster.unwant(live[-1], f"not wanted: {why}")

    def _start_failed(self, rank: int) -> None:
        self._failed_start[rank] = self.roster.clock()

    def _decided(self, direction: str, rank: int, why: str) -> None:
        at = self.roster.clock()
        self.decisions.append({"at": at, "scale": direction, "rank": rank, "why": why})
        log.info("elastic ranks: scale %s, rank %d: %s", direction, rank, why)

    def sync(self, replicas: dict[int, Replicas]) -> None:
        """Take Serve's view: a rank given no work whose replica is gone is parked (every
        ingress then forgets its cache), one that runs while the scaler took it for parked
        (a start given up that came late) is live but given no work, and a starting rank's
        status message (why it does not start yet) is kept for the log and /v1/info."""
        roster = self.roster
        for rank, seen in replicas.items():
            if rank < self.lo or rank >= len(roster):
                continue
            phase = roster.phase(rank)
            if phase == LIVE and not roster.is_wanted(rank) and seen.running == 0:
                roster.released(
                    rank,
                    "parked: Serve released its replica (no call for "
                    f"park_after_s={self.config.park_after_s:g} s)",
                )
            elif phase == PARKED and seen.running > 0:
                roster.adopt(rank, "running, not wanted: a start given up came late")
            elif phase == STARTING and seen.message:
                roster.note(rank, seen.message)

    def phases(self) -> tuple[str, ...]:
        """Each rank's phase as the followers take it: live, draining, starting, parked."""
        roster = self.roster
        out = []
        for r in range(len(roster)):
            phase = roster.phase(r)
            out.append(DRAINING if phase == LIVE and not roster.is_wanted(r) else phase)
        return tuple(out)

    def publish(self) -> Decision:
        """The decision as it stands; a new number when what the followers do changes."""
        phases = self.phases()
        if phases != self._published:
            self._published = phases
            self.seq += 1
            if self._changed is not None:
                self._changed.set()
                self._changed = asyncio.Event()
        return self.decision()

    def decision(self) -> Decision:
        roster = self.roster
        now = roster.monotonic()
        ages = {f"rank {r}": now - at for r, (_, at) in roster.reports().items()}
        ages |= {caller: now - at for caller, (_, at) in self.views.items()}
        return Decision(
            instance=self.instance,
            seq=self.seq,
            by=self.by,
            made_at=time.time(),
            phases=self.phases(),
            why=tuple(row.why for row in roster.rows),
            queued_s=self.queued_s,
            target_queue_s=self.config.target_queue_s,
            dp_min=self.lo,
            reports_age_s=ages,
            decisions=tuple(self.decisions),
        )

    async def next_decision(self, instance: str, seen: int, wait_s: float) -> Decision:
        """The decision once it differs from ``seen`` of ``instance`` (a follower's last),
        or after ``wait_s``; at once for a follower of another scaler. Before this scaler
        has read Serve's replicas (``begin``) it has no decision: ``NotReady`` after
        ``wait_s`` (the follower keeps its last one)."""
        self.start()
        started = time.monotonic()
        while not self.ready:
            if time.monotonic() - started >= wait_s:
                raise NotReady("the scaler has not read Serve's view of the ranks yet")
            await asyncio.sleep(self.config.tick_s)
        if instance == self.instance and seen == self.seq:
            changed = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), wait_s)
        return self.decision()

    def info(self) -> dict[str, Any]:
        return self.decision().info(time.time())


class NotReady(Exception):
    """The scaler has no decision yet (it is reading Serve's view of the ranks)."""
