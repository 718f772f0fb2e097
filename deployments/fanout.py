"""One request's images to their owner ranks and back: fan-out, re-dispatch, hedging,
ordered gather.

Ray-free: a rank is a ``RankClient`` (``deployments/handles.py`` wraps a Serve
deployment handle; tests use plain objects). Its calls are awaitables with
``cancel()``; a call that fails with ``RankUnavailableError`` (the rank died, is
being replaced, its queue is full, no replica took the call in time) is not the
request's doing, so its images go to the ranks still up, within the same
request, until every image has features or ``ingress.request_timeout_s`` is spent. Any
other error (an undecodable image, an encoder failure) is the answer: it would
fail again anywhere.

A call that no replica of its rank has taken after ``dispatch.route_timeout_s`` (a
``routed`` attribute of the call; calls without one count as routed) is late
too: the rank may be dead and waiting for its replacement, or the machine may be
too starved of CPU to route in time. Its images go to the other ranks while it
goes on routing, so a starved machine answers late rather than not at all. To
tell the two apart, a rank marked slow has the replica it last answered from
looked up (``RankClient.replica_alive``): a replica that no longer exists makes
the rank *failed*, so its unrouted calls are dropped and, with every rank gone,
requests get 503 at once instead of waiting for the replacements.

A call that is late (no answer by ``dispatch.slow_factor`` x the time the fitted cost
model expects, and at least ``dispatch.slow_after_s``) makes its rank *slow*: the
rank gets no new work, and the call's images are sent again to the other ranks
while the late call goes on. Whichever answer comes first is used; the other
call is cancelled. So a hung rank costs a request one bounded wait, not the
request's timeout.

Load is not failure. Both waits (for a replica to take the call, for its answer)
count from the later of the call's start and the last time its rank showed
progress: an encode answer, or a load report (``RankHealth.reported``) saying it
answered more calls than before or holds no work. A rank that keeps answering is
busy, not hung, however long its queue (or this ingress's own event loop) makes a
call wait, so it is never marked down for it and nothing is sent twice. The ingress
judges by a ``LoopClock``, which stands still while its own event loop lags: answers
that arrived during a stall count before any wait does. A call is
never hedged to its own rank: with no other rank up, the late call keeps its
images. A hung process (stopped, deadlocked) answers nothing and is routed around
as before; a forward that hangs while cache hits still answer is the health
check's to find (the replica is replaced, its calls fail and are re-dispatched).

``RankHealth`` is this ingress replica's view of which ranks take work, kept in
the order things happened: a rank marked down (unavailable, slow, silent) gets
no work until an answer to a call that *started after* the failure, or from
another replica of the rank (its replacement), brings it back; a failure of a
replica the rank has since replaced does not mark the replacement down. While
down, a background probe (the rank's cheap ``load`` call) asks again every
``dispatch.cooldown_s``. With no rank up the request is answered at once with
``NoRankAvailableError`` (503 with ``Retry-After``), never a hang.

With ``kept`` (``KeptFeatures``: the ingress cache, ``ingress.cache_bytes``), images
whose features this replica holds are filled in first, without a rank call, and
every answer's arrays that lie in the object store are held; only the rest are
assigned and sent.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kimi_encoder.config import VisionConfig
from kimi_encoder.items import EncoderItem

from .dispatch import Dispatcher, Plan
from .sinks import Destination

log = logging.getLogger("ray.serve")

PROBE_TIMEOUT_S = 5.0  # a replacement rank may still be loading its model
RECHECK_S = 0.1  # how often a request whose ranks are all down looks for one back

Clock = Callable[[], float]


class LoopClock:
    """Seconds as this process's event loop lived them: ``time.monotonic()`` less the
    loop's lag, the clock ``RankHealth`` judges lateness by in the ingress.

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
    error carries no time: whoever judges it places it by when the call was sent, on
    its own clock (``RankHealth.mark_down``)."""

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


class NoRankAvailableError(RuntimeError):
    """Every rank is down or busy (HTTP 503 with ``Retry-After``)."""

    def __init__(self, retry_after_s: int):
        self.retry_after_s = retry_after_s
        super().__init__(
            "no encoder rank is available: they are being replaced or their queues are "
            f"full; retry after {retry_after_s} s."
        )


class RequestTimeoutError(TimeoutError):
    """The ranks did not answer within ``ingress.request_timeout_s`` (HTTP 504)."""

    def __init__(self, timeout_s: float):
        super().__init__(
            f"the encoder ranks did not answer within request_timeout_s={timeout_s:g} s; the "
            "request was cancelled. Send fewer or smaller images per request, or retry later."
        )


class Call(Protocol):
    """An awaitable rank call that can be cancelled (a no-op once it has finished)."""

    def __await__(self) -> Any: ...

    def cancel(self) -> None: ...


class RankClient(Protocol):
    """What the fan-out needs of one rank."""

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

    def load(self) -> Call: ...

    async def replica_alive(self, replica: Any) -> bool:
        """Whether ``replica`` (one the rank answered from) still exists; unknown: True."""
        ...


class KeptFeatures(Protocol):
    """Features this ingress replica holds (``handles.IngressCache``): a repeated image
    is answered from them without a rank call."""

    def lookup(self, keys: Sequence[str]) -> dict[int, tuple[np.ndarray, int]]:
        """Position in ``keys`` -> (features, the rank that encoded them), for the keys
        whose features are held."""
        ...

    def keep(self, key: str, features: np.ndarray, rank: int) -> None:
        """Hold ``features`` (an answer's array that lies in the object store) for
        ``key``."""
        ...


@dataclass
class RankAnswer:
    """One rank's answer to one call, with the time (``time.time()``) it arrived."""

    rank: int
    result: dict
    arrived_at: float

    @property
    def transfer_ms(self) -> float:
        return max(0.0, self.arrived_at - self.result.get("done_at", self.arrived_at)) * 1e3


@dataclass
class Gathered:
    """Every item's features in request order (the ranks' arrays, read in place from the
    object store, in ``dtype``'s storage, see ``kimi_encoder.features``), who encoded it,
    and each rank's answer."""

    features: list[np.ndarray]
    owners: list[int]
    dtype: str
    answers: dict[int, RankAnswer] = field(default_factory=dict)
    redispatched: int = 0
    keys: list[str] | None = None  # every item's cache key, with kept features on
    # Where the ranks delivered the features instead (then ``features`` hold what each
    # delivered: ``sinks.Written``); None: they came back.
    destination: Destination | None = None


@dataclass
class _RankState:
    down_until: float | None = None  # None: up; else when the next probe may go
    down_at: float = -math.inf  # when it was last marked down (the health's clock)
    reason: str = ""
    slow: bool = False  # down for being late or silent, not for failing
    failed: str | None = None  # the replica whose failure marked it down, if known
    replica: str | None = None  # the replica that last answered a call started after down_at
    replica_since: float = -math.inf  # that call's start


class RankHealth:
    """Which ranks take work, as this ingress replica has seen them answer (module doc)."""

    def __init__(
        self, ranks: Sequence[RankClient], cooldown_s: float, clock: Clock = time.monotonic
    ):
        self.ranks = ranks
        self.cooldown_s = cooldown_s
        self.clock = clock  # time.monotonic(); tests pass one they move by hand
        self._state = [_RankState() for _ in ranks]
        self._probes: list[asyncio.Task | None] = [None] * len(ranks)
        self._lookups: list[asyncio.Task | None] = [None] * len(ranks)
        self.failures = [0] * len(ranks)  # unavailable, slow or silent, per rank
        self.recoveries = [0] * len(ranks)  # times a down rank answered again
        self.ignored = 0  # failures of replicas already replaced
        self.redispatched = 0  # images sent again to another rank
        self.hedged = 0  # of them, sent again while a late call went on
        self._heard = [-math.inf] * len(ranks)  # last progress seen (clock time)
        self._progress: list[tuple | None] = [None] * len(ranks)  # (instance, answered)

    def heard(self, rank: int) -> None:
        """``rank`` answered an encode call: it is making progress now."""
        self._heard[rank] = self.clock()

    def reported(self, rank: int, report: dict) -> None:
        """A load report of ``rank``: progress if it has answered calls since its last
        report (or is another process), or holds no work to make progress on."""
        progress = report.get("progress") or {}
        mark = (progress.get("instance"), progress.get("answered"))
        if not report.get("by_caller") or mark != self._progress[rank]:
            self._heard[rank] = self.clock()
        self._progress[rank] = mark

    def quiet_from(self, rank: int, since: float) -> float:
        """When the wait of a call started at ``since`` on ``rank`` began to count: the
        later of its start and the rank's last progress (clock time)."""
        return max(since, self._heard[rank])

    def down(self) -> set[int]:
        return {r for r, state in enumerate(self._state) if state.down_until is not None}

    def failed(self) -> set[int]:
        """Ranks down for failing (not merely for being late or silent)."""
        return {r for r in self.down() if not self._state[r].slow}

    def excluded(self) -> set[int]:
        """Ranks to give no work: every down rank while one is up; when none is up, only
        the failed ones (slow or silent ranks still work, only later than hoped)."""
        down = self.down()
        if len(down) < len(self._state):
            return down
        return {r for r in down if not self._state[r].slow}

    def mark_down(self, error: RankUnavailableError, started: float) -> None:
        """``error`` ended a call sent at ``started`` (this health's clock, as every time
        it compares)."""
        state = self._state[error.rank]
        if (
            error.replica is not None
            and state.replica is not None
            and error.replica != state.replica
            and state.replica_since > started
        ):
            self.ignored += 1  # an old replica's failure: its replacement already answered
            return
        self.failures[error.rank] += 1
        was_up = state.down_until is None
        state.down_until = self.clock() + self.cooldown_s
        if was_up or state.slow or not error.slow:  # being late says less than failing
            state.down_at, state.reason, state.failed = self.clock(), str(error), error.replica
            state.slow = error.slow
        if was_up:
            log.warning("%s; its images go to the other ranks until it answers", error)
        lookup = self._lookups[error.rank]
        if state.slow and state.replica is not None and (lookup is None or lookup.done()):
            self._lookups[error.rank] = asyncio.get_running_loop().create_task(
                self._look_up(error.rank, state.replica)
            )
        probe = self._probes[error.rank]
        if probe is None or probe.done():
            self._probes[error.rank] = asyncio.get_running_loop().create_task(
                self._recover(error.rank)
            )

    def mark_up(self, rank: int, replica: str | None, started: float) -> None:
        """An answer from ``replica`` to a call started at ``started``: the rank is up
        unless the call started before the rank was marked down, from the same replica."""
        state = self._state[rank]
        stale = started < state.down_at and not state.slow  # a late answer proves it lives
        if stale and (replica is None or state.failed is None or replica == state.failed):
            return  # a result that began before the failure says nothing of now
        if started >= state.replica_since:
            state.replica, state.replica_since = replica, started
        if state.down_until is not None:
            self.recoveries[rank] += 1
            log.info("rank %d answers again (replica %s); it takes work", rank, replica)
        state.down_until = None

    async def _look_up(self, rank: int, replica: Any) -> None:
        """A slow rank whose last replica no longer exists has failed (module doc)."""
        if await self.ranks[rank].replica_alive(replica):
            return
        state = self._state[rank]
        if state.down_until is not None and state.slow and state.replica == replica:
            why = f"its replica {replica} is gone"
            self.mark_down(RankUnavailableError(rank, why, replica), self.clock())

    async def _recover(self, rank: int) -> None:
        state = self._state[rank]
        while (until := state.down_until) is not None:
            await asyncio.sleep(max(0.0, until - self.clock()))
            if state.down_until is None:
                return
            started = self.clock()
            call = self.ranks[rank].load()
            try:
                report = await asyncio.wait_for(call, PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - still down: another cool-down
                call.cancel()
                if state.down_until is not None:
                    state.down_until = self.clock() + self.cooldown_s
                continue
            if isinstance(report, dict):
                self.reported(rank, report)
            self.mark_up(rank, getattr(call, "replica", None), started)

    def retry_after_s(self) -> int:
        """Whole seconds until the first rank is probed again (at least 1)."""
        pending = [s.down_until for s in self._state if s.down_until is not None]
        soonest = min(pending, default=0.0) - self.clock()
        return max(1, math.ceil(soonest))

    def info(self) -> dict[str, Any]:
        return {
            "ranks_up": sorted(set(range(len(self.ranks))) - self.down()),
            "down": {r: s.reason for r, s in enumerate(self._state) if s.down_until is not None},
            "replicas": [s.replica for s in self._state],
            "unavailable_errors": list(self.failures),
            "recoveries": list(self.recoveries),
            "ignored_old_replica_errors": self.ignored,
            "redispatched_images": self.redispatched,
            "hedged_images": self.hedged,
            "cooldown_s": self.cooldown_s,
        }


# Called with {rank: item indices} of a round; returns a context that spans the round.
InFlight = Callable[[dict[int, list[EncoderItem]]], AbstractContextManager]


@dataclass
class _Flight:
    """One call in flight: its rank, which request items its answer covers (request
    index -> row block of its answer), when it was sent, how long it may go without an
    answer while its rank makes no progress, what to release at its end."""

    rank: int
    call: Call
    task: asyncio.Task
    plan: Plan
    covers: dict[int, int]
    sent: float  # on the health's clock
    late_after_s: float
    late: bool = False
    stack: ExitStack = field(default_factory=ExitStack)


class FanOut:
    """Sends a request's items to their owners, re-dispatches, hedges, gathers in order."""

    def __init__(
        self,
        ranks: Sequence[RankClient],
        dispatcher: Dispatcher,
        health: RankHealth,
        *,
        vision: VisionConfig,
        timeout_s: float,
        slow_after_s: float = 1.0,
        slow_factor: float = 3.0,
        route_late_s: float = math.inf,
        in_flight: InFlight | None = None,
        kept: KeptFeatures | None = None,
    ):
        self.ranks = ranks
        self.dispatcher = dispatcher
        self.health = health
        self.vision = vision
        self.timeout_s = timeout_s
        self.slow_after_s = slow_after_s
        self.slow_factor = slow_factor
        self.route_late_s = route_late_s
        self.in_flight = in_flight or (lambda _: nullcontext())
        self.kept = kept
        self._flying = [0] * len(ranks)  # calls in flight per rank (of every request)
        self._missed: list[float | None] = [None] * len(ranks)  # first missed poll
        dispatcher.on_silent = self._silent
        dispatcher.on_report = health.reported

    async def run(
        self,
        items: Sequence[EncoderItem],
        feature_dtype: str,
        destination: Destination | None = None,
    ) -> Gathered:
        """Features of every item, in order, or with a ``destination`` what each rank
        delivered there; raises the first non-retryable error."""
        # The request's timeout is the client's: wall time, however the loop lags.
        deadline = time.monotonic() + self.timeout_s
        n = len(items)
        missing: list = [None] * n  # filled by the ranks' answers
        gathered = Gathered(missing, [-1] * n, feature_dtype, destination=destination)
        self._fill_kept(items, gathered)
        if any(f is None for f in gathered.features):
            await self.dispatcher.refresh(self.ranks, skip=self.health.down())
        flights: list[_Flight] = []
        rounds = 0  # every image is sent in the first; one uncovered later was sent before
        try:
            while any(f is None for f in gathered.features):
                uncovered = self._uncovered(gathered, flights)
                if uncovered and len(self.health.excluded()) < len(self.ranks):
                    flights += self._dispatch(uncovered, items, gathered, again=rounds > 0)
                    rounds += 1
                elif uncovered and not flights:
                    raise NoRankAvailableError(self.health.retry_after_s())
                await self._next(flights, gathered, deadline)
        finally:
            for flight in flights:
                flight.call.cancel()
                flight.stack.close()
        for i, (item, array) in enumerate(zip(items, gathered.features, strict=True)):
            expected = (self.vision.num_tokens(item.grid), self.vision.text_hidden_size)
            if tuple(array.shape) != expected:
                raise RuntimeError(
                    f"item {i}: rank {gathered.owners[i]} returned {tuple(array.shape)}, its "
                    f"grid needs {expected}"
                )
        return gathered

    def _fill_kept(self, items: Sequence[EncoderItem], gathered: Gathered) -> None:
        """Fill in the features this ingress replica kept (none without ``kept``, nor for
        a destination: there the ranks deliver, the ingress holds no feature bytes)."""
        if self.kept is None or gathered.destination is not None:
            return
        gathered.keys = self.dispatcher.keys(items, gathered.dtype)
        for i, (array, rank) in self.kept.lookup(gathered.keys).items():
            gathered.features[i], gathered.owners[i] = array, rank

    def _uncovered(self, gathered: Gathered, flights: list[_Flight]) -> dict[int | None, list[int]]:
        """Request indices without features that no call is working on, by the rank a new
        call must avoid: None for those with no call at all, the late call's rank for
        those a late call holds while another rank is up to hedge to (never its own)."""
        up = set(range(len(self.ranks))) - self.health.down()
        holder: dict[int, int | None] = {}
        for flight in flights:
            hedge = flight.late and bool(up - {flight.rank})
            for i in flight.covers:
                if not hedge:
                    holder[i] = -1  # a call on time, or late with nowhere else to go
                else:
                    holder.setdefault(i, flight.rank)
        out: dict[int | None, list[int]] = {}
        for i, got in enumerate(gathered.features):
            if got is None and holder.get(i) != -1:
                out.setdefault(holder.get(i), []).append(i)
        return out

    def _dispatch(
        self,
        uncovered: dict[int | None, list[int]],
        items: Sequence[EncoderItem],
        gathered: Gathered,
        again: bool,
    ) -> list[_Flight]:
        """Calls for every uncovered item (``_uncovered``), counting re-dispatches (``again``:
        sent before) and, of them, hedges."""
        flights = []
        for avoid, pending in uncovered.items():
            if again:
                self.health.redispatched += len(pending)
                gathered.redispatched += len(pending)
                if avoid is not None:  # hedged: its late call goes on
                    self.health.hedged += len(pending)
            flights += self._send(pending, items, gathered, avoid)
        return flights

    def _send(
        self,
        pending: list[int],
        items: Sequence[EncoderItem],
        gathered: Gathered,
        avoid: int | None = None,
    ) -> list[_Flight]:
        """One call per owner rank for ``pending`` (duplicates once), to ranks not down and
        not ``avoid`` (the rank of the late call they are hedged from)."""
        subset = [items[i] for i in pending]
        dtype = gathered.dtype
        keys = [gathered.keys[i] for i in pending] if gathered.keys is not None else None
        exclude = self.health.excluded() | ({avoid} if avoid is not None else set())
        plan = self.dispatcher.plan(subset, dtype, exclude=exclude, keys=keys)
        sent_at = time.time()  # the ranks' queue wait starts here (wall clock: other processes)
        now = self.health.clock()
        flights = []
        for rank, idx in plan.groups.items():
            group = [subset[j] for j in idx]
            block = {j: k for k, j in enumerate(idx)}  # first copy -> its row block
            covers = {
                pending[j]: block[plan.first[j]]
                for j in range(len(pending))
                if plan.owners[j] == rank
            }
            expected = self.dispatcher.expected_s(plan, rank, [i.num_patches for i in group])
            late_after = max(self.slow_after_s, self.slow_factor * (expected or 0.0))
            sink = None
            if gathered.destination is not None:  # each image, and the items it stands for
                copies = [[i for i, k in covers.items() if k == b] for b in range(len(idx))]
                sink = gathered.destination.for_call(copies)
            call = self.ranks[rank].encode(
                [pending[j] for j in idx],
                group,
                sent_at,
                self.dispatcher.caller,
                dtype,
                held=[j in plan.held for j in idx],
                sink=sink,
            )
            flight = _Flight(rank, call, _arrival(call), plan, covers, now, late_after)
            flight.stack.enter_context(self.in_flight({rank: group}))
            self._flying[rank] += 1
            flight.stack.callback(self._landed, rank)
            flight.stack.enter_context(self.dispatcher.dispatched(plan, rank))
            flights.append(flight)
        return flights

    def _landed(self, rank: int) -> None:
        self._flying[rank] -= 1

    def _late_at(self, flight: _Flight) -> float:
        """When ``flight`` counts as late, as its rank's progress stands: while no replica
        has taken it, ``route_late_s`` after it was sent unless its rank showed progress
        within ``slow_after_s`` (then it waits in a busy rank's or a busy ingress's queue,
        not for a replacement); once taken, ``late_after_s`` past the later of its start
        and its rank's last progress."""
        heard = self.health.quiet_from(flight.rank, -math.inf)
        if not _routed(flight):
            return max(flight.sent + self.route_late_s, heard + self.slow_after_s)
        return max(flight.sent, heard) + flight.late_after_s

    async def _next(self, flights: list[_Flight], gathered: Gathered, deadline: float) -> None:
        """Wait for the first call to end or to become late, then act on it.
        ``deadline``: the request's, in ``time.monotonic()`` (lateness is on the
        health's clock)."""
        now = self.health.clock()
        timers = [self._late_at(f) for f in flights if not f.late]
        timers.append(now + deadline - time.monotonic())
        # Every rank excluded, or a late call still unrouted (its rank may fail meanwhile,
        # see ``doomed``): look again soon.
        if self._uncovered(gathered, flights) or any(f.late and not _routed(f) for f in flights):
            timers.append(now + RECHECK_S)
        done, _ = await asyncio.wait(
            [f.task for f in flights],
            timeout=max(0.0, min(timers) - now),
            return_when=asyncio.FIRST_COMPLETED,
        )
        for flight in [f for f in flights if f.task in done]:
            flights.remove(flight)
            flight.stack.close()
            self._land(flight, gathered)
        filled = [f for f in flights if all(gathered.features[i] is not None for i in f.covers)]
        failed = self.health.failed()
        # Still waiting for a replica of a rank that has since failed (late or not: a late
        # call that never routed would otherwise hold a request whose ranks are all gone).
        doomed = [f for f in flights if f.rank in failed and not _routed(f)]
        for flight in {id(f): f for f in filled + doomed}.values():
            # another call answered first (a duplicate now), or its rank is gone
            flights.remove(flight)
            flight.call.cancel()
            flight.stack.close()
        now = self.health.clock()
        for flight in flights:
            if flight.late:
                continue
            if now >= self._late_at(flight):
                self._late(flight, now)
        if time.monotonic() >= deadline and any(f is None for f in gathered.features):
            raise RequestTimeoutError(self.timeout_s)

    def _land(self, flight: _Flight, gathered: Gathered) -> None:
        """A call ended: its features fill what is still missing, or its error counts."""
        error = flight.task.exception()
        if isinstance(error, RankUnavailableError):
            self.health.mark_down(error, flight.sent)
            return
        if error is not None:
            raise error  # an input error or an encoder failure: never retried
        result, arrived_at = flight.task.result()
        rank = flight.rank
        assert result["rank"] == rank, (result["rank"], rank)
        assert len(result["features"]) == len(flight.plan.groups[rank]), (rank, flight.plan)
        assert result["dtype"] == gathered.dtype, (result["dtype"], gathered.dtype)
        self.health.heard(rank)
        self.health.mark_up(rank, getattr(flight.call, "replica", None), flight.sent)
        self.dispatcher.observe(rank, result.get("load"))
        self.dispatcher.record(flight.plan, only={rank})
        gathered.answers[rank] = RankAnswer(rank, result, arrived_at)
        refs = result.get("refs") if self.kept is not None else None
        for index, block in flight.covers.items():
            if gathered.features[index] is None:  # a hedged copy may have answered first
                gathered.features[index] = result["features"][block]
                gathered.owners[index] = rank
            if refs and refs[block] is not None and gathered.keys is not None:
                self.kept.keep(gathered.keys[index], result["features"][block], rank)

    def _late(self, flight: _Flight, now: float) -> None:
        """No replica took it in time, or no answer by the time its load predicts, and no
        progress from its rank meanwhile: the rank is slow, the images go again (to
        another rank, if one is up)."""
        flight.late = True
        if not _routed(flight):
            why = f"no replica took the call in {now - flight.sent:.2f} s"
        else:
            why = f"no answer within {flight.late_after_s:.2f} s, past what its load predicts"
        self.health.mark_down(
            RankUnavailableError(
                flight.rank,
                f"{why}, and no progress from the rank meanwhile",
                replica=getattr(flight.call, "replica", None),
                slow=True,
            ),
            flight.sent,
        )

    def _silent(self, rank: int, error: BaseException) -> None:
        """A rank missed its load report: no new work until it answers. Unavailable if the
        poll failed (the replica died). Otherwise (not routed in time, or quiet) a poll
        waits in a busy rank's or a busy ingress's queue as any call does, so one miss
        says little: while this replica has calls in flight on the rank, their own
        lateness judges it; without, the rank is slow once its polls have gone on
        missing for ``slow_after_s`` with no progress from it in between."""
        if rank in self.health.down():
            return
        if isinstance(error, RankUnavailableError) and not error.slow:
            self.health.mark_down(error, self.health.clock())
            return
        if self._flying[rank]:
            return
        now = self.health.clock()
        first = self._missed[rank]
        if first is None or self.health.quiet_from(rank, -math.inf) > first:
            self._missed[rank] = now  # the first miss since the rank last showed progress
        elif now - first >= self.slow_after_s:
            self._missed[rank] = None  # once back up, its next miss is a first one
            self.health.mark_down(
                RankUnavailableError(
                    rank,
                    f"no load report for {now - first:.2f} s ({error!r})",
                    slow=True,
                ),
                first,
            )


def _routed(flight: _Flight) -> bool:
    return getattr(flight.call, "routed", True)


def _arrival(call: Call) -> asyncio.Task:
    """A task of ``call`` that also notes when its answer arrived (``time.time()``)."""

    async def arrive() -> tuple[Any, float]:
        result = await call
        return result, time.time()

    return asyncio.ensure_future(arrive())
