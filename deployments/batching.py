"""What a rank's batcher keeps and measures (``batcher.RankBatcher``): the entries of its
queue, its counters and each caller's outstanding work, the timing of a batch's stages,
and the copy of features to the host."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kimi_encoder.items import EncoderInputError, EncoderItem
from kimi_encoder.load import Work


class _NotCached:
    """An image sent by digest whose features this rank's cache no longer holds: the
    caller sends it again with its bytes."""

    def __repr__(self) -> str:
        return "NOT_CACHED"


NOT_CACHED = _NotCached()


@dataclass
class Timing:
    """Milliseconds of one batch's stages, shared by the calls that had images in it."""

    batch: int
    started: float  # perf_counter when the drain took the batch
    host_ms: float = 0.0  # longest preparation (decode, preprocessing) of its images
    device_ms: float = 0.0  # handing the prepared pixels to the forward
    forward_ms: float = 0.0  # tower + projector, cast to the feature dtypes
    copy_ms: float = 0.0  # features to the host (overlaps the next batch's forward)


@dataclass
class Queued:
    item: EncoderItem
    key: str | None
    dtype: str  # feature dtype the features are delivered in
    caller: str
    call: int  # which encode call queued it
    future: asyncio.Future
    arrived: float
    host: Future  # its preparation on the decode pool
    waiters: int = 1  # calls awaiting it (a duplicate in flight joins)
    timing: Timing | None = None  # set when a batch takes it
    forwarding: bool = False  # set when its batch's forward starts: past taking back


@dataclass
class BatchCounters:
    calls: int = 0  # encode calls this rank took
    answered: int = 0  # ... of which it has answered (the progress its load report shows)
    items: int = 0  # images in them
    patches: int = 0  # sum of t*h*w over those images
    cache_hits: int = 0
    by_digest: int = 0  # images sent without their bytes (the ingress expected a hit)
    not_cached: int = 0  # ... of which this rank no longer held the features
    joined_in_flight: int = 0  # same image already queued or running for another call
    preprocessed: int = 0  # images decoded and preprocessed (misses only)
    forwarded: int = 0  # images through the tower
    dropped: int = 0  # queued images taken back because every call waiting went away
    batches: int = 0
    max_batch_images: int = 0
    max_batch_calls: int = 0  # most distinct encode calls in one forward
    forward_s: float = 0.0
    # The forward thread's wall time minus its CPU time over the forwards (one span with
    # forward_s): time it did not run, waiting for the GIL or a core (on a GPU, also
    # blocked in a CUDA call that sleeps rather than spins).
    forward_wait_s: float = 0.0
    # Seconds summed over the images forwarded (queue: arrival to its batch's start; host:
    # its decode and preprocessing on the decode pool) and over batches (device: pixels
    # handed to the forward; copy: features to the host; store: ``keep``, into the cache).
    queue_s: float = 0.0
    host_s: float = 0.0
    device_s: float = 0.0
    copy_s: float = 0.0
    store_s: float = 0.0


@dataclass
class Outstanding:
    by_caller: dict[str, Work] = field(default_factory=dict)

    def add(self, caller: str, work: Work) -> None:
        self.by_caller[caller] = self.by_caller.get(caller, Work()) + work

    def remove(self, caller: str, work: Work) -> None:
        left = self.by_caller[caller] - work
        if left.images:
            self.by_caller[caller] = left
        else:
            del self.by_caller[caller]

    def total(self) -> Work:
        return sum(self.by_caller.values(), start=Work())


class StageClock:
    """Milliseconds between marks: CUDA events on a GPU (no global synchronize; the
    copies to the host wait for the forward anyway), wall time on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans_ms(self) -> list[float]:
        pairs = zip(self.marks, self.marks[1:], strict=False)
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]


def timed(fn: Callable, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    return fn(*args), (time.perf_counter() - started) * 1e3


def to_host(result: Any) -> Any:
    """An image's features (already in their dtype) in a host buffer of their own."""
    if not isinstance(result, torch.Tensor):
        return result  # its error
    out = torch.empty(result.shape, dtype=result.dtype, device="cpu")
    out.copy_(result)
    return out


def call_stages(queued: list[Queued]) -> dict[str, float]:
    """One call's stages from the batches its images were in (each batch counted once)."""
    timings = {q.timing.batch: (q, q.timing) for q in queued}.values()
    return {
        "queue_wait": max(((t.started - q.arrived) * 1e3 for q, t in timings), default=0.0),
        "preprocess": sum(t.host_ms + t.device_ms for _, t in timings),
        "forward": sum(t.forward_ms + t.copy_ms for _, t in timings),
    }


def raise_first_error(results: list, indices: Sequence[int]) -> list:
    """The results, or the first item's error named by its request index."""
    for index, result in zip(indices, results, strict=True):
        if isinstance(result, EncoderInputError):
            # type(result): a LimitExceededError stays one (413), with the culprit named.
            raise type(result)(str(result), index) from None
        if isinstance(result, BaseException):
            raise result
    return results
