"""One request's images to their owner ranks and back: fan-out, re-dispatch, ordered gather.

Ray-free: a rank is a ``RankClient`` (``deployments/handles.py`` wraps a Serve
deployment handle; tests use plain objects). Its calls are awaitables with
``cancel()``; a call that fails with ``RankUnavailableError`` (the rank died, is
being replaced, its queue is full) is not the request's fault, so its images go
to the ranks still up, within the same request, until every image has features
or ``request_timeout_s`` is spent. Any other error (an undecodable image, an
encoder failure) is the answer: it would fail again anywhere.

``RankHealth`` is this ingress replica's view of which ranks take work: a rank
that answered unavailable gets none for ``cooldown_s``; then a background probe
(the rank's cheap ``load`` call) brings it back as soon as it answers. With no
rank up the request is answered at once with ``NoRankAvailableError`` (503 with
``Retry-After``), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kimi_encoder.config import VisionConfig
from kimi_encoder.items import EncoderItem

from .dispatch import Dispatcher, Plan

log = logging.getLogger("ray.serve")

PROBE_TIMEOUT_S = 5.0  # a replacement rank may still be loading its model


class RankUnavailableError(Exception):
    """A rank call failed for a reason that is not the request's; retry on another rank."""

    def __init__(self, rank: int, cause: BaseException | str):
        self.rank = rank
        self.cause = cause
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
    """The ranks did not answer within ``request_timeout_s`` (HTTP 504)."""

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
    ) -> Call: ...

    def load(self) -> Call: ...


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
    """Every item's features in request order (views of the ranks' arrays, in ``dtype``'s
    storage, see ``kimi_encoder.features``), who encoded it, and each rank's answer."""

    features: list[np.ndarray]
    owners: list[int]
    dtype: str
    answers: dict[int, RankAnswer] = field(default_factory=dict)
    redispatched: int = 0


