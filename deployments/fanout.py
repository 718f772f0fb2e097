"""One request's images to their owner ranks and back: fan-out, re-dispatch, hedging,
ordered gather.

Ray-free: every call goes through the ``ranks.Roster`` (its gate, its clock, its book);
what is known of the ranks (which take work, their loads, when a call counts as late) is
the roster's. A
call that fails with ``RankUnavailableError`` (the rank died, is being replaced, its
queue is full, no replica took the call in time) is not the request's doing, so its
images go to the ranks still up, within the same request, until every image has
features or ``ingress.request_timeout_s`` is spent. Any other error (an undecodable
image, an encoder failure) is the answer: it would fail again anywhere.

A call that is late (``Roster.late_at``: not routed in time, or no answer by what its
rank's load predicts, with no progress from the rank meanwhile) makes its rank slow
(no new work), and the call's images are sent again to the other ranks while the late
call goes on. Whichever answer comes first is used; the other call is cancelled. So a
hung rank costs a request one bounded wait, not the request's timeout. A call is never
hedged to its own rank: with no other rank up, the late call keeps its images. A call
still waiting for a replica of a rank that has since failed is dropped, so with every
rank gone requests get 503 at once (``NoRankAvailableError``, with ``Retry-After``)
instead of waiting for the replacements.

With ``kept`` (``KeptFeatures``: the ingress cache, ``ingress.cache_bytes``), images
whose features this replica holds are filled in first, without a rank call, and
every answer's arrays that lie in the object store are held; only the rest are
assigned and sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kimi_encoder.config import VisionConfig
from kimi_encoder.items import EncoderItem

from .dispatch import Dispatcher, Plan
from .ranks.calls import Call, EncodeCall, RankUnavailableError
from .ranks.lifecycle import ENCODE
from .ranks.records import RankReply
from .ranks.roster import Roster
from .sinks import Destination
from .timing import RECHECK_S

log = logging.getLogger("ray.serve")


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
    reply: RankReply
    arrived_at: float

    @property
    def transfer_ms(self) -> float:
        return max(0.0, self.arrived_at - self.reply.done_at) * 1e3


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
    sent: float  # on the roster's clock
    late_after_s: float
    late: bool = False
    stack: ExitStack = field(default_factory=ExitStack)


class FanOut:
    """Sends a request's items to their owners, re-dispatches, hedges, gathers in order."""

    def __init__(
        self,
        roster: Roster,
        dispatcher: Dispatcher,
        *,
        vision: VisionConfig,
        timeout_s: float,
        in_flight: InFlight | None = None,
        kept: KeptFeatures | None = None,
    ):
        self.roster = roster
        self.dispatcher = dispatcher
        self.vision = vision
        self.timeout_s = timeout_s
        self.in_flight = in_flight or (lambda _: nullcontext())
        self.kept = kept

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
            await self.roster.refresh()
        flights: list[_Flight] = []
        rounds = 0  # every image is sent in the first; one uncovered later was sent before
        try:
            while any(f is None for f in gathered.features):
                uncovered = self._uncovered(gathered, flights)
                if uncovered and len(self.roster.excluded()) < len(self.roster):
                    flights += self._dispatch(uncovered, items, gathered, again=rounds > 0)
                    rounds += 1
                elif uncovered and not flights:
                    raise NoRankAvailableError(self.roster.retry_after_s())
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
        up = self.roster.up()
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
                self.roster.redispatched += len(pending)
                gathered.redispatched += len(pending)
                if avoid is not None:  # hedged: its late call goes on
                    self.roster.hedged += len(pending)
            flights += self._send(pending, items, gathered, avoid)
        return flights

    def _send(
        self,
        pending: list[int],
        items: Sequence[EncoderItem],
        gathered: Gathered,
        avoid: int | None = None,
    ) -> list[_Flight]:
        """One call per owner rank for ``pending`` (duplicates once), to ranks taking work,
        not ``avoid`` (the rank of the late call they are hedged from)."""
        subset = [items[i] for i in pending]
        dtype = gathered.dtype
        keys = [gathered.keys[i] for i in pending] if gathered.keys is not None else None
        exclude = self.roster.excluded() | ({avoid} if avoid is not None else set())
        plan = self.dispatcher.plan(subset, dtype, exclude=exclude, keys=keys)
        sent_at = time.time()  # the ranks' queue wait starts here (wall clock: other processes)
        flights = []
        for rank, idx in plan.groups.items():
            group = [subset[j] for j in idx]
            block = {j: k for k, j in enumerate(idx)}  # first copy -> its row block
            covers = {
                pending[j]: block[plan.first[j]]
                for j in range(len(pending))
                if plan.owners[j] == rank
            }
            expected = self.dispatcher.expected_s(rank, [i.num_patches for i in group])
            sink = None
            if gathered.destination is not None:  # each image, and the items it stands for
                copies = [[i for i, k in covers.items() if k == b] for b in range(len(idx))]
                sink = gathered.destination.for_call(copies)
            record = EncodeCall(
                indices=[pending[j] for j in idx],
                items=group,
                feature_dtype=dtype,
                sent_at=sent_at,
                caller=self.roster.caller,
                held=[j in plan.held for j in idx],
                sink=sink,
            )
            call, sent = self.roster.call(rank, ENCODE, record)
            late_after = self.roster.late_after_s(expected)
            flight = _Flight(rank, call, _arrival(call), plan, covers, sent, late_after)
            flight.stack.enter_context(self.in_flight({rank: group}))
            flight.stack.enter_context(self.dispatcher.dispatched(plan, rank))
            flights.append(flight)
        return flights

    async def _next(self, flights: list[_Flight], gathered: Gathered, deadline: float) -> None:
        """Wait for the first call to end or to become late, then act on it.
        ``deadline``: the request's, in ``time.monotonic()`` (lateness is on the
        roster's clock)."""
        roster = self.roster
        now = roster.clock()
        timers = [_late_at(roster, f) for f in flights if not f.late]
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
        failed = roster.failed()
        # Still waiting for a replica of a rank that has since failed (late or not: a late
        # call that never routed would otherwise hold a request whose ranks are all gone).
        doomed = [f for f in flights if f.rank in failed and not _routed(f)]
        for flight in {id(f): f for f in filled + doomed}.values():
            # another call answered first (a duplicate now), or its rank is gone
            flights.remove(flight)
            flight.call.cancel()
            flight.stack.close()
        now = roster.clock()
        for flight in flights:
            if not flight.late and now >= _late_at(roster, flight):
                flight.late = True
                replica = getattr(flight.call, "replica", None)
                roster.late(flight.rank, replica, flight.sent, _routed(flight), flight.late_after_s)
        if time.monotonic() >= deadline and any(f is None for f in gathered.features):
            raise RequestTimeoutError(self.timeout_s)

    def _land(self, flight: _Flight, gathered: Gathered) -> None:
        """A call ended: its features fill what is still missing, or its error counts."""
        error = flight.task.exception()
        rank, replica = flight.rank, getattr(flight.call, "replica", None)
        if isinstance(error, RankUnavailableError):
            self.roster.book(rank, ENCODE, flight.sent, error, replica)
            return
        if error is not None:
            raise error  # an input error or an encoder failure: never retried
        reply, arrived_at = flight.task.result()
        assert reply.rank == rank, (reply.rank, rank)
        assert len(reply.features) == len(flight.plan.groups[rank]), (rank, flight.plan)
        assert reply.dtype == gathered.dtype, (reply.dtype, gathered.dtype)
        self.roster.book(rank, ENCODE, flight.sent, reply, replica)
        self.dispatcher.record(flight.plan, only={rank})
        gathered.answers[rank] = RankAnswer(rank, reply, arrived_at)
        refs = reply.refs if self.kept is not None else None
        for index, block in flight.covers.items():
            if gathered.features[index] is None:  # a hedged copy may have answered first
                gathered.features[index] = reply.features[block]
                gathered.owners[index] = rank
            if refs and refs[block] is not None and gathered.keys is not None:
                self.kept.keep(gathered.keys[index], reply.features[block], rank)


def _late_at(roster: Roster, flight: _Flight) -> float:
    return roster.late_at(flight.rank, flight.sent, _routed(flight), flight.late_after_s)


def _routed(flight: _Flight) -> bool:
    return getattr(flight.call, "routed", True)


def _arrival(call: Call) -> asyncio.Task:
    """A task of ``call`` that also notes when its answer arrived (``time.time()``)."""

    async def arrive() -> tuple[Any, float]:
        result = await call
        return result, time.time()

    return asyncio.ensure_future(arrive())
