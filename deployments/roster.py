"""What one ingress replica knows of its encoder ranks, in one place and on one clock.

Ray-free: a rank is a ``RankClient`` (``deployments/handles.py`` wraps a Serve
deployment handle; tests use plain objects). The ``Roster`` owns, for every rank:

- its **state**: ``live`` (a replica that answers, taking work), ``draining`` (live, but
  given no new work: its calls finish, then Serve releases its replica), ``starting``
  (woken, no answer yet), ``parked`` (no replica), and over any of them ``down``
  (unavailable, slow or silent) with why. With a fixed ``dp_size`` every rank is live
  or down; elastic ranks (``deployments/scaling.py``) move through all of them;
- its **load**: the work this replica dispatched to it and has no answer for (exact),
  and its load reports (``records.LoadReport``: every caller's queued work, its cost
  model, its progress), polled at most every ``dispatch.load_report_interval_ms`` on
  the request path and carried by every encode answer;
- its **progress and health**: when it last showed progress, which replica last
  answered, the probe that asks a down rank again, the look-up of a slow rank's
  replica;
- the **lateness rules** and their settings (``dispatch``): when a call counts as late,
  when missed load reports make a rank silent.

Every time it compares is read from one clock, ``clock`` (the ingress's ``LoopClock``):
a call's send time, an answer's, a failure's, a report's. A failure carries no time of
its own; it is placed by when its call was sent. The request's deadline is the
client's wall time and is the fan-out's own (``time.monotonic()``).

Load is not failure. Both waits of a call (for a replica to take it, for its answer)
count from the later of its send time and the rank's last progress: an encode answer,
or a load report saying it answered more calls than before or holds no work. A rank
that keeps answering is busy, not hung, however long its queue (or this ingress's own
event loop) makes a call wait. The ingress judges by a ``LoopClock``, which stands still
while its own event loop lags: answers that arrived during a stall count before any
wait does.

Health is kept in the order things happened: a rank marked down gets no work until an
answer to a call sent *after* the failure, or from another replica of the rank (its
replacement), brings it back; a failure of a replica the rank has since replaced does
not mark the replacement down. While down, a probe (the rank's cheap ``load`` call)
asks again every ``dispatch.cooldown_s``. A rank marked slow has the replica it last
answered from looked up (``RankClient.replica_alive``): one that no longer exists makes
the rank *failed*, so requests stop waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kimi_encoder.cost import CostModel
from kimi_encoder.items import EncoderItem
from kimi_encoder.load import Work, rank_loads

from .args import DispatchArgs
from .records import LoadReport

log = logging.getLogger("ray.serve")

PROBE_TIMEOUT_S = 5.0  # a replacement rank may still be loading its model
HOLD_S = 5.0  # each hold call of a wanted elastic rank lasts this long, then another follows
REPORT_ANSWER_S = 0.2  # a routed load poll answers within this, or its rank is silent
REPORT_OUTDATED_S = 1.0  # older than this a report is no view at all: a request waits for one

Clock = Callable[[], float]

LIVE, DRAINING, STARTING, PARKED, DOWN = "live", "draining", "starting", "parked", "down"


class LoopClock:
    """Seconds as this process's event loop lived them: ``time.monotonic()`` less the
    loop's lag, the clock the ``Roster`` judges lateness by in the ingress.

    A ticker task sleeps ``tick_s`` at a time. When it wakes later than due (the loop
    busy building answers, or the process off the CPU) the clock stands still from the
    due time until it runs again. An answer that reached this process while its loop
    was stalled is then taken before anyone's call counts as late for that stall: a
    rank is late only for time in which this ingress could have seen it answer. With
    no running loop (or before the first tick) it is plain monotonic time.
    """

    def __init__(self, tick_s: float = 0.05, wall: Clock = time.monotonic):
        self.tick_s = tick_s
        self.wall = wall
        self.lag = 0.0  # seconds the ticker woke late, in all
        self._due: float | None = None  # when the ticker should wake next
        self._task: asyncio.Task | None = None

    def __call__(self) -> float:
        self._start()
        now = self.wall()
        late = max(0.0, now - self._due) if self._due is not None else 0.0
        return now - self.lag - late

    def _start(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._due = None  # lag of another loop says nothing about this one
            self._task = loop.create_task(self._tick())

    async def _tick(self) -> None:
        self._due = self.wall() + self.tick_s
        while True:
            await asyncio.sleep(self.tick_s)
            woke = self.wall()
            self.lag += max(0.0, woke - self._due)
            self._due = woke + self.tick_s


class RankUnavailableError(Exception):
    """A rank call failed for a reason that is not the request's; retry on another rank.

    ``replica`` names the rank's replica the call went to (None if it reached none). The
    error carries no time: the roster places it by when its call was sent."""

    def __init__(
        self,
        rank: int,
        cause: BaseException | str,
        replica: str | None = None,
        slow: bool = False,
    ):
        self.rank = rank
        self.cause = cause
        self.replica = replica
        self.slow = slow  # alive but late or silent: any answer brings it back
        name = type(cause).__name__ if isinstance(cause, BaseException) else "unavailable"
        first = (str(cause).splitlines() or [""])[0][:200]
        super().__init__(f"rank {rank} unavailable ({name}: {first})")


class Call(Protocol):
    """An awaitable rank call that can be cancelled (a no-op once it has finished).
    A Serve call also has ``routed`` and ``replica`` (``handles.RankCall``)."""

    def __await__(self) -> Any: ...

    def cancel(self) -> None: ...


class RankClient(Protocol):
    """What the ingress needs of one rank."""

    def encode(
        self,
        indices: list[int],
        items: list[EncoderItem],
        sent_at: float,
        caller: str,
        feature_dtype: str,
        held: Sequence[bool] = (),
        sink: object = None,
    ) -> Call:
        """``held[k]``: the rank's cache is expected to hold ``items[k]``'s features, so
        the item may go without its file bytes (the client sends them if it does not).
        ``sink`` (``sinks.EcFiles``): the rank delivers the features there and answers
        what it delivered (``sinks.Written``) in their place."""
        ...

    def load(self) -> Call:
        """Its ``LoadReport``; gives up routing after ``dispatch.route_timeout_s``."""
        ...

    def wake(self) -> Call:
        """Its ``LoadReport``, routed for as long as it takes: Serve starts a replica of
        a parked rank for a call that waits for one."""
        ...

    def hold(self, seconds: float) -> Call:
        """A call the rank answers (its ``LoadReport``) after ``seconds``: while one is
        open, Serve counts a call in flight and keeps the rank's replica."""
        ...

    async def replica_alive(self, replica: Any) -> bool:
        """Whether ``replica`` (one the rank answered from) still exists; unknown: True."""
        ...


