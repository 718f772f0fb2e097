"""Rank failures at the ingress: which errors mean "send it elsewhere", and which ranks are up.

A rank call that fails with an *unavailable* error (the rank's actor died or is
unreachable, its queue is full, its deployment has no replica yet) is not the
request's fault: the ingress marks that rank down for ``cooldown_s`` and sends
the rank's images to the ranks still up, until every image has features or
``request_timeout_s`` is spent. With no rank up the request is answered at
once with 503 and ``Retry-After`` (never a hang). After the cool-down a rank is
tried again: a replacement that answers is up, a rank that fails again goes
down for another cool-down (the probe is the rank's cheap ``load`` method,
run in the background, so requests never wait on it). Input errors (4xx) and
encoder failures (500) are never retried: they would fail again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)

log = logging.getLogger("ray.serve")

PROBE_TIMEOUT_S = 5.0  # a replacement rank may still be loading its model

# ActorDiedError and ActorUnavailableError are RayActorErrors.
UNAVAILABLE = (
    RayActorError,
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (as raised by awaiting a rank call) means "retry on another rank"."""
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    return isinstance(cause, UNAVAILABLE)


class NoRankAvailableError(RuntimeError):
    """Every rank is down or busy (HTTP 503 with ``Retry-After``)."""

    def __init__(self, retry_after_s: int, last_error: BaseException | None = None):
        self.retry_after_s = retry_after_s
        why = f" (last: {type(last_error).__name__})" if last_error is not None else ""
        super().__init__(
            f"no encoder rank is available{why}: they are being replaced or their queues are "
            f"full; retry after {retry_after_s} s."
        )


class RankHealth:
    """The ingress's view of which ranks take work (this ingress replica only).

    A rank marked down gets no work until a background probe (its cheap ``load``
    method) answers within ``PROBE_TIMEOUT_S``; the first probe waits out the
    cool-down, and a failed probe starts another cool-down.
    """

    def __init__(self, ranks: Sequence[Any], cooldown_s: float):
        self.ranks = ranks
        self.cooldown_s = cooldown_s
        self._down_until: list[float | None] = [None] * len(ranks)  # None: up
        self._probes: list[asyncio.Task | None] = [None] * len(ranks)
        self.failures = [0] * len(ranks)  # unavailable errors seen per rank
        self.recoveries = [0] * len(ranks)  # times a probe found a rank back
        self.redispatched = 0  # images sent again to another rank

    def down(self) -> set[int]:
        return {r for r, until in enumerate(self._down_until) if until is not None}

    def mark_down(self, rank: int, exc: BaseException) -> None:
        self.failures[rank] += 1
        self._down_until[rank] = time.monotonic() + self.cooldown_s
        log.warning(
            "rank %d unavailable (%s: %s); its images go to the other ranks until it answers",
            rank,
            type(exc).__name__,
            (str(exc).splitlines() or [""])[0][:200],
        )
        if self._probes[rank] is None or self._probes[rank].done():
            self._probes[rank] = asyncio.get_running_loop().create_task(self._recover(rank))

    def mark_up(self, rank: int) -> None:
        self._down_until[rank] = None

    async def _recover(self, rank: int) -> None:
        while (until := self._down_until[rank]) is not None:
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            response = self.ranks[rank].load.remote()
            try:
                await asyncio.wait_for(_awaited(response), PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - still down: another cool-down
                response.cancel()
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


async def _awaited(response: Any) -> Any:
    return await response
