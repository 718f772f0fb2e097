"""``Roster``: the one place that calls a rank, over the wing's pure rules.

Ray-free: a rank is a ``RankClient`` (``deployments/handles.py`` wraps a Serve handle;
tests use plain objects). Every call goes through ``call``: the gate
(``lifecycle.may_call``) refuses a rank that may not be called, and the send time is
read from the roster's one clock (``clock``: the ingress's ``LoopClock``). Every outcome
goes through ``book``: an answer is progress (its load report observed, the rank up
again if it was down and the call was sent after); a ``RankUnavailableError`` marks it
down, or for a load poll counts as a missed report. Fan-out, the hand-off, ``/v1/info``
and the roster's own tasks (poll, probe, look-up, hold, wake) all call and book here.

The rules are ``lifecycle.py`` (who takes work, who may be called, phases),
``health.py`` (lateness, down and up) and ``loads.py`` (loads and progress). A request's
deadline is the client's wall time and is the fan-out's own (``time.monotonic()``); a
report's age is on ``monotonic`` (wall time: a report grows old while the loop lags too).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kimi_encoder.cost import CostModel
from kimi_encoder.load import Work

from ..args import DispatchArgs, ScalingArgs
from . import health, lifecycle, loads, tasks
from .calls import Call, RankClient, RankUnavailableError
from .lifecycle import ENCODE, HEALTH, HOLD, INFO, POLL, PROBE, PUSH
from .records import LoadReport
from .row import LIVE, PARKED, STARTING, Clock, Row

log = logging.getLogger("ray.serve")

MARKS = (HOLD, INFO, PUSH)  # calls whose failure (not a slow one) marks their rank down


class CallRefused(RankUnavailableError):
    """The gate refused the call: the rank may not be called now (``lifecycle``)."""


class Roster:
    """One caller's ranks: state, load, progress and health, and every call (module doc)."""

    def __init__(
        self,
        ranks: Sequence[RankClient],
        dispatch: DispatchArgs,
        clock: Clock = time.monotonic,
        fixed: int | None = None,
        holds: bool = True,
        monotonic: Clock = time.monotonic,
        hold_s: float | None = None,
    ):
        """``fixed``: how many ranks (the first ones) are always there; the others start
        parked (elastic ranks). None: all of them. ``holds``: this roster holds and wakes
        the wanted elastic ranks (the app's scaler; an ingress replica follows it)."""
        self._clients = ranks
        self.clock = clock  # the ingress's LoopClock; tests pass one they move by hand
        self.monotonic = monotonic
        self.caller = f"ingress-{uuid.uuid4().hex}"  # how the ranks' reports name us
        self.rules = health.Lateness.of(dispatch)
        self.report_interval_s = dispatch.load_report_interval_ms / 1e3
        # A poll may wait for routing as long as an encode call may, then must answer.
        self.report_timeout_s = dispatch.route_timeout_s + dispatch.report_answer_s
        self.report_outdated_s = dispatch.report_outdated_s
        self.probe_timeout_s = dispatch.probe_timeout_s
        self.fixed = len(ranks) if fixed is None else fixed
        self.holds = holds
        self.hold_s = ScalingArgs().hold_s if hold_s is None else hold_s  # scaling.hold_s
        fixed_ = [r < self.fixed for r in range(len(ranks))]
        self.rows = [Row(LIVE if f else PARKED, wanted=f, fixed=f) for f in fixed_]
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}  # probes, look-ups, holds, wakes
        self._poll: asyncio.Task | None = None
        self._poll_started = -math.inf
        self.failures = [0] * len(ranks)  # unavailable, slow or silent, per rank
        self.recoveries = [0] * len(ranks)  # times a down rank answered again
        self.ignored = 0  # failures of replicas already replaced
        self.redispatched = 0  # images sent again to another rank
        self.hedged = 0  # of them, sent again while a late call went on
        self.on_change: Callable[[], None] = lambda: None  # the ranks taking work changed

    def __len__(self) -> int:
        return len(self._clients)

    # --- the gate and the book --------------------------------------------------------

    def call(self, rank: int, purpose: str, *args: Any) -> tuple[Call, float]:
        """Send ``rank`` the call for ``purpose`` (``lifecycle.PURPOSES``; the client's
        method of that name with ``args``): the call and its send time on the roster's
        clock. ``CallRefused`` when the gate says the rank may not be called."""
        why = lifecycle.may_call(self.rows, rank, purpose, self.holds)
        if why is not None:
            raise CallRefused(rank, why, slow=True)
        method = {POLL: "load", PROBE: "load", HEALTH: "load"}.get(purpose, purpose)
        return getattr(self._clients[rank], method)(*args), self.clock()

    def book(self, rank: int, purpose: str, sent: float, outcome: Any, replica=None) -> None:
        """A call to ``rank`` for ``purpose`` sent at ``sent`` ended with ``outcome``: its
        answer (a ``LoadReport``, or an answer carrying one as ``load``) or its error."""
        row = self.rows[rank]
        if isinstance(outcome, BaseException):
            unavailable = isinstance(outcome, RankUnavailableError)
            if purpose in (POLL, HEALTH):
                row.report, row.reported_at = None, self.monotonic()
                self.missed_report(rank, outcome)
            elif unavailable and (purpose == ENCODE or (purpose in MARKS and not outcome.slow)):
                self.mark_down(outcome, sent)
            return  # a probe or a wake: its own loop goes on; anything else: the request's
        if purpose == ENCODE:
            row.heard = self.clock()
        report = outcome if isinstance(outcome, LoadReport) else getattr(outcome, "load", None)
        self.observe(rank, report)
        self.mark_up(rank, replica, sent)

    async def ask(self, rank: int, purpose: str, timeout_s: float | None, *args: Any) -> Any:
        """``call`` and await it (within ``timeout_s``), booked; its answer or its error."""
        call, sent = self.call(rank, purpose, *args)
        try:
            answer = await asyncio.wait_for(call, timeout_s)
        except BaseException as exc:
            call.cancel()
            if isinstance(exc, Exception):
                self.book(rank, purpose, sent, exc, getattr(call, "replica", None))
            raise
        self.book(rank, purpose, sent, answer, getattr(call, "replica", None))
        return answer

    # --- state ------------------------------------------------------------------------

    def state(self, rank: int) -> str:
        return self.rows[rank].state

    def takes_work(self) -> set[int]:
        return lifecycle.takes_work(self.rows)

    def down(self) -> set[int]:
        return lifecycle.down(self.rows)

    def failed(self) -> set[int]:
        return lifecycle.failed(self.rows)

    def excluded(self) -> set[int]:
        return lifecycle.excluded(self.rows)

    def up(self) -> set[int]:
        return lifecycle.up(self.rows)

    def generation(self, rank: int) -> int:
        """Changes whenever the rank's replica is released: what it cached is gone."""
        return self.rows[rank].generation

    # --- load -------------------------------------------------------------------------

    @contextmanager
    def dispatched(self, rank: int, work: Work) -> Iterator[None]:
        """A call of this roster on ``rank``, carrying ``work`` (its expected misses),
        until it is answered or given up."""
        row = self.rows[rank]
        row.own, row.calls = row.own + work, row.calls + 1
        try:
            yield
        finally:
            row.own, row.calls = row.own - work, row.calls - 1

    def loads(self, model: CostModel) -> list[float]:
        return loads.loads(self.rows, self.caller, model)

    def own_work(self) -> list[Work]:
        return [row.own for row in self.rows]

    def reports(self) -> dict[int, tuple[LoadReport, float]]:
        """Each rank's last load report and when it came (``monotonic``; ranks with one)."""
        return {r: (row.report, row.reported_at) for r, row in enumerate(self.rows) if row.report}

    def fitted_models(self) -> list[CostModel]:
        return [row.report.cost_model for row in self.rows if row.report is not None]

    def observe(self, rank: int, report: LoadReport | None) -> None:
        if report is not None:
            loads.observe(self.rows[rank], report, self.clock(), self.monotonic())

    async def refresh(self) -> None:
        """Poll the ranks up whose last report is older than the interval (one poll at a
        time). A request waits for it only when some rank has no recent view at all (never
        heard from, or not for ``dispatch.report_outdated_s``), and then at most
        ``report_timeout_s``: a rank that misses it counts as silent. Every encode answer
        carries its rank's report too. An interval of 0 asks for exact loads instead: every
        request waits (as long) for a poll started after it arrived."""
        now = self.monotonic()
        stale = loads.stale(self.rows, self.up(), now, self.report_interval_s)
        if not stale:
            return
        exact = self.report_interval_s == 0
        if self._poll is None or self._poll.done() or (exact and self._poll_started < now):
            self._poll_started = self.monotonic()
            self._poll = asyncio.get_running_loop().create_task(tasks.poll(self, stale))
        outdated = loads.stale(self.rows, stale, now, self.report_outdated_s)
        if exact or outdated:
            await asyncio.wait([self._poll], timeout=self.report_timeout_s)

    async def replica_alive(self, rank: int, replica: Any) -> bool:
        """Whether ``replica`` of ``rank`` still exists (asked of Ray, not of the rank)."""
        return await self._clients[rank].replica_alive(replica)

    # --- lateness and health ----------------------------------------------------------

    @property
    def slow_after_s(self) -> float:
        return self.rules.slow_after_s

    @property
    def route_timeout_s(self) -> float:
        return self.rules.route_timeout_s

    def heard(self, rank: int) -> None:
        """``rank`` answered a call: it is making progress now."""
        self.rows[rank].heard = self.clock()

    def quiet_from(self, rank: int, since: float) -> float:
        """When the wait of a call sent at ``since`` on ``rank`` began to count."""
        return max(since, self.rows[rank].heard)

    def late_after_s(self, expected_s: float | None) -> float:
        return health.late_after_s(self.rules, expected_s)

    def late_at(self, rank: int, sent: float, routed: bool, late_after_s: float) -> float:
        return health.late_at(self.rules, self.rows[rank], sent, routed, late_after_s)

    def late(self, rank: int, replica, sent: float, routed: bool, late_after_s: float) -> None:
        """A call sent at ``sent`` is past ``late_at``: the rank is slow (no new work)."""
        waited = self.clock() - sent
        self.mark_down(health.late_error(rank, replica, waited, routed, late_after_s), sent)

    def missed_report(self, rank: int, error: BaseException) -> None:
        """A load poll of ``rank`` failed (``health.missed_report``)."""
        found = health.missed_report(self.rules, rank, self.rows[rank], error, self.clock())
        if found is not None:
            self.mark_down(*found)

    def mark_down(self, error: RankUnavailableError, started: float) -> None:
        """``error`` ended a call sent at ``started`` (``health.mark_down``)."""
        row, before = self.rows[error.rank], self.takes_work()
        done = health.mark_down(self.rules, row, error, started, self.clock())
        if done == health.IGNORED:
            self.ignored += 1  # an old replica's failure: its replacement already answered
            return
        self.failures[error.rank] += 1
        if done == health.DOWN_NOW:
            log.warning("%s; its images go to the other ranks until it answers", error)
        if row.slow and row.replica is not None:
            self._start_task("look-up", error.rank, tasks.look_up(self, error.rank, row.replica))
        self._start_task("probe", error.rank, tasks.recover(self, error.rank))
        if self.takes_work() != before:
            self.on_change()

    def mark_up(self, rank: int, replica: str | None, started: float) -> None:
        if health.mark_up(self.rows[rank], replica, started):
            self.recoveries[rank] += 1
            log.info("rank %d answers again (replica %s); it takes work", rank, replica)
            self.on_change()

    def retry_after_s(self) -> int:
        return health.retry_after_s(self.rows, self.clock())

    def _start_task(self, kind: str, rank: int, work) -> None:
        """Run ``work`` unless a task of ``kind`` for ``rank`` still runs (not cancelling)."""
        task = self._tasks.get((kind, rank))
        if task is not None and not task.done() and not task.cancelling():
            work.close()
            return
        self._tasks[kind, rank] = asyncio.get_running_loop().create_task(work)

    # --- lifecycle (elastic ranks, driven by ranks.scaler) ------------------------------

    def phase(self, rank: int) -> str:
        return self.rows[rank].phase

    def is_wanted(self, rank: int) -> bool:
        """Wanted: taking work (or down for now), or starting."""
        row = self.rows[rank]
        return row.wanted and row.phase in (LIVE, STARTING)

    def set_phase(self, rank: int, phase: str, wanted: bool, why: str) -> None:
        """``lifecycle.set_phase``, then hold a wanted live elastic rank (the holder) or
        take back any call held on it."""
        before = self.takes_work()
        lifecycle.set_phase(self.rows[rank], phase, wanted, why)
        log.info("rank %d %s: %s", rank, self.state(rank), why)
        if lifecycle.may_call(self.rows, rank, HOLD, self.holds) is None:
            self._start_task("hold", rank, tasks.hold(self, rank))
        elif (held := self._tasks.get(("hold", rank))) is not None:
            held.cancel()  # no call at all from now on: Serve releases it once idle
        if self.takes_work() != before:
            self.on_change()

    def want(self, rank: int, why: str) -> None:
        """Give ``rank`` work again (draining), or mark it starting (parked: ``wake``)."""
        row = self.rows[rank]
        if row.phase == LIVE:
            self.set_phase(rank, LIVE, True, why)
        elif row.phase == PARKED:
            row.note = ""
            self.set_phase(rank, STARTING, True, why)

    def unwant(self, rank: int, why: str) -> None:
        """No new call for ``rank``: its calls finish, then Serve releases its replica."""
        if self.rows[rank].phase == LIVE and self.rows[rank].wanted:
            self.set_phase(rank, LIVE, False, why)

    def released(self, rank: int, why: str) -> None:
        """The rank has no replica any more: parked, and what it cached is forgotten."""
        if self.rows[rank].phase != PARKED:
            self.set_phase(rank, PARKED, False, why)
        lifecycle.released(self.rows[rank], why)

    def adopt(self, rank: int, why: str) -> None:
        """A rank taken for parked runs: live, given no work until it is wanted."""
        if self.rows[rank].phase == PARKED:
            self.set_phase(rank, LIVE, False, why)

    def follow(self, rank: int, phase: str, why: str) -> None:
        """Take the scaler's decision for ``rank`` (live, draining, starting or parked)."""
        row = self.rows[rank]
        if phase == PARKED:
            self.released(rank, why)
        elif phase == STARTING:
            if row.phase != STARTING:
                self.set_phase(rank, STARTING, True, why)
        elif row.phase != LIVE or row.wanted != (phase == LIVE):
            self.set_phase(rank, LIVE, phase == LIVE, why)

    def note(self, rank: int, message: str) -> None:
        """Serve's status message for a starting rank (why no replica runs yet)."""
        if message != self.rows[rank].note:
            self.rows[rank].note = message
            log.info("rank %d starting: %s", rank, message)

    def wake(self, rank: int, start_timeout_s: float, failed: Callable[[int], None]) -> None:
        """Send the call that starts a starting rank: a load report routed until a replica
        answers it, for at most ``start_timeout_s``; ``failed(rank)`` if none does."""
        self._start_task("wake", rank, tasks.wake(self, rank, start_timeout_s, failed))
