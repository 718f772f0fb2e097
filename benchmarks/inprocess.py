"""The rank's batcher driven in-process: closed-loop clients through ``RankBatcher``.

What a served rank does with one device, without Serve, Ray or HTTP around it:
each client sends one image and waits for it; the batcher decodes ahead on its
pool, batches, forwards and copies to the host as in the service. The encoder's
forward and materialize calls are bracketed by CUDA events (wall time on a CPU),
so the share of the wall time the device spent forwarding is measured too.
Imports ``deployments.batcher`` (no Ray) when a section runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.execution import ExecutionConfig

from .common import Section
from .device import measure


class EventTimedEncoder(VisionEncoder):
    """A VisionEncoder whose forward and materialize are bracketed by CUDA events, so the
    served section can add up the GPU time spent in each."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spans: list[tuple] = []

    def forward(self, pixels, items):
        with self._span("forward"):
            return super().forward(pixels, items)

    def materialize(self, items, prepared=None):
        with self._span("preprocess"):
            return super().materialize(items, prepared)

    @contextlib.contextmanager
    def _span(self, kind: str) -> Iterator[None]:
        if self.device.type != "cuda":
            started = time.perf_counter()
            yield
            self.spans.append((kind, started, time.perf_counter()))
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self.spans.append((kind, begin, end))

    def span_seconds(self) -> dict[str, float]:
        """Seconds per kind (events are complete: the batcher synchronizes every batch)."""
        out: dict[str, float] = {}
        for kind, begin, end in self.spans:
            if isinstance(begin, float):
                seconds = end - begin
            else:
                end.synchronize()
                seconds = begin.elapsed_time(end) / 1e3
            out[kind] = out.get(kind, 0.0) + seconds
        return out


def batcher_section(
    sec: Section,
    net,
    preset,
    name: str,
    images: list[bytes],
    concurrencies: Sequence[int],
    seconds: float,
    timed_s: float,
    decode_threads: int = 2,
    *,
    execution: str | ExecutionConfig,
) -> None:
    """dp 1 on ``net``'s device, the tower run as ``execution`` says (no default: 'auto'
    would time candidates at start and measure whichever won, a different mode from one
    run to the next): the tower alone on a batch of ``images``, then closed-loop clients
    at each concurrency through a ``RankBatcher`` with the feature cache off."""
    device = next(net.parameters()).device.type
    backend = "gpu" if device == "cuda" else "cpu"
    encoder = EventTimedEncoder(
        net, preset.vision, preset.preprocess, name=name, backend=backend, execution=execution
    )
    started = time.perf_counter()
    batcher, batching = uncached_batcher(encoder, decode_threads)
    sec.record(
        "setup",
        {
            "batcher_start_s": time.perf_counter() - started,
            "backend": backend,
            "execution": encoder.execution.info(),
            "batching": {
                "max_batch_patches": batching.max_batch_patches,
                "max_batch_wait_ms": batching.max_batch_wait_ms,
                "cache": "off",
            },
        },
    )
    sec.record(
        "gpu_idle_method",
        "forward / preprocess seconds: CUDA events around "
        "VisionEncoder.forward / .materialize in the batcher's forward thread (the host "
        "decode runs ahead on the decode pool; preprocess spans cover upload and gpu "
        "preprocessing); idle = 1 - (forward + preprocess) "
        "/ wall, an upper bound on busy time, so idle is a lower bound",
    )
    most = max(concurrencies)
    tower = tower_only_rate(encoder, images, batching.max_batch_patches, most, timed_s)
    sec.record("tower_only", tower)
    for concurrency in concurrencies:
        if not sec.fits(f"concurrency {concurrency}", seconds + 10):
            break
        encoder.spans = []
        result = asyncio.run(closed_loop(batcher, encoder, images, concurrency, seconds))
        spans = encoder.span_seconds()
        wall = result["wall_s"]
        result["forward_share"] = spans.get("forward", 0.0) / wall
        result["preprocess_share"] = spans.get("preprocess", 0.0) / wall
        result["gpu_idle_share"] = max(
            0.0, 1 - result["forward_share"] - result["preprocess_share"]
        )
        result["served_over_tower_only"] = result["images_per_s"] / tower["images_per_s"]
        sec.record(f"concurrency {concurrency}", result)
    info = batcher.info()
    keys = ("batches", "max_batch_images", "forwarded", "preprocessed", "forward_s")
    sec.record("batcher", {k: info[k] for k in keys})


def uncached_batcher(encoder: VisionEncoder, decode_threads: int):
    """(a ``RankBatcher`` of ``encoder`` with the feature cache off, its batching settings):
    every request encodes."""
    from deployments.args import BatchingArgs
    from deployments.batcher import RankBatcher

    config = BatchingArgs(decode_threads=decode_threads)
    return RankBatcher(encoder, config, torch.get_num_threads(), cache_bytes=0), config


def tower_only_rate(
    encoder: VisionEncoder, images: list[bytes], budget: int, most: int, seconds: float
) -> dict:
    """Forward alone over one batch of the same images, as large as the batcher can make it:
    within its patch budget and at most ``most`` images (the most clients in flight)."""
    items = [encoder.plan(data) for data in images]
    batch = [items[0]]
    while len(batch) < most:
        item = items[len(batch) % len(items)]
        if sum(i.num_patches for i in batch) + item.num_patches > budget:
            break
        batch.append(item)
    pixels = encoder.materialize(batch)
    device = encoder.device.type
    timing = measure(lambda: encoder.forward(pixels, batch), device, seconds)
    return {"batch_images": len(batch), **timing, "images_per_s": len(batch) / timing["gpu_s"]}


async def closed_loop(
    batcher, encoder, images: list[bytes], concurrency: int, seconds: float
) -> dict:
    """``concurrency`` clients, each sending one image and waiting for it, for ``seconds``."""
    latencies: list[float] = []
    stages: dict[str, float] = {}
    errors: list[str] = []

    async def client(index: int, stop: float, record: bool) -> None:
        turn = index
        while time.perf_counter() < stop:
            item = encoder.plan(images[turn % len(images)])
            turn += concurrency
            sent = time.perf_counter()
            results, stage_ms = await batcher.encode([item], f"client-{index}", batcher.model_dtype)
            if isinstance(results[0], BaseException):
                errors.append(f"{type(results[0]).__name__}: {results[0]}")
            if record:
                latencies.append(time.perf_counter() - sent)
                for key, value in stage_ms.items():
                    stages[key] = stages.get(key, 0.0) + value

    warm = time.perf_counter() + min(2.0, seconds / 4)
    await asyncio.gather(*(client(i, warm, False) for i in range(concurrency)))
    encoder.spans.clear()
    started = time.perf_counter()
    await asyncio.gather(*(client(i, started + seconds, True) for i in range(concurrency)))
    wall = time.perf_counter() - started
    done = len(latencies)
    return {
        "concurrency": concurrency,
        "images": done,
        "wall_s": wall,
        "images_per_s": done / wall,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3) if done else None,
        "p99_ms": float(np.percentile(latencies, 99) * 1e3) if done else None,
        "mean_stage_ms": {k: v / max(done, 1) for k, v in stages.items()},
        "errors": errors[:5],
    }
