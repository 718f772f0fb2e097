"""Elastic vision DP: how many ranks one ingress replica wants taking work, and the loop
that gets them there through Ray Serve's autoscaling.

With ``dp_size: {min: M, max: N}`` there are N rank deployments (``deployments/app.py``):
the first M with one replica always, the others each autoscaled between 0 and 1 replicas
by Serve's default policy. That policy is all Serve needs to do it, because the ingress
decides and the calls it sends carry the decision:

- a call that waits for a replica of a rank scaled to zero makes Serve start one at once
  (its router tells the controller as soon as a call queues for a deployment with no
  replica); the ingress wakes a rank with such a call (``RankClient.wake``, a load report
  routed for up to ``scaling.start_timeout_s``) and gives it work once it answers;
- a rank that gets no call for its look-back window and ``scaling.park_after_s`` has its
  replica released by Serve, after the calls it holds finish (graceful shutdown): its
  process, GPU and CPUs are free in Ray's resource view, and the Ray autoscaler may take
  the node away. The ingress *unwants* a rank by sending it nothing at all (no work, no
  load poll): it drains, then parks. Every wanted elastic rank has one call of the ingress
  open at all times (``RankClient.hold``: answered after a few seconds, then sent again),
  so Serve never parks a rank the ingress counts on, however idle.

Why not Serve's own queue-length policy on one N-replica deployment: encoder load is
patches, not requests (a 4K photo costs a hundred thumbnails), and one deployment per
rank keeps the ingress's choice of owner (deployments/app.py says more). Why not a custom
autoscaling policy: it runs in Serve's controller, sees one deployment's metrics at a
time, and would have to be importable there; the default policy with 0..1 replicas
reads exactly the signal the ingress sends.

The decision (``Scaler``, pure): sample the work queued on the ranks taking work, in
seconds by their fitted cost model, every ``TICK_S``. Want more ranks when its mean
over ``scaling.upscale_after_s`` exceeds ``scaling.target_queue_s`` per wanted rank (as
many as that work needs at the target, at least one more); one fewer when its mean
over ``scaling.downscale_after_s`` would fit one rank fewer at half the target. Each
change restarts both windows, and nothing more is added while a rank is starting:
steady load does not flap. Work answered from a cache (the ingress's
or a rank's) queues nothing, so a burst of repeats wakes no rank. Lower ranks are wanted
first and higher ones let go first, so work packs onto the lowest ranks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kimi_encoder.cost import CostModel

from .args import ScalingArgs
from .roster import LIVE, PARKED, STARTING, Roster

log = logging.getLogger("ray.serve")

TICK_S = 0.25  # how often the queue is sampled and the decision taken
SYNC_S = 1.0  # how often Serve's view of the ranks' replicas is read
DOWN_SHARE = 0.5  # one rank fewer must still be this far under the target: no flapping


class Scaler:
    """How many ranks to want, from samples of the queued work (module doc)."""

    def __init__(self, lo: int, hi: int, config: ScalingArgs):
        self.lo, self.hi, self.config = lo, hi, config
        self._samples: deque[tuple[float, float]] = deque()
        self._since: float | None = None  # the last change (or the first sample)

    def observe(self, now: float, queued_s: float) -> None:
        """The work queued on the ranks taking work now, in seconds."""
        if self._since is None:
            self._since = now
        self._samples.append((now, queued_s))
        horizon = now - max(self.config.upscale_after_s, self.config.downscale_after_s)
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def decide(self, now: float, wanted: int, starting: bool) -> tuple[int, str]:
        """The number of ranks to want (``wanted`` now), and why it changes ('' if not).
        Nothing is added while a rank is ``starting``."""
        target, up_s, down_s = (
            self.config.target_queue_s,
            self.config.upscale_after_s,
            self.config.downscale_after_s,
        )
        if starting:
            self.restart(now)  # the new rank's share counts once it takes work
            return wanted, ""
        queued = self._mean(now, up_s)
        if queued is not None and wanted < self.hi and queued > wanted * target:
            self.restart(now)
            need = min(self.hi, max(wanted + 1, math.ceil(queued / target)))
            return need, (
                f"{queued:.3f} s of work queued on {wanted} rank(s) for {up_s:g} s, "
                f"above {target:g} s per rank"
            )
        queued = self._mean(now, down_s)
        if queued is not None and wanted > self.lo and queued < (wanted - 1) * target * DOWN_SHARE:
            self.restart(now)
            return wanted - 1, (
                f"{queued:.3f} s of work queued for {down_s:g} s fits {wanted - 1} rank(s) "
                f"under half of {target:g} s each"
            )
        return wanted, ""

    def restart(self, now: float) -> None:
        """Both windows start again at ``now``."""
        self._since = now
        self._samples.clear()

    def _mean(self, now: float, window_s: float) -> float | None:
        """Mean queued work over the last ``window_s``; None until that much time has been
        sampled since the last change."""
        if self._since is None or now - self._since < window_s:
            return None
        values = [q for t, q in self._samples if t >= now - window_s]
        return statistics.fmean(values) if values else None


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
    """The loop that keeps one ingress replica's wanted ranks in step with its load."""

    def __init__(
        self,
        roster: Roster,
        lo: int,
        config: ScalingArgs,
        seconds_model: Callable[[], CostModel | None],
        directory: Directory | None = None,
    ):
        self.roster = roster
        self.lo = lo
        self.config = config
        self.scaler = Scaler(lo, len(roster), config)
        self.seconds_model = seconds_model
        self.directory = directory
        self.decisions: deque[dict[str, Any]] = deque(maxlen=16)  # the latest, for /v1/info
        self.queued_s = 0.0  # the last sample
        self._failed_start: dict[int, float] = {}  # rank -> when its start was given up
        self._task: asyncio.Task | None = None
        self._synced = -1e18

    def start(self) -> None:
        """Run the loop on the running event loop (once)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.step()
                if self.directory is not None and self.roster.clock() - self._synced >= SYNC_S:
                    self._synced = self.roster.clock()
                    self.sync(await self.directory.replicas())
            except Exception:  # the loop must go on; the next tick retries
                log.exception("elastic ranks: a scaling step failed")

    def wanted(self) -> list[int]:
        """Ranks wanted: live and taking work (or down for now), or starting."""
        roster = self.roster
        return [r for r in range(len(roster)) if roster.is_wanted(r)]

    def step(self) -> None:
        """Sample the queued work, decide, and act: wake ranks, or take one's work away."""
        roster, now = self.roster, self.roster.clock()
        model = self.seconds_model()
        if model is not None:
            loads = roster.loads(model)
            self.queued_s = sum(loads[r] for r in roster.takes_work())
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
        ingress then forgets its cache), one that runs while this replica thought it
        parked (another ingress replica started it) is live, and a starting rank's
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
                roster.adopt(rank, "running: started by another ingress replica's load")
            elif phase == STARTING and seen.message:
                roster.note(rank, seen.message)

    def info(self) -> dict[str, Any]:
        wanted = self.wanted()
        return {
            "dp_min": self.lo,
            "dp_max": len(self.roster),
            "wanted": wanted,
            "queued_s": round(self.queued_s, 6),
            "target_queue_s": self.config.target_queue_s,
            "decisions": list(self.decisions),
        }