class RankHealth:
    """Which ranks take work, as this ingress replica has seen them answer."""

    def __init__(self, ranks: Sequence[RankClient], cooldown_s: float):
        self.ranks = ranks
        self.cooldown_s = cooldown_s
        self._down_until: list[float | None] = [None] * len(ranks)  # None: up
        self._probes: list[asyncio.Task | None] = [None] * len(ranks)
        self.failures = [0] * len(ranks)  # unavailable errors seen per rank
        self.recoveries = [0] * len(ranks)  # times a probe found a rank back
        self.redispatched = 0  # images sent again to another rank

    def down(self) -> set[int]:
        return {r for r, until in enumerate(self._down_until) if until is not None}

    def mark_down(self, error: RankUnavailableError) -> None:
        rank = error.rank
        self.failures[rank] += 1
        self._down_until[rank] = time.monotonic() + self.cooldown_s
        log.warning("%s; its images go to the other ranks until it answers", error)
        if self._probes[rank] is None or self._probes[rank].done():
            self._probes[rank] = asyncio.get_running_loop().create_task(self._recover(rank))

    def mark_up(self, rank: int) -> None:
        self._down_until[rank] = None

    async def _recover(self, rank: int) -> None:
        while (until := self._down_until[rank]) is not None:
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            call = self.ranks[rank].load()
            try:
                await asyncio.wait_for(call, PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - still down: another cool-down
                call.cancel()
                if self._down_until[rank] is not None:
                    self._down_until[rank] = time.monotonic() + self.cooldown_s
                continue
            if self._down_until[rank] is not None:
                self.recoveries[rank] += 1
                log.info("rank %d answers again; it takes work", rank)
            self.mark_up(rank)

    def retry_after_s(self) -> int:
        """Whole seconds until the first rank is probed again (at least 1)."""
        pending = [u for u in self._down_until if u is not None]
        soonest = min(pending, default=0.0) - time.monotonic()
        return max(1, math.ceil(soonest))

    def info(self) -> dict[str, Any]:
        return {
            "ranks_up": sorted(set(range(len(self.ranks))) - self.down()),
            "unavailable_errors": list(self.failures),
            "recoveries": list(self.recoveries),
            "redispatched_images": self.redispatched,
            "cooldown_s": self.cooldown_s,
        }


# Called with {rank: item indices} of a round; returns a context that spans the round.
InFlight = Callable[[dict[int, list[EncoderItem]]], AbstractContextManager]


class FanOut:
    """Sends a request's items to their owners, re-dispatches, gathers in request order."""

    def __init__(
        self,
        ranks: Sequence[RankClient],
        dispatcher: Dispatcher,
        health: RankHealth,
        *,
        vision: VisionConfig,
        timeout_s: float,
        in_flight: InFlight | None = None,
    ):
        self.ranks = ranks
        self.dispatcher = dispatcher
        self.health = health
        self.vision = vision
        self.timeout_s = timeout_s
        self.in_flight = in_flight or (lambda _: nullcontext())

    async def run(self, items: Sequence[EncoderItem], feature_dtype: str) -> Gathered:
        """Features of every item, in order; raises the first non-retryable error."""
        deadline = time.monotonic() + self.timeout_s
        gathered = Gathered([None] * len(items), [-1] * len(items), feature_dtype)  # type: ignore[list-item]
        pending = list(range(len(items)))  # request indices still without features
        await self.dispatcher.refresh(self.ranks, skip=self.health.down())
        while pending:
            if len(down := self.health.down()) == len(self.ranks):
                raise NoRankAvailableError(self.health.retry_after_s())
            left = await self._round(pending, items, down, deadline, gathered)
            self.health.redispatched += len(left)
            gathered.redispatched += len(left)
            pending = left
        for i, (item, array) in enumerate(zip(items, gathered.features, strict=True)):
            expected = (self.vision.num_tokens(item.grid), self.vision.text_hidden_size)
            if tuple(array.shape) != expected:
                raise RuntimeError(
                    f"item {i}: rank {gathered.owners[i]} returned {tuple(array.shape)}, its "
                    f"grid needs {expected}"
                )
        return gathered

    async def _round(
        self,
        pending: list[int],
        items: Sequence[EncoderItem],
        down: set[int],
        deadline: float,
        gathered: Gathered,
    ) -> list[int]:
        """Send ``pending`` to the ranks not ``down``; fill ``gathered``; what is left."""
        subset = [items[i] for i in pending]
        dtype = gathered.dtype
        plan = self.dispatcher.plan(subset, dtype, exclude=down)  # duplicates once; costs, loads
        sent_at = time.time()  # the ranks' queue wait starts here (wall clock: other processes)
        caller = self.dispatcher.caller
        calls = {
            rank: self.ranks[rank].encode(
                [pending[j] for j in idx], [subset[j] for j in idx], sent_at, caller, dtype
            )
            for rank, idx in plan.groups.items()
        }
        groups = {rank: [subset[j] for j in idx] for rank, idx in plan.groups.items()}
        with self.in_flight(groups), self.dispatcher.dispatched(plan):
            outcomes = await settle_within(list(calls.values()), deadline, self.timeout_s)
        answers = self._take(plan, dict(zip(calls, outcomes, strict=True)), gathered)
        gathered.answers.update(answers)
        # Each encoded copy's rows in its rank's array; a duplicate shares its copy's.
        rows: dict[int, np.ndarray] = {}
        for rank, answer in answers.items():
            ends = np.cumsum(answer.result["rows"])
            for i, start, end in zip(
                plan.groups[rank], ends - answer.result["rows"], ends, strict=True
            ):
                rows[i] = answer.result["features"][start:end]
        left = []
        for j, request_index in enumerate(pending):
            owner = plan.owners[j]
            if owner not in answers:
                left.append(request_index)
                continue
            gathered.features[request_index] = rows[plan.first[j]]
            gathered.owners[request_index] = owner
        return left

    def _take(
        self, plan: Plan, outcomes: dict[int, Any], gathered: Gathered
    ) -> dict[int, RankAnswer]:
        """The ranks that answered; marks unavailable ones down; raises any other error."""
        answers: dict[int, RankAnswer] = {}
        error: BaseException | None = None
        for rank, outcome in outcomes.items():
            if isinstance(outcome, RankUnavailableError):
                self.health.mark_down(outcome)
            elif isinstance(outcome, BaseException):
                error = error or outcome
            else:
                result, arrived_at = outcome
                self.health.mark_up(rank)
                assert result["rank"] == rank, (result["rank"], rank)
                assert len(result["rows"]) == len(plan.groups[rank]), (rank, plan.groups)
                assert result["dtype"] == gathered.dtype, (result["dtype"], gathered.dtype)
                self.dispatcher.observe(rank, result.get("load"))
                answers[rank] = RankAnswer(rank, result, arrived_at)
        if error is not None:
            raise error  # an input error or an encoder failure: never retried
        self.dispatcher.record(plan, only=set(answers))
        return answers


async def settle_within(calls: Sequence[Call], deadline: float, timeout_s: float) -> list[Any]:
    """Each call's ``(result, arrival time)`` or exception, in order, before ``deadline``
    (``time.monotonic()``; ``timeout_s`` names the limit in the error).

    One failed call does not cancel the others (its images go elsewhere). On timeout,
    and when the request itself is cancelled (the client went away), every call is
    cancelled: an awaited-then-abandoned call would keep running and hold its rank's
    queue slot.
    """

    async def arrival(call: Call) -> tuple[Any, float]:
        result = await call
        return result, time.time()

    try:
        return await asyncio.wait_for(
            asyncio.gather(*(arrival(c) for c in calls), return_exceptions=True),
            max(deadline - time.monotonic(), 0.0),
        )
    except asyncio.TimeoutError:
        _cancel_all(calls)
        raise RequestTimeoutError(timeout_s) from None
    except BaseException:
        _cancel_all(calls)
        raise


def _cancel_all(calls: Sequence[Call]) -> None:
    for call in calls:
        call.cancel()
