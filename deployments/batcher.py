"""Cross-request batching, feature cache and load report of one encoder rank.

Mechanism: an asyncio queue drained by one worker thread, not ``@serve.batch``.
``@serve.batch`` batches *calls*, and caps a batch at the replica's
``max_ongoing_requests``; here one call carries several images and the budget
is in patches (``max_batch_patches``), so the rank queues *images*: every
``encode`` call puts its cache misses on the queue and awaits their futures. A
single drain task takes images first in, first out, up to the patch budget
(at least one image), waiting at most ``max_batch_wait_ms`` after the oldest
queued image arrived for more to join, and runs decode, preprocessing and one
varlen forward on a one-thread executor, so the event loop keeps answering
load reports and cache hits while the model runs. Items that arrive while a
forward runs join the next batch without waiting.

Cache: keys are ``kimi_encoder.cache.item_key`` with the weights' SHA-256
fingerprint and the dtype; a hit skips decode, preprocessing and forward. An
image already queued or running for another call is awaited, not encoded again.

Load: the rank counts what each caller has queued or running as
``kimi_encoder.load.Work`` (image count, sum of patches, sum of squares).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from kimi_encoder.cache import FeatureCache, item_key, weights_fingerprint
from kimi_encoder.cost import CostModel, calibrate
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.items import EncoderInputError, EncoderItem
from kimi_encoder.load import Work


@dataclass(frozen=True)
class BatchingConfig:
    """What a rank needs beyond its model; AppArgs.batching_config() builds it."""

    max_batch_patches: int = 16384
    max_batch_wait_ms: float = 2.0
    cache_bytes: int = 256 << 20
    calibration_grids: tuple[int, ...] = (8, 16, 32)


@dataclass
class _Queued:
    item: EncoderItem
    key: str | None
    caller: str
    call: int  # which encode call queued it
    future: asyncio.Future
    arrived: float
    batch: tuple[int, float, float, float] | None = None  # (id, started, preprocess, forward)


@dataclass
class BatchCounters:
    calls: int = 0  # encode calls this rank took
    items: int = 0  # images in them
    patches: int = 0  # sum of t*h*w over those images
    cache_hits: int = 0
    joined_in_flight: int = 0  # same image already queued or running for another call
    preprocessed: int = 0  # images decoded and preprocessed (misses only)
    forwarded: int = 0  # images through the tower
    batches: int = 0
    max_batch_images: int = 0
    max_batch_calls: int = 0  # most distinct encode calls in one forward
    forward_s: float = 0.0


@dataclass
class _Outstanding:
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


class RankBatcher:
    """One rank's image queue, drain worker, feature cache and load report."""

    def __init__(self, encoder: VisionEncoder, config: BatchingConfig, num_threads: int):
        if config.max_batch_patches < 1 or config.max_batch_wait_ms < 0:
            raise ValueError(
                f"max_batch_patches must be >= 1 and max_batch_wait_ms >= 0, got "
                f"{config.max_batch_patches} and {config.max_batch_wait_ms}."
            )
        self.encoder = encoder
        self.config = config
        # One worker thread runs every forward; torch's thread count is per thread
        # (OpenMP), so it is set inside that thread, not only in the constructor's.
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="encode", initializer=torch.set_num_threads,
            initargs=(num_threads,),
        )  # fmt: skip
        self.worker_threads = self._executor.submit(torch.get_num_threads).result()
        self.cache = FeatureCache(config.cache_bytes)
        self.fingerprint = weights_fingerprint(encoder.model)
        self.dtype = str(encoder.dtype).removeprefix("torch.")
        self.cost_model, self.calibration = self._calibrate(config.calibration_grids)
        self.counters = BatchCounters()
        self._outstanding = _Outstanding()
        self._queue: deque[_Queued] = deque()
        self._in_flight: dict[str, asyncio.Future] = {}
        self._arrived: asyncio.Event | None = None
        self._drain: asyncio.Task | None = None

    def _calibrate(self, grids: Sequence[int]) -> tuple[CostModel, dict]:
        """Fit a*p^2 + b*p + c on this rank, in the worker thread (its thread count)."""
        if not grids:
            return CostModel.patches(), {"grids": [], "fit_s": 0.0}
        started = time.perf_counter()
        model = self._executor.submit(calibrate, self.encoder.time_forward, grids).result()
        return model, {"grids": list(grids), "fit_s": round(time.perf_counter() - started, 3)}

    async def encode(
        self, items: Sequence[EncoderItem], caller: str
    ) -> tuple[list, dict[str, float]]:
        """Features of ``items`` in order (float32 contiguous arrays, or an item's exception),
        and this call's stage milliseconds: queue_wait, preprocess, forward (of its batches)."""
        self._start()
        self.counters.calls += 1
        call = self.counters.calls
        self.counters.items += len(items)
        self.counters.patches += sum(item.num_patches for item in items)
        futures: list[asyncio.Future] = []
        mine: list[_Queued] = []
        loop = asyncio.get_running_loop()
        for item in items:
            key = item_key(item, self.fingerprint, self.dtype) if self.cache.max_bytes else None
            hit = self.cache.get(key) if key is not None else None
            if hit is not None:
                self.counters.cache_hits += 1
                done = loop.create_future()
                done.set_result(hit)
                futures.append(done)
            elif key is not None and key in self._in_flight:
                self.counters.joined_in_flight += 1
                futures.append(self._in_flight[key])
            else:
                queued = _Queued(item, key, caller, call, loop.create_future(), time.perf_counter())
                if key is not None:
                    self._in_flight[key] = queued.future
                mine.append(queued)
                futures.append(queued.future)
        if mine:
            self._outstanding.add(caller, Work.of(q.item.num_patches for q in mine))
            self._queue.extend(mine)
            self._arrived.set()
        shielded = (asyncio.shield(f) for f in futures)  # a cancelled call leaves shared work
        results = list(await asyncio.gather(*shielded, return_exceptions=True))
        batches = {q.batch[0]: q for q in mine if q.batch is not None}
        stages = {
            "queue_wait": max(
                ((q.batch[1] - q.arrived) * 1e3 for q in batches.values()), default=0
            ),
            "preprocess": sum(q.batch[2] for q in batches.values()),
            "forward": sum(q.batch[3] for q in batches.values()),
        }
        return results, stages

    async def run_in_worker(self, fn, *args):
        """``fn(*args)`` on the encode worker thread, after the batch in progress."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def run_in_worker_sync(self, fn, *args):
        """``run_in_worker`` from outside an event loop (the rank's constructor)."""
        return self._executor.submit(fn, *args).result()

    def load(self) -> dict:
        """Cheap report: each caller's queued or running work, and this rank's cost model."""
        return {
            "by_caller": {c: w.as_list() for c, w in self._outstanding.by_caller.items()},
            "cost_model": asdict(self.cost_model),
        }

    def info(self) -> dict:
        total = self._outstanding.total()
        return {
            "num_threads": self.worker_threads,
            "cost_model": {**asdict(self.cost_model), **self.calibration},
            "batching": {
                "max_batch_patches": self.config.max_batch_patches,
                "max_batch_wait_ms": self.config.max_batch_wait_ms,
            },
            "outstanding": {"images": total.images, "patches": total.patches},
            "cache": {"max_bytes": self.cache.max_bytes, **asdict(self.cache.stats)},
            **{
                k: round(v, 3) if isinstance(v, float) else v
                for k, v in asdict(self.counters).items()
            },
        }

    def _start(self) -> None:
        if self._drain is None or self._drain.done():
            self._arrived = asyncio.Event()
            self._drain = asyncio.get_running_loop().create_task(self._drain_forever())

    async def _drain_forever(self) -> None:
        assert self._arrived is not None
        while True:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            await self._fill_window()
            batch = self._take()
            started = time.perf_counter()
            loop = asyncio.get_running_loop()
            try:
                results, preprocess_ms, forward_ms = await loop.run_in_executor(
                    self._executor, self._encode_batch, [q.item for q in batch]
                )
            except Exception as exc:  # noqa: BLE001 - the whole batch failed (e.g. out of memory)
                results, preprocess_ms, forward_ms = [exc] * len(batch), 0.0, 0.0
            for q in batch:
                q.batch = (self.counters.batches, started, preprocess_ms, forward_ms)
            self._finish(batch, results)

    async def _fill_window(self) -> None:
        """Wait for more images until the budget is met or the oldest has waited long enough."""
        assert self._arrived is not None
        deadline = self._queue[0].arrived + self.config.max_batch_wait_ms / 1e3
        while sum(q.item.num_patches for q in self._queue) < self.config.max_batch_patches:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[_Queued]:
        batch = [self._queue.popleft()]
        patches = batch[0].item.num_patches
        while self._queue and patches + self._queue[0].item.num_patches <= (
            self.config.max_batch_patches
        ):
            batch.append(self._queue.popleft())
            patches += batch[-1].item.num_patches
        return batch

    def _encode_batch(self, items: list[EncoderItem]) -> tuple[list, float, float]:
        """Worker thread: materialize each image (its own error), one forward for the rest.

        Returns the results and the preprocess and forward milliseconds."""
        started = time.perf_counter()
        results: list = [None] * len(items)
        good, pixels = [], []
        for i, item in enumerate(items):
            try:
                pixels.append(self.encoder.materialize([item])[0])
                good.append(i)
            except Exception as exc:  # noqa: BLE001 - one bad image fails only its own call
                results[i] = exc
        self.counters.preprocessed += len(items)
        self._synchronize()
        materialized = time.perf_counter()
        if good:
            with torch.inference_mode():
                features = self.encoder.forward(pixels, [items[i] for i in good])
            for i, f in zip(good, features, strict=True):
                # float() copies a bf16/fp16 slice; a float32 slice is a view of the batch output
                results[i] = np.ascontiguousarray(f.detach().to("cpu").float().numpy())
        done = time.perf_counter()
        self.counters.forward_s += done - materialized
        return results, (materialized - started) * 1e3, (done - materialized) * 1e3

    def _synchronize(self) -> None:
        if self.encoder.device.type == "cuda":
            torch.cuda.synchronize(self.encoder.device)

    def _finish(self, batch: list[_Queued], results: list) -> None:
        self.counters.batches += 1
        self.counters.forwarded += sum(not isinstance(r, BaseException) for r in results)
        self.counters.max_batch_images = max(self.counters.max_batch_images, len(batch))
        calls = len({q.call for q in batch})
        self.counters.max_batch_calls = max(self.counters.max_batch_calls, calls)
        by_caller: dict[str, list[int]] = {}
        for q, result in zip(batch, results, strict=True):
            by_caller.setdefault(q.caller, []).append(q.item.num_patches)
            if q.key is not None:
                self._in_flight.pop(q.key, None)
                if not isinstance(result, BaseException):
                    # Own memory: a view would pin the whole batch's output in the cache.
                    result = result.copy()
                    self.cache.put(q.key, result)
            if isinstance(result, BaseException):
                q.future.set_exception(result)
            else:
                q.future.set_result(result)
        for caller, patches in by_caller.items():
            self._outstanding.remove(caller, Work.of(patches))


def raise_first_error(results: list, indices: Sequence[int]) -> list[np.ndarray]:
    """The arrays, or the first item's error named by its request index."""
    for index, result in zip(indices, results, strict=True):
        if isinstance(result, EncoderInputError):
            # type(result): a LimitExceededError stays one (413), with the culprit named.
            raise type(result)(str(result), index) from None
        if isinstance(result, BaseException):
            raise result
    return results
