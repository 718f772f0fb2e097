"""The graphs mode's padding on CPU, through its uncaptured path: what a padded batch
costs, and how much padding a rank's batcher leaves when it fills the buckets.

    python -m benchmarks.bench_padding [--quick]

- **Cost of padding**: 33 images of 16 x 16 patches in the 16384 bucket (1.94x their
  rows), small preset, one torch thread: the eager batch, the padded batch with its
  padding in segments (``kimi_encoder.buckets``), and the same with the padding in one
  segment (the layout before), windows alternating; time per forward, its ratio to
  eager, and that ratio over the rows' ratio. Max abs diff: padded against eager.
- **Padding left by the batcher**: a rank's batcher (``deployments.batcher.RankBatcher``)
  driven in-process by closed-loop clients, each sending requests of 8 images of the
  mixed set of benchmarks/gpu_served.py (448 x 448 photos, and 1920 x 1080 ones as 2 of
  every 8), as Kimi-K3's preprocessing grids them (1024 and 10764 patches); the tiny
  tower over the buckets without capture; the batcher taking the queue's head (the rule
  before) or what fills a bucket (``Execution.take``), alternating. Padding share:
  padding rows over real rows of the batches run in buckets, per window.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

import torch

from deployments.args import BatchingArgs
from deployments.batcher import RankBatcher
from kimi_encoder.buckets import BucketRunner, fifo
from kimi_encoder.config import get_preset
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.execution import Execution, default_buckets
from kimi_encoder.items import EncoderItem
from kimi_encoder.weights import random_model

from .common import Section, alternate, ratio, spread, table
from .page import standalone

GRIDS = [(1, 16, 16)] * 33  # 8448 patches: 1.94x fewer than the bucket
BUCKET = 16384
MIXED = [(1, 32, 32)] * 3 + [(1, 78, 138)] + [(1, 32, 32)] * 3 + [(1, 78, 138)]  # 8 of the set


def forward_s(run: Callable, pixels: torch.Tensor, grids) -> Callable[[], float]:
    def measure() -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            run(pixels, grids)
        return time.perf_counter() - started

    return measure


def padding_cost(repeats: int) -> dict:
    torch.set_num_threads(1)
    model = random_model(get_preset("small").vision, 0, "cpu", torch.float32)
    pixels = torch.randn(sum(h * w for _, h, w in GRIDS), 3, 14, 14)
    chunked = BucketRunner(model, (BUCKET,), 64, capture=False)
    whole = BucketRunner(model, (BUCKET,), 64, capture=False)
    whole.buckets[0].chunk = BUCKET  # the padding in one segment
    with torch.inference_mode():
        diff = (chunked(pixels, GRIDS) - model(pixels, GRIDS)).abs().max().item()
    times = alternate(
        {
            "eager": forward_s(model, pixels, GRIDS),
            "segments": forward_s(chunked, pixels, GRIDS),
            "one segment": forward_s(whole, pixels, GRIDS),
        },
        repeats,
    )
    rows = BUCKET / pixels.shape[0]
    per_rows = [s / e / rows for s, e in zip(times["segments"], times["eager"], strict=True)]
    return {
        "times": {name: spread(values) for name, values in times.items()},
        "segments / eager": ratio(times["segments"], times["eager"]),
        "one segment / eager": ratio(times["one segment"], times["eager"]),
        "over rows": spread(per_rows),
        "rows": rows,
        "max_diff": diff,
    }


def mixed_items(count: int) -> list[EncoderItem]:
    """``count`` images of the mixed set as preprocessed pixels (seeded), so that only the
    batcher and the tower run in the windows."""
    gen = torch.Generator().manual_seed(0)
    items = []
    for k in range(count):
        grid = MIXED[k % len(MIXED)]
        rows = torch.randn(grid[0] * grid[1] * grid[2], 3, 14, 14, generator=gen)
        items.append(EncoderItem(torch.tensor([grid]), pixel_values=rows))
    return items


def tiny_k3_encoder(budget: int) -> tuple[VisionEncoder, BucketRunner]:
    """The tiny tower with Kimi-K3's preprocessing, its forward over ``budget``'s buckets
    without capture."""
    tiny, k3 = get_preset("tiny"), get_preset("k3")
    model = random_model(tiny.vision, 0, "cpu", torch.float32)
    encoder = VisionEncoder(model, tiny.vision, k3.preprocess, name="tiny", execution="eager")
    runner = BucketRunner(model, default_buckets(budget), 64, capture=False)
    encoder.execution = Execution("graphs", runner, {})
    return encoder, runner


def batcher_window(
    encoder: VisionEncoder,
    runner: BucketRunner,
    rule: str,
    budget: int,
    clients: int,
    requests: int,
) -> Callable[[], float]:
    """A window of ``requests`` requests per client through a fresh batcher whose rule is
    ``rule``: the padding share of the batches it ran."""

    def measure() -> float:
        execution = Execution("graphs", runner, {})
        if rule == "head":
            execution.take = lambda lengths, limit: fifo(lengths, limit, runner.max_images)
        encoder.execution = execution
        config = BatchingArgs(max_batch_patches=budget, max_batch_wait_ms=2.0)
        batcher = RankBatcher(encoder, config, num_threads=1)
        real, padded = runner.real_rows, runner.padded_rows
        mixed = mixed_items(8)

        async def client(k: int) -> None:
            for r in range(requests):
                items = mixed[(k + r) % 8 :] + mixed[: (k + r) % 8]
                results, _ = await batcher.encode(items, f"client{k}", "float32")
                assert all(isinstance(x, torch.Tensor) for x in results), results

        async def run() -> None:
            await asyncio.gather(*(client(k) for k in range(clients)))

        try:
            asyncio.run(run())
        finally:
            batcher.close()
        return (runner.padded_rows - padded) / (runner.real_rows - real)

    return measure


def padding_left(budgets: tuple[int, ...], clients: tuple[int, ...], images: int, repeats: int):
    """Padding share per window for each budget and client count; every window sends about
    ``images`` images in all (requests of 8 per client)."""
    rows = []
    for budget in budgets:
        encoder, runner = tiny_k3_encoder(budget)
        for n in clients:
            requests = max(1, images // (8 * n))
            windows = {
                rule: batcher_window(encoder, runner, rule, budget, n, requests)
                for rule in ("head", "fill")
            }
            shares = alternate(windows, repeats)
            rows.append(
                [budget, n, spread(shares["head"]).fmt(3), f"**{spread(shares['fill']).fmt(3)}**"]
            )
    return rows


def sections(quick: bool) -> list[Section]:
    repeats = 2 if quick else 3
    cost = padding_cost(repeats)
    t = cost["times"]
    cost_rows = [
        [
            f"{t['eager'].fmt(2)} s",
            f"{t['segments'].fmt(2)} s",
            f"{t['one segment'].fmt(2)} s",
            cost["segments / eager"].fmt(2, "x"),
            f"**{cost['over rows'].fmt(2, 'x')}**",
            cost["one segment / eager"].fmt(2, "x"),
            f"{cost['max_diff']:.1e}",
        ]
    ]
    header = [
        "eager",
        "padded, segments",
        "padded, one segment",
        "segments / eager",
        "... over the rows' ratio",
        "one segment / eager",
        "max abs diff",
    ]
    images = 48 if quick else 128  # per window: 16 clients send one request each
    left = padding_left((16384, 65536), (4, 16), images, repeats)
    return [
        Section(
            "Graph buckets on CPU: the cost of padding, and padding left by the batcher",
            "python -m benchmarks.bench_padding",
            [
                f"Cost: 33 images of 16 x 16 patches (8448 rows) in the {BUCKET} bucket "
                f"({cost['rows']:.2f}x the rows), small preset, one torch thread, seconds per "
                f"forward over {repeats} repeats alternating the three, median (min–max); the "
                "ratios per repeat.",
                table(header, cost_rows),
                f"Padding left: closed-loop clients of 8 images each (the mixed set: 448 x 448 "
                f"and 1920 x 1080 photos, 1024 and 10764 patches, 2 large in every 8), about "
                f"{images} images per window, the tiny tower over the budget's "
                "buckets (halving down to 512) without capture, one torch thread; padding rows "
                f"over real rows per window, {repeats} windows per rule alternating, median "
                "(min–max). 'head': the queue's head up to the budget (the rule before); "
                "'fill': the batch that fills a bucket best.",
                table(["max_batch_patches", "clients", "head", "fill"], left),
            ],
        )
    ]


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
