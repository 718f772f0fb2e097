"""Cross-request batching, feature cache, pipeline and load report of one encoder rank.

Mechanism: an asyncio queue of *images*, not ``@serve.batch`` (which batches calls
and caps a batch at the replica's ``max_ongoing_requests``; here one call carries
several images and the budget is in patches, ``max_batch_patches``). Every
``encode`` call puts its cache misses on the queue and awaits their futures.

Pipeline, per image: its preparation (``VisionEncoder.prepare``: file decode and
preprocessing, the ``gpu`` backend's on the device on each decode thread's own
CUDA stream) starts on a small decode pool as soon as it is queued (PIL releases
the GIL; with ``decode: processes`` each decode thread hands the decode, and the
cpu backend's whole preprocessing, to a worker process of its own,
``kimi_encoder.decode_procs``, and waits without the GIL); one drain task takes
images first in, first out, up to the patch budget (at least one image), waiting
at most ``max_batch_wait_ms`` after the oldest arrived for more to join, waits for
their preparation, and runs one forward and the copy of each image's features to
the host, cast on the device to the dtype its call asked for, on the one forward
thread. So batch k+1 decodes and
preprocesses while batch k runs its forward, the event loop keeps answering
load reports and cache hits, and each image's features leave the device once,
in the wire dtype, into a buffer of its own (which the cache keeps as is: no
second copy). A rank passes ``keep``: each image's host features are then handed
to it on a store thread (after the copy thread, which goes on to the next batch's
copy), and what it returns (the rank: a handle to the features
written once into Ray's object store) is what the cache keeps and every call gets,
so a cache hit moves no feature byte on the rank at all.

Cache: keys are ``kimi_encoder.cache.item_key`` of the model's name, its dtype and
the feature dtype, the ingress's keys of the same image; a hit skips everything. An
image already queued or running for another call is awaited, not encoded again.
An image the ingress sent by digest (``EncoderItem.by_digest``: it expected a hit,
so the file bytes stayed behind) that is neither cached nor in flight is answered
``NOT_CACHED``, and the caller sends it again with its bytes.

Cancellation: a call that is cancelled (the client went away, the ingress timed
out) takes back its queued images that no other call waits for and whose forward
has not started, so abandoned work never delays later requests.

Load: the rank counts what each caller has queued or running as
``kimi_encoder.load.Work`` (image count, sum of patches, sum of squares).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch

from kimi_encoder.cache import MAX_ENTRIES, FeatureCache, item_key
from kimi_encoder.cost import CostModel, calibrate
from kimi_encoder.decode_procs import DecodeProcesses
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.features import dtype_name, torch_dtype
from kimi_encoder.items import EncoderItem
from kimi_encoder.load import Work

from .args import BatchingArgs
from .batching import (
    NOT_CACHED,
    BatchCounters,
    Outstanding,
    Queued,
    StageClock,
    Timing,
    call_stages,
    timed,
    to_host,
)
from .ranks.records import LoadReport, Progress

LOOK_AHEAD = 256  # queued images a batch is chosen from (the oldest always among them)


class RankBatcher:
    """One rank's image queue, pipeline, feature cache and load report."""

    def __init__(
        self,
        encoder: VisionEncoder,
        config: BatchingArgs,
        num_threads: int,
        *,
        cache_bytes: int = 0,
        cache_entries: int = MAX_ENTRIES,
        calibration_grids: Sequence[int] = (),
        keep: Callable[[torch.Tensor], Any] | None = None,
    ):
        """A feature cache of ``cache_bytes`` (0: none) and at most ``cache_entries``
        images; the cost model fitted over
        ``calibration_grids`` (none: patch counts). ``keep`` (optional) turns an image's
        host features into what is cached and delivered (it must have ``nbytes``); it runs
        on a store thread of its own, after the copy thread."""
        self.encoder = encoder
        self.config = config
        # One forward thread runs every device stage; torch's thread count is per thread
        # (OpenMP), so it is set inside that thread, not only in the constructor's.
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="forward", initializer=torch.set_num_threads,
            initargs=(num_threads,),
        )  # fmt: skip
        self._decode_pool = ThreadPoolExecutor(
            max(1, config.decode_threads), thread_name_prefix="decode",
            initializer=torch.set_num_threads, initargs=(1,),
        )  # fmt: skip
        self.worker_threads = self._executor.submit(torch.get_num_threads).result()
        self._procs = None
        self._prepare: Callable = encoder.prepare
        if config.decode == "processes":
            self._procs = DecodeProcesses(max(1, config.decode_threads))
            self._prepare = functools.partial(encoder.prepare, host_stage=self._procs.host_stage)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="copy")
        # Writes into the object store (``keep``) run on a thread of their own, so the copy
        # thread is free for the next batch's copy while the store takes this one's bytes.
        self._storer = ThreadPoolExecutor(1, thread_name_prefix="store") if keep else None
        self._keep = keep
        device = encoder.device
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._deliveries: set[asyncio.Task] = set()
        self.cache = FeatureCache(cache_bytes, cache_entries)
        self.model_dtype = dtype_name(encoder.dtype)
        self.cost_model, self.calibration = self._calibrate(calibration_grids)
        self.counters = BatchCounters()
        self.instance = uuid.uuid4().hex
        self._outstanding = Outstanding()
        self._queue: deque[Queued] = deque()
        self._in_flight: dict[str, Queued] = {}
        self._arrived: asyncio.Event | None = None
        self._drain: asyncio.Task | None = None

    def _calibrate(self, grids: Sequence[int]) -> tuple[CostModel, dict]:
        """Fit a*p^2 + b*p + c on this rank, in the forward thread (its thread count)."""
        if not grids:
            return CostModel.patches(), {"grids": [], "fit_s": 0.0}
        started = time.perf_counter()
        model = self._executor.submit(calibrate, self.encoder.time_forward, grids).result()
        return model, {"grids": list(grids), "fit_s": round(time.perf_counter() - started, 3)}

    async def encode(
        self, items: Sequence[EncoderItem], caller: str, feature_dtype: str
    ) -> tuple[list, dict[str, float]]:
        """Features of ``items`` in order (CPU tensors of ``feature_dtype``, as admission
        chose and checked it, or what ``keep`` made of them; ``NOT_CACHED``; or an item's
        exception), and this call's stage milliseconds: queue_wait, preprocess, forward
        (of the batches its images were in)."""
        self._start()
        self.counters.calls += 1
        call = self.counters.calls
        self.counters.items += len(items)
        self.counters.patches += sum(item.num_patches for item in items)
        futures: list[asyncio.Future] = []
        mine: list[Queued] = []  # entries this call queued or joined
        queued: list[Queued] = []  # entries this call queued
        loop = asyncio.get_running_loop()
        for item in items:
            key = self._key(item, feature_dtype)
            hit = self.cache.get(key) if key is not None else None
            self.counters.by_digest += int(item.sent_by_digest)
            if hit is not None:
                self.counters.cache_hits += 1
                done = loop.create_future()
                done.set_result(hit)
                futures.append(done)
            elif key is not None and key in self._in_flight:
                self.counters.joined_in_flight += 1
                entry = self._in_flight[key]
                entry.waiters += 1
                mine.append(entry)
                futures.append(entry.future)
            elif item.sent_by_digest:  # its bytes stayed at the ingress: ask for them
                self.counters.not_cached += 1
                done = loop.create_future()
                done.set_result(NOT_CACHED)
                futures.append(done)
            else:
                entry = Queued(
                    item, key, feature_dtype, caller, call, loop.create_future(),
                    time.perf_counter(),
                    host=self._decode_pool.submit(timed, self._prepare, item),
                )  # fmt: skip
                if key is not None:
                    self._in_flight[key] = entry
                mine.append(entry)
                queued.append(entry)
                futures.append(entry.future)
        if queued:
            self._outstanding.add(caller, Work.of(q.item.num_patches for q in queued))
            self._queue.extend(queued)
            self._arrived.set()
        shielded = (asyncio.shield(f) for f in futures)  # a cancelled call leaves shared work
        try:
            results = list(await asyncio.gather(*shielded, return_exceptions=True))
        except asyncio.CancelledError:
            self._abandon(mine)
            raise
        self.counters.answered += 1
        return results, call_stages([q for q in queued if q.timing is not None])

    def _key(self, item: EncoderItem, dtype: str) -> str | None:
        if not self.cache.max_bytes:
            return None
        return item_key(item, self.encoder.name, self.model_dtype, dtype)

    def _abandon(self, entries: list[Queued]) -> None:
        """A call went away: take back its images that nobody else awaits and whose forward
        has not started (queued, or taken by a batch still waiting for their decode)."""
        for entry in entries:
            entry.waiters -= 1
            if entry.waiters or entry.forwarding or entry.future.done():
                continue  # still awaited, already in a forward, or already dropped
            if entry.timing is None:
                self._queue.remove(entry)
            entry.host.cancel()  # no-op once its decode has started
            entry.future.cancel()
            if entry.key is not None:
                self._in_flight.pop(entry.key, None)
            self._outstanding.remove(entry.caller, Work.of([entry.item.num_patches]))
            self.counters.dropped += 1

    async def run_in_worker(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on the forward thread, after the batch in progress."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def run_in_worker_sync(self, fn: Callable, *args: Any) -> Any:
        """``run_in_worker`` from outside an event loop (the rank's constructor)."""
        return self._executor.submit(fn, *args).result()

    def close(self) -> None:
        """Stop the pools (the rank is stopping): the decode worker processes end."""
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        if self._procs is not None:
            self._procs.close()

    def load(self) -> LoadReport:
        """Cheap report: each caller's queued or running work, this rank's cost model, and
        its progress: the calls this process has answered (``instance`` names the process,
        so a replacement's count starting again is not taken for a stall)."""
        return LoadReport(
            dict(self._outstanding.by_caller),
            self.cost_model,
            Progress(self.instance, self.counters.answered),
        )

    def info(self) -> dict:
        total = self._outstanding.total()
        return {
            "num_threads": self.worker_threads,
            "cost_model": {**self.cost_model.as_dict(), **self.calibration},
            "batching": self.config.model_dump(),
            "outstanding": {"images": total.images, "patches": total.patches},
            "cache": {
                "max_bytes": self.cache.max_bytes,
                "max_entries": self.cache.max_entries,
                **asdict(self.cache.stats),
            },
            "decode_processes": self._procs.info() if self._procs is not None else None,
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
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            await self._fill_window()
            if not self._queue:  # every waiting call went away meanwhile
                continue
            batch = self._take()
            timing = Timing(self.counters.batches, time.perf_counter())
            for q in batch:
                q.timing = timing
            self.counters.queue_s += sum(timing.started - q.arrived for q in batch)
            hosts = await asyncio.gather(
                *(asyncio.wrap_future(q.host) for q in batch), return_exceptions=True
            )
            kept = [(q, h) for q, h in zip(batch, hosts, strict=True) if not q.future.cancelled()]
            if not kept:  # every image was taken back while it decoded
                continue
            batch, hosts = [q for q, _ in kept], [h for _, h in kept]
            for q in batch:
                q.forwarding = True
            try:
                on_device, done = await loop.run_in_executor(
                    self._executor, self._device_stage, batch, hosts, timing
                )
            except Exception as exc:  # noqa: BLE001 - the whole batch failed (e.g. out of memory)
                self._finish(batch, [exc] * len(batch))
                continue
            # The copy to the host runs on its own thread (and CUDA stream) while the next
            # batch's forward starts; batches are delivered in order (one copy thread).
            copy = loop.run_in_executor(self._copier, self._copy_stage, on_device, done, timing)
            delivery = loop.create_task(self._deliver(batch, copy))
            self._deliveries.add(delivery)
            delivery.add_done_callback(self._deliveries.discard)

    async def _deliver(self, batch: list[Queued], copy: asyncio.Future) -> None:
        try:
            results = await copy
            if self._storer is not None:  # batches stay in order: one store thread
                loop = asyncio.get_running_loop()
                results = await loop.run_in_executor(self._storer, self._store_stage, results)
        except Exception as exc:  # noqa: BLE001 - the copy failed: every image of the batch
            results = [exc] * len(batch)
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
            if not self._queue:
                return

    def _take(self) -> list[Queued]:
        """The next batch: the oldest image and those the execution packs with it (the
        queue's head up to the budget; in the graphs mode, what fills a bucket best)."""
        ahead = itertools.islice(self._queue, LOOK_AHEAD)
        lengths = [q.item.num_patches for q in ahead]
        chosen = set(self.encoder.execution.take(lengths, self.config.max_batch_patches))
        batch = [q for i, q in enumerate(self._queue) if i in chosen]
        self._queue = deque(q for i, q in enumerate(self._queue) if i not in chosen)
        return batch

    def _device_stage(self, batch: list[Queued], hosts: list, timing: Timing) -> tuple:
        """Forward thread: hand each image's prepared pixels over (its own error), one
        forward for the rest, each one's features cast on the device to its dtype; returns
        them (or the errors) and, on a GPU, the event marking them done."""
        results: list = [None] * len(batch)
        good, pixels = [], []
        clock = StageClock(self.encoder.device)
        for i, (q, host) in enumerate(zip(batch, hosts, strict=True)):
            if isinstance(host, BaseException):
                results[i] = host
                continue
            prepared, host_ms = host
            timing.host_ms = max(timing.host_ms, host_ms)
            self.counters.host_s += host_ms / 1e3
            try:
                pixels.append(self.encoder.materialize([q.item], [prepared])[0])
                good.append(i)
            except Exception as exc:  # noqa: BLE001 - one bad image fails only its own call
                results[i] = exc
        self.counters.preprocessed += len(batch)
        clock.mark()
        wall, cpu = time.perf_counter(), time.thread_time()
        if good:
            with torch.inference_mode():
                features = self.encoder.forward(pixels, [batch[i].item for i in good])
                for i, f in zip(good, features, strict=True):
                    results[i] = f.to(torch_dtype(batch[i].dtype))
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        clock.mark()
        self.counters.forward_wait_s += max(0.0, wall - cpu)
        timing.device_ms, timing.forward_ms = clock.spans_ms()
        self.counters.forward_s += timing.forward_ms / 1e3
        self.counters.device_s += timing.device_ms / 1e3
        return results, clock.marks[-1] if clock.cuda else None

    def _copy_stage(self, on_device: list, done: Any, timing: Timing) -> list:
        """Copy thread: each image's features into a host buffer of its own (one copy), on
        this thread's CUDA stream after ``done``, while the forward thread goes on."""
        started = time.perf_counter()
        if done is None:
            results = [to_host(r) for r in on_device]
        else:
            stream = self._copy_stream
            with torch.cuda.stream(stream):
                stream.wait_event(done)
                for r in on_device:
                    if isinstance(r, torch.Tensor):
                        r.record_stream(stream)  # not reused before this copy ends
                results = [to_host(r) for r in on_device]
        timing.copy_ms = (time.perf_counter() - started) * 1e3
        self.counters.copy_s += timing.copy_ms / 1e3
        return results

    def _store_stage(self, results: list) -> list:
        """Store thread: each image's host features made what is cached and delivered
        (``keep``: written into the object store), while the copy thread goes on."""
        started = time.perf_counter()
        kept = [self._kept(r) for r in results]
        self.counters.store_s += time.perf_counter() - started
        return kept

    def _kept(self, result: Any) -> Any:
        if not isinstance(result, torch.Tensor):
            return result  # its error
        try:
            return self._keep(result)
        except Exception as exc:  # noqa: BLE001 - e.g. a full object store: this image's error
            return exc

    def _finish(self, batch: list[Queued], results: list) -> None:
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
                    self.cache.put(q.key, result)  # its own buffer: kept as is
            if q.future.done():  # cancelled while its forward ran
                continue
            if isinstance(result, BaseException):
                q.future.set_exception(result)
            else:
                q.future.set_result(result)
        for caller, patches in by_caller.items():
            self._outstanding.remove(caller, Work.of(patches))