@dataclass
class _Rank:
    """One rank as the roster sees it."""

    phase: str = LIVE  # LIVE, STARTING or PARKED: whether a replica exists and answers
    wanted: bool = True  # live and wanted: takes work; live and not wanted: draining
    why: str = ""  # the last scaling reason
    note: str = ""  # Serve's status message while it starts
    generation: int = 0  # +1 each time its replica is released: its cache with it
    # Health: None is up; else when the next probe may go.
    down_until: float | None = None
    down_at: float = -math.inf  # when it was last marked down
    reason: str = ""
    slow: bool = False  # down for being late or silent, not for failing
    failed: str | None = None  # the replica whose failure marked it down, if known
    replica: str | None = None  # the replica that last answered a call sent after down_at
    replica_since: float = -math.inf  # that call's send time
    # Load and progress.
    own: Work = field(default_factory=Work)  # dispatched by this replica, not answered yet
    calls: int = 0  # calls of this replica in flight on it
    report: LoadReport | None = None
    reported_at: float = -math.inf  # Roster.monotonic() of the report (its age)
    heard: float = -math.inf  # last progress seen
    progress: tuple | None = None  # (instance, answered) of the last report
    missed: float | None = None  # first missed poll since its last progress


class Roster:
    """The ranks of one ingress replica: state, load, progress, health (module doc)."""

    def __init__(
        self,
        ranks: Sequence[RankClient],
        dispatch: DispatchArgs,
        clock: Clock = time.monotonic,
        fixed: int | None = None,
        holds: bool = True,
        monotonic: Clock = time.monotonic,
    ):
        """``fixed``: how many ranks (the first ones) are always there; the others start
        parked (elastic ranks). None: all of them. ``holds``: this roster keeps one call
        open on each wanted elastic rank (the app's scaler does; an ingress replica, which
        follows the scaler's decision, does not). ``monotonic``: the clock of the reports' ages
        (wall time: a report grows old while the loop lags too)."""
        self.ranks = ranks
        self.clock = clock  # the ingress's LoopClock; tests pass one they move by hand
        self.monotonic = monotonic
        self.caller = f"ingress-{uuid.uuid4().hex}"  # how the ranks' reports name us
        self.cooldown_s = dispatch.cooldown_s
        self.route_timeout_s = dispatch.route_timeout_s
        self.slow_after_s = dispatch.slow_after_s
        self.slow_factor = dispatch.slow_factor
        self.report_interval_s = dispatch.load_report_interval_ms / 1e3
        # A poll may wait for routing as long as an encode call may, then must answer.
        self.report_timeout_s = dispatch.route_timeout_s + REPORT_ANSWER_S
        self.fixed = len(ranks) if fixed is None else fixed
        self.holds = holds
        self._ranks = [
            _Rank(phase=LIVE if r < self.fixed else PARKED, wanted=r < self.fixed)
            for r in range(len(ranks))
        ]
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}  # probes, look-ups, wakes
        self._poll: asyncio.Task | None = None
        self._poll_started = -math.inf
        self.failures = [0] * len(ranks)  # unavailable, slow or silent, per rank
        self.recoveries = [0] * len(ranks)  # times a down rank answered again
        self.ignored = 0  # failures of replicas already replaced
        self.redispatched = 0  # images sent again to another rank
        self.hedged = 0  # of them, sent again while a late call went on
        self.on_change: Callable[[], None] = lambda: None  # the ranks taking work changed

    def __len__(self) -> int:
        return len(self.ranks)

    # --- state ----------------------------------------------------------------------

    def state(self, rank: int) -> str:
        r = self._ranks[rank]
        if r.phase != LIVE:
            return r.phase
        if r.down_until is not None:
            return DOWN
        return LIVE if r.wanted else DRAINING

    def takes_work(self) -> set[int]:
        """Live, wanted and up: the ranks new work goes to."""
        return {r for r in range(len(self)) if self.state(r) == LIVE}

    def down(self) -> set[int]:
        return {r for r, s in enumerate(self._ranks) if s.down_until is not None}

    def failed(self) -> set[int]:
        """Ranks down for failing (not merely for being late or silent)."""
        return {r for r in self.down() if not self._ranks[r].slow}

    def excluded(self) -> set[int]:
        """Ranks to give no new work: all but those taking work; when none does, the live
        ones that are draining may; when none of those is up either, the slow ones still
        work (only later than hoped). Starting and parked ranks never get work."""
        for usable in (self.takes_work(), self._live() - self.down(), self._live() - self.failed()):
            if usable:
                return set(range(len(self))) - usable
        return set(range(len(self)))

    def up(self) -> set[int]:
        """The ranks new work may go to that are not down (late, silent or failed)."""
        return set(range(len(self))) - self.excluded() - self.down()

    def generation(self, rank: int) -> int:
        """Changes whenever the rank's replica is released: what it cached is gone."""
        return self._ranks[rank].generation

    def _live(self) -> set[int]:
        return {r for r, s in enumerate(self._ranks) if s.phase == LIVE}

    def _set(self, rank: int, phase: str, wanted: bool, why: str) -> None:
        """Move an elastic rank to ``phase``, wanted or not, for ``why``: a wanted live one
        is held (``_hold``), any other gets no call from this replica."""
        r = self._ranks[rank]
        before = self.takes_work()
        if phase != LIVE and r.phase == LIVE:
            r.generation += 1  # its replica (and its cache) is gone, or going
        r.phase, r.wanted, r.why = phase, wanted, why
        log.info("rank %d %s: %s", rank, self.state(rank), why)
        hold = self._tasks.get(("hold", rank))
        if self.holds and rank >= self.fixed and phase == LIVE and wanted:
            self._start_task("hold", rank, self._hold(rank))
        elif hold is not None:
            hold.cancel()  # no call at all from now on: Serve releases it once idle
        if self.takes_work() != before:
            self.on_change()

    # --- load -----------------------------------------------------------------------

    @contextmanager
    def dispatched(self, rank: int, work: Work) -> Iterator[None]:
        """A call of this replica on ``rank``, carrying ``work`` (its expected misses),
        until it is answered or given up."""
        r = self._ranks[rank]
        r.own, r.calls = r.own + work, r.calls + 1
        try:
            yield
        finally:
            r.own, r.calls = r.own - work, r.calls - 1

    def loads(self, model: CostModel) -> list[float]:
        """Outstanding cost of each rank under ``model``: this replica's own work (exact)
        and the other callers' from the rank's last report."""
        own = [r.own for r in self._ranks]
        reports = [r.report.by_caller if r.report else None for r in self._ranks]
        return rank_loads(own, reports, self.caller, model)

    def own_work(self) -> list[Work]:
        """What this replica has dispatched to each rank and had no answer for."""
        return [r.own for r in self._ranks]

    def reports(self) -> dict[int, tuple[LoadReport, float]]:
        """Each rank's last load report and when it came (``monotonic``; ranks with one)."""
        return {i: (r.report, r.reported_at) for i, r in enumerate(self._ranks) if r.report}

    def fitted_models(self) -> list[CostModel]:
        """The cost models the ranks reported (one per rank that has)."""
        return [r.report.cost_model for r in self._ranks if r.report is not None]

    def observe(self, rank: int, report: LoadReport | None) -> None:
        """Take a load report of ``rank`` (from a poll or an encode answer): progress if
        it has answered calls since its last report (or is another process), or holds no
        work to make progress on."""
        if report is None:
            return
        r = self._ranks[rank]
        mark = (report.progress.instance, report.progress.answered)
        if report.idle or mark != r.progress:
            r.heard = self.clock()
        r.progress, r.report, r.reported_at = mark, report, self.monotonic()

    async def refresh(self) -> None:
        """Poll the ranks taking work whose last report is older than the interval (one
        poll at a time).

        A request waits for the poll only when it has no recent view of some rank at all
        (never heard from, or not for ``REPORT_OUTDATED_S``), and then at most
        ``report_timeout_s`` (``dispatch.route_timeout_s`` + 0.2 s): a rank that misses it
        counts as silent (``missed_report``), so a hung rank holds no request. Otherwise
        the poll runs in the background and the request uses the reports it has. Every
        encode answer carries its rank's report too, so a busy rank is rarely polled. An
        interval of 0 asks for exact loads instead: every request waits (as long) for a
        poll started after it arrived.
        """
        now = self.monotonic()
        stale = [r for r in self.up() if now - self._ranks[r].reported_at >= self.report_interval_s]
        if not stale:
            return
        exact = self.report_interval_s == 0
        if self._poll is None or self._poll.done() or (exact and self._poll_started < now):
            self._poll_started = self.monotonic()
            self._poll = asyncio.get_running_loop().create_task(self._poll_ranks(stale))
        if exact or any(now - self._ranks[r].reported_at >= REPORT_OUTDATED_S for r in stale):
            await asyncio.wait([self._poll], timeout=self.report_timeout_s)

    async def _poll_ranks(self, stale: list[int]) -> None:
        async def one(rank: int) -> None:
            call = self.ranks[rank].load()
            try:
                report = await asyncio.wait_for(call, self.report_timeout_s)
            except Exception as exc:  # noqa: BLE001 - no report: the rank is silent
                call.cancel()
                r = self._ranks[rank]
                r.report, r.reported_at = None, self.monotonic()
                self.missed_report(rank, exc)
                return
            self.observe(rank, report)

        await asyncio.gather(*(one(r) for r in stale))

    # --- progress and lateness -------------------------------------------------------

    def heard(self, rank: int) -> None:
        """``rank`` answered an encode call: it is making progress now."""
        self._ranks[rank].heard = self.clock()

    def quiet_from(self, rank: int, since: float) -> float:
        """When the wait of a call sent at ``since`` on ``rank`` began to count: the later
        of its send time and the rank's last progress."""
        return max(since, self._ranks[rank].heard)

    def late_after_s(self, expected_s: float | None) -> float:
        """How long a call may go without an answer while its rank shows no progress:
        ``dispatch.slow_factor`` x the time the fitted model expects, at least
        ``dispatch.slow_after_s``."""
        return max(self.slow_after_s, self.slow_factor * (expected_s or 0.0))

    def late_at(self, rank: int, sent: float, routed: bool, late_after_s: float) -> float:
        """When a call sent at ``sent`` counts as late, as its rank's progress stands:
        while no replica has taken it, ``route_timeout_s`` after it was sent unless its
        rank showed progress within ``slow_after_s`` (then it waits in a busy rank's or a
        busy ingress's queue, not for a replacement); once taken, ``late_after_s`` past
        the later of its send time and its rank's last progress."""
        heard = self._ranks[rank].heard
        if not routed:
            return max(sent + self.route_timeout_s, heard + self.slow_after_s)
        return max(sent, heard) + late_after_s

    def late(
        self, rank: int, replica: str | None, sent: float, routed: bool, late_after_s: float
    ) -> None:
        """A call sent at ``sent`` is past ``late_at``: the rank is slow (no new work until
        it answers)."""
        if not routed:
            why = f"no replica took the call in {self.clock() - sent:.2f} s"
        else:
            why = f"no answer within {late_after_s:.2f} s, past what its load predicts"
        error = RankUnavailableError(
            rank, f"{why}, and no progress from the rank meanwhile", replica, slow=True
        )
        self.mark_down(error, sent)

    def missed_report(self, rank: int, error: BaseException) -> None:
        """A rank missed its load report. Unavailable if the poll failed (the replica
        died). Otherwise (not routed in time, or quiet) a poll waits in a busy rank's or a
        busy ingress's queue as any call does, so one miss says little: while this
        replica has calls in flight on the rank, their own lateness judges it; without,
        the rank is slow once its polls have gone on missing for ``slow_after_s`` with no
        progress from it in between."""
        r = self._ranks[rank]
        if rank in self.down():
            return
        if isinstance(error, RankUnavailableError) and not error.slow:
            self.mark_down(error, self.clock())
            return
        if r.calls:
            return
        now = self.clock()
        if r.missed is None or r.heard > r.missed:
            r.missed = now  # the first miss since the rank last showed progress
        elif now - r.missed >= self.slow_after_s:
            first, r.missed = r.missed, None  # once back up, its next miss is a first one
            why = f"no load report for {now - first:.2f} s ({error!r})"
            self.mark_down(RankUnavailableError(rank, why, slow=True), first)

    # --- health ----------------------------------------------------------------------

    def mark_down(self, error: RankUnavailableError, started: float) -> None:
        """``error`` ended a call sent at ``started``: the rank gets no new work until it
        answers again, unless the failure is an old replica's (its replacement answered a
        call sent after it)."""
        r = self._ranks[error.rank]
        if (
            error.replica is not None
            and r.replica is not None
            and error.replica != r.replica
            and r.replica_since > started
        ):
            self.ignored += 1  # an old replica's failure: its replacement already answered
            return
        before = self.takes_work()
        self.failures[error.rank] += 1
        was_up = r.down_until is None
        r.down_until = self.clock() + self.cooldown_s
        if was_up or r.slow or not error.slow:  # being late says less than failing
            r.down_at, r.reason, r.failed = self.clock(), str(error), error.replica
            r.slow = error.slow
        if was_up:
            log.warning("%s; its images go to the other ranks until it answers", error)
        if r.slow and r.replica is not None:
            self._start_task("look-up", error.rank, self._look_up(error.rank, r.replica))
        self._start_task("probe", error.rank, self._recover(error.rank))
        if self.takes_work() != before:
            self.on_change()

    def mark_up(self, rank: int, replica: str | None, started: float) -> None:
        """An answer from ``replica`` to a call sent at ``started``: the rank is up unless
        the call was sent before the rank was marked down, to the same replica."""
        r = self._ranks[rank]
        stale = started < r.down_at and not r.slow  # a late answer proves it lives
        if stale and (replica is None or r.failed is None or replica == r.failed):
            return  # a result that began before the failure says nothing of now
        if started >= r.replica_since:
            r.replica, r.replica_since = replica, started
        if r.down_until is not None:
            self.recoveries[rank] += 1
            log.info("rank %d answers again (replica %s); it takes work", rank, replica)
            r.down_until = None
            self.on_change()

    def retry_after_s(self) -> int:
        """Whole seconds until the first rank is probed again (at least 1)."""
        pending = [r.down_until for r in self._ranks if r.down_until is not None]
        soonest = min(pending, default=0.0) - self.clock()
        return max(1, math.ceil(soonest))

    def _start_task(self, kind: str, rank: int, work) -> None:
        """Run ``work`` (a coroutine) unless a task of ``kind`` for ``rank`` still runs
        (and is not being cancelled)."""
        task = self._tasks.get((kind, rank))
        if task is not None and not task.done() and not task.cancelling():
            work.close()
            return
        self._tasks[kind, rank] = asyncio.get_running_loop().create_task(work)

    async def _look_up(self, rank: int, replica: Any) -> None:
        """A slow rank whose last replica no longer exists has failed."""
        if await self.ranks[rank].replica_alive(replica):
            return
        r = self._ranks[rank]
        if r.down_until is not None and r.slow and r.replica == replica:
            why = f"its replica {replica} is gone"
            self.mark_down(RankUnavailableError(rank, why, replica), self.clock())

    async def _recover(self, rank: int) -> None:
        r = self._ranks[rank]
        while (until := r.down_until) is not None:
            await asyncio.sleep(max(0.0, until - self.clock()))
            if r.down_until is None:
                return
            if r.phase != LIVE:  # parked meanwhile: nothing to probe, it starts afresh
                r.down_until = None
                return
            started = self.clock()
            call = self.ranks[rank].load()
            try:
                report = await asyncio.wait_for(call, PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - still down: another cool-down
                call.cancel()
                if r.down_until is not None:
                    r.down_until = self.clock() + self.cooldown_s
                continue
            if isinstance(report, LoadReport):
                self.observe(rank, report)
            self.mark_up(rank, getattr(call, "replica", None), started)

    # --- elastic ranks (driven by scaling.Elastic) -------------------------------------

    def phase(self, rank: int) -> str:
        """LIVE, STARTING or PARKED: whether the rank has a replica that answers."""
        return self._ranks[rank].phase

    def is_wanted(self, rank: int) -> bool:
        """Wanted by this replica: taking work (or down for now), or starting."""
        r = self._ranks[rank]
        return r.wanted and r.phase in (LIVE, STARTING)

    def want(self, rank: int, why: str) -> None:
        """Give ``rank`` work again (draining), or mark it starting (parked: ``wake``)."""
        r = self._ranks[rank]
        if r.phase == LIVE:
            self._set(rank, LIVE, True, why)
        elif r.phase == PARKED:
            r.note = ""
            self._set(rank, STARTING, True, why)

    def wake(self, rank: int, start_timeout_s: float, failed: Callable[[int], None]) -> None:
        """Send the call that starts a starting rank: a load report routed until a replica
        answers it, for at most ``start_timeout_s``; ``failed(rank)`` if none does."""
        self._start_task("wake", rank, self._wake(rank, start_timeout_s, failed))

    def unwant(self, rank: int, why: str) -> None:
        """No new call for ``rank`` (no work, no poll): its calls finish, then Serve
        releases its replica."""
        r = self._ranks[rank]
        if r.phase == LIVE and r.wanted:
            self._set(rank, LIVE, False, why)

    def released(self, rank: int, why: str) -> None:
        """The rank has no replica any more: parked, and what it cached is forgotten."""
        r = self._ranks[rank]
        if r.phase != PARKED:
            self._set(rank, PARKED, False, why)
        r.down_until, r.report, r.heard, r.progress, r.replica = None, None, -math.inf, None, None

    def adopt(self, rank: int, why: str) -> None:
        """A rank this replica took for parked runs (another ingress replica woke it):
        live, given no work by this replica until it wants it."""
        if self._ranks[rank].phase == PARKED:
            self._set(rank, LIVE, False, why)

    def follow(self, rank: int, phase: str, why: str) -> None:
        """Take the app scaler's decision for ``rank`` (``decision.LIVE``, ``DRAINING``,
        ``STARTING`` or ``PARKED``): this replica gives it work, no new work, or nothing."""
        r = self._ranks[rank]
        if phase == PARKED:
            if r.phase != PARKED:
                self.released(rank, why)
        elif phase == STARTING:
            if r.phase != STARTING:
                self._set(rank, STARTING, True, why)
        elif r.phase != LIVE or r.wanted != (phase == LIVE):
            self._set(rank, LIVE, phase == LIVE, why)

    def note(self, rank: int, message: str) -> None:
        """Serve's status message for a starting rank (why no replica runs yet)."""
        r = self._ranks[rank]
        if message != r.note:
            r.note = message
            log.info("rank %d starting: %s", rank, message)

    async def _hold(self, rank: int) -> None:
        """Keep one call open on a wanted elastic rank, so Serve keeps its replica however
        long this replica leaves it without work; each answer is a load report."""
        r = self._ranks[rank]
        while r.phase == LIVE and r.wanted:
            started = self.clock()
            call = self.ranks[rank].hold(HOLD_S)
            try:
                report = await call
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - judged as a failed poll; held again later
                if isinstance(exc, RankUnavailableError) and not exc.slow:
                    self.mark_down(exc, started)
                await asyncio.sleep(self.cooldown_s)
                continue
            self.observe(rank, report)

    async def _wake(self, rank: int, timeout_s: float, failed: Callable[[int], None]) -> None:
        r = self._ranks[rank]
        started = self.clock()
        call = self.ranks[rank].wake()
        try:
            with self.dispatched(rank, Work()):
                report = await asyncio.wait_for(call, timeout_s)
        except Exception as exc:  # noqa: BLE001 - it did not start: the live ranks serve
            call.cancel()
            if r.phase != STARTING:
                return
            if isinstance(exc, asyncio.TimeoutError):
                why = f"no replica answered within start_timeout_s={timeout_s:g} s"
            else:
                why = f"its start failed ({type(exc).__name__}: {exc})"
            serve_says = f"; Serve: {r.note}" if r.note else ""
            log.warning("rank %d could not start: %s%s", rank, why, serve_says)
            self._set(rank, PARKED, False, f"could not start: {why}{serve_says}")
            failed(rank)
            return
        if r.phase != STARTING:
            return
        self.observe(rank, report)
        self.mark_up(rank, getattr(call, "replica", None), started)
        self._set(rank, LIVE, True, f"started in {self.clock() - started:.1f} s")

    # --- reporting -------------------------------------------------------------------

    def rank_info(self, rank: int) -> dict[str, Any]:
        r = self._ranks[rank]
        return {
            "rank": rank,
            "state": self.state(rank),
            "scaling_reason": r.why,
            "down_reason": r.reason if r.down_until is not None else None,
        }

    def info(self) -> dict[str, Any]:
        return {
            "ranks_up": sorted(set(range(len(self))) - self.down()),
            "down": {r: s.reason for r, s in enumerate(self._ranks) if s.down_until is not None},
            "replicas": [s.replica for s in self._ranks],
            "unavailable_errors": list(self.failures),
            "recoveries": list(self.recoveries),
            "ignored_old_replica_errors": self.ignored,
            "redispatched_images": self.redispatched,
            "hedged_images": self.hedged,
            "cooldown_s": self.cooldown_s,
        }
