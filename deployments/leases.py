"""Memory leases of one encoder rank: a byte budget for the pixels and features it holds.

Every image a rank accepts takes a lease of ``item_bytes`` (its input bytes,
its float32 pixel values and its float32 features) before it is queued for
decode and forward, and gives it back when the call ends: on success, on an
error, and when the call is cancelled (the ingress's timeout, a client that
went away). While the leases held would exceed ``max_inflight_bytes`` a call
waits, first come first served, so a rank never holds more than its budget of
pixels and features, however many calls are queued at it. An image larger
than the whole budget is admitted alone (when nothing else is held), so it is
served, slowly, rather than refused.

    >>> import asyncio
    >>> leases = MemoryLeases(100)
    >>> async def demo():
    ...     async with leases.hold(60):
    ...         held = leases.held
    ...     return held, leases.held
    >>> asyncio.run(demo())
    (60, 0)
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from kimi_encoder.config import VisionConfig
from kimi_encoder.items import EncoderItem

FLOAT32 = 4


def items_bytes(items: Sequence[EncoderItem], vision: VisionConfig) -> int:
    """Sum of ``item_bytes``: a call takes one lease for all its images."""
    return sum(item_bytes(item, vision) for item in items)


def item_bytes(item: EncoderItem, vision: VisionConfig) -> int:
    """Bytes a rank holds for ``item``: its input, its float32 pixels and its features."""
    given = len(item.image) if item.image is not None else 0
    if item.pixel_values is not None:
        given += item.pixel_values.numel() * item.pixel_values.element_size()
    pixels = item.num_patches * 3 * vision.patch_size**2 * FLOAT32  # (3, p, p) per patch
    features = vision.num_tokens(item.grid) * vision.text_hidden_size * FLOAT32
    return given + pixels + features


@dataclass
class LeaseStats:
    held: int = 0  # bytes leased now
    peak: int = 0  # most bytes leased at once
    granted: int = 0  # leases given
    released: int = 0  # leases given back (== granted when idle)
    waited: int = 0  # leases that had to wait for room
    oversized: int = 0  # leases larger than the budget (admitted alone)


class MemoryLeases:
    """A byte budget shared by one rank's calls (one event loop)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be >= 1, got {max_bytes}.")
        self.max_bytes = max_bytes
        self.stats = LeaseStats()
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def held(self) -> int:
        return self.stats.held

    def _fits(self, nbytes: int) -> bool:
        return self.stats.held + nbytes <= self.max_bytes or self.stats.held == 0

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` for the body of the ``async with``; always given back."""
        await self._acquire(nbytes)
        try:
            yield
        finally:
            self._release(nbytes)

    async def _acquire(self, nbytes: int) -> None:
        if not self._waiters and self._fits(nbytes):
            self._grant(nbytes)
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((nbytes, future))
        self.stats.waited += 1
        try:
            await future  # granted by _wake, which has already counted the bytes
        except BaseException:
            if future.done() and not future.cancelled():
                self._release(nbytes)  # granted and cancelled in the same step: give it back
            else:
                if (nbytes, future) in self._waiters:
                    self._waiters.remove((nbytes, future))
                self._wake()  # a smaller waiter behind us may fit now
            raise

    def _grant(self, nbytes: int) -> None:
        s = self.stats
        s.held += nbytes
        s.granted += 1
        s.peak = max(s.peak, s.held)
        s.oversized += nbytes > self.max_bytes

    def _release(self, nbytes: int) -> None:
        self.stats.held -= nbytes
        self.stats.released += 1
        assert self.stats.held >= 0, self.stats
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            nbytes, future = self._waiters[0]
            if future.done():  # cancelled, its task not yet resumed
                self._waiters.popleft()
                continue
            if not self._fits(nbytes):
                return
            self._waiters.popleft()
            self._grant(nbytes)
            future.set_result(None)

    def info(self) -> dict:
        return {
            "max_inflight_bytes": self.max_bytes,
            "inflight_bytes": self.stats.held,
            "peak_inflight_bytes": self.stats.peak,
            "leases_granted": self.stats.granted,
            "leases_released": self.stats.released,
            "leases_waited": self.stats.waited,
            "leases_oversized": self.stats.oversized,
            "leases_waiting": len(self._waiters),
        }
