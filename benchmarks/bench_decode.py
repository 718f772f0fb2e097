"""Decode off the forward's GIL: how long the forward thread waits, decode threads vs processes.

    python -m benchmarks.bench_decode [--quick] [--preset tiny] [--side 448] [--per-batch 4]
                                      [--workers 1]

On a GPU the forward thread mostly launches kernels: Python between torch calls,
under the GIL. Decode threads hold the GIL between Pillow's calls, so each launch
can wait for them, and the GPU idles. The CPU figure that shows the same: the
forward thread's wall time minus its CPU time over each forward (the rank's
``forward_wait_s``), with one torch thread, so the forward runs on that thread
alone, while the next batch's images decode beside it.

Each setup is a ``RankBatcher`` of the same encoder, fed by closed-loop clients
(one image per call, enough of them for batches of several images, so the next
batch decodes while a forward runs): ``decode: threads``, ``decode: processes``,
and, as the floor, items that carry their pixels (no decode at all: what the
forward waits for a core on this machine anyway). Repeats alternate the setups.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sys
import threading
import time
from pathlib import Path

import torch

from kimi_encoder.encoder import VisionEncoder

from .common import Section, alternate, ratio, spread, table
from .inputs import jpeg
from .page import arguments, standalone

IMAGES = 16  # distinct files, cycled
SETUPS = ("pixels given", "threads", "processes")


@dataclasses.dataclass(frozen=True)
class Plan:
    preset: str = "tiny"
    side: int = 448  # the GPU run's square JPEGs
    per_batch: int = 4  # images the patch budget holds
    workers: int = 1  # decode threads, or processes
    seconds: float = 5.0
    repeats: int = 9

    @property
    def clients(self) -> int:
        """Two batches' worth: one in the forward, the next decoding."""
        return 2 * self.per_batch

    @property
    def command(self) -> str:
        return (
            f"python -m benchmarks.bench_decode --preset {self.preset} --side {self.side} "
            f"--per-batch {self.per_batch} --workers {self.workers}"
        )


def batchers(encoder: VisionEncoder, budget: int, workers: int, setups=SETUPS) -> list:
    """A batcher per setup (the floor's pixels come with its items: it decodes nothing)."""
    from deployments.args import BatchingArgs
    from deployments.batcher import RankBatcher

    def make(setup: str):
        decode = "processes" if setup == "processes" else "threads"
        config = BatchingArgs(
            max_batch_patches=budget, max_batch_wait_ms=2.0, decode=decode, decode_threads=workers
        )
        return RankBatcher(encoder, config, num_threads=1)

    return [make(setup) for setup in setups]


async def closed_loop(batcher, items: list, clients: int, seconds: float) -> None:
    """``clients`` callers, each sending one item and awaiting it, for ``seconds``."""

    async def client(index: int, stop: float) -> None:
        turn = index
        while time.perf_counter() < stop:
            item = items[turn % len(items)]
            turn += clients
            (result,), _ = await batcher.encode([item], f"client-{index}", batcher.model_dtype)
            if isinstance(result, BaseException):
                raise result

    stop = time.perf_counter() + seconds
    await asyncio.gather(*(client(i, stop) for i in range(clients)))


COUNTED = ("batches", "forwarded", "forward_s", "forward_wait_s", "host_s")


def switches(tid: int) -> tuple[int, int]:
    """Context switches of the thread ``tid`` of this process so far (Linux; 0 elsewhere):
    voluntary (it blocked: on a lock such as the GIL, or waiting for work) and
    nonvoluntary (the kernel preempted it, for another thread or process)."""
    try:
        status = Path(f"/proc/self/task/{tid}/status").read_text()
    except OSError:
        return 0, 0
    counts = dict(re.findall(r"^(\w+)_ctxt_switches:\s+(\d+)", status, re.M))
    return int(counts["voluntary"]), int(counts["nonvoluntary"])


def window(batcher, items: list, clients: int, seconds: float) -> dict:
    """One closed-loop window: per batch, the forward's wall and wait ms and the forward
    thread's blocks; images/s."""
    tid = batcher.run_in_worker_sync(threading.get_native_id)
    before = {key: getattr(batcher.counters, key) for key in COUNTED}
    first = switches(tid)
    started = time.perf_counter()
    asyncio.run(closed_loop(batcher, items, clients, seconds))
    wall = time.perf_counter() - started
    blocks, preempted = (b - a for a, b in zip(first, switches(tid), strict=True))
    delta = {key: getattr(batcher.counters, key) - before[key] for key in COUNTED}
    batches = max(delta["batches"], 1)
    return {
        "blocks": blocks / batches,
        "preempted": preempted / batches,
        "wait_ms": delta["forward_wait_s"] * 1e3 / batches,
        "forward_ms": delta["forward_s"] * 1e3 / batches,
        "wait_share": delta["forward_wait_s"] / max(delta["forward_s"], 1e-9),
        "images_per_batch": delta["forwarded"] / batches,
        "images_per_s": delta["forwarded"] / wall,
        "host_ms": delta["host_s"] * 1e3 / max(delta["forwarded"], 1),
    }


def measure(plan: Plan) -> tuple[str, str]:
    """(conditions, table) of the three setups, alternated."""
    torch.set_num_threads(1)
    encoder = VisionEncoder.from_pretrained(plan.preset, device="cpu", backend="cpu")
    files = [jpeg(plan.side, seed) for seed in range(IMAGES)]
    items = [encoder.plan(data) for data in files]
    budget = plan.per_batch * max(item.num_patches for item in items)
    given = [
        dataclasses.replace(item, pixel_values=encoder.prepare(item).pixels, image=None)
        for item in items
    ]
    runs = dict(zip(SETUPS, batchers(encoder, budget, plan.workers), strict=True))
    inputs = {"pixels given": given, "threads": items, "processes": items}
    for name, batcher in runs.items():  # warm-up: the workers' first images, the allocator
        window(batcher, inputs[name], plan.clients, min(1.0, plan.seconds))
    try:
        measured = alternate(
            {
                name: (lambda n=name: window(runs[n], inputs[n], plan.clients, plan.seconds))
                for name in SETUPS
            },
            plan.repeats,
        )
    finally:
        for batcher in runs.values():
            batcher.close()
    rows = []
    for name in SETUPS:
        got = measured[name]
        rows.append(
            [
                name,
                spread([w["wait_ms"] for w in got]).fmt(2),
                spread([w["forward_ms"] for w in got]).fmt(1),
                spread([100 * w["wait_share"] for w in got]).fmt(1, "%"),
                spread([w["blocks"] for w in got]).fmt(1),
                spread([w["preempted"] for w in got]).fmt(1),
                spread([w["images_per_batch"] for w in got]).fmt(1),
                spread([w["images_per_s"] for w in got]).fmt(1),
                spread([w["host_ms"] for w in got]).fmt(1) if name != "pixels given" else "-",
            ]
        )
    waits = {name: [w["wait_ms"] for w in measured[name]] for name in SETUPS}
    fewer = ratio(waits["threads"], waits["processes"]).fmt(2, "x")
    rows.append(["**threads / processes, wait per batch**", f"**{fewer}**"] + [""] * 7)
    conditions = (
        f"Preset {plan.preset}, float32, cpu backend, one torch thread for the forward; "
        f"{plan.clients} closed-loop clients, one {plan.side}x{plan.side} JPEG per call "
        f"({IMAGES} seeded files, cycled; feature cache off), patch budget {budget} "
        f"({plan.per_batch} images), max_batch_wait_ms 2; decode_threads {plan.workers} "
        f"(threads, or worker processes); {plan.repeats} repeats of {plan.seconds:g} s "
        "alternating the setups: median (min–max). Wait: "
        "the forward thread's wall time minus its CPU time (`time.thread_time()`) over each "
        "forward, the rank's `forward_wait_s` per batch; share: of the forward's wall time. "
        "Blocked and preempted: the forward thread's voluntary and nonvoluntary context "
        "switches per batch (Linux), over the whole window: it blocked (on the GIL, or "
        "waiting for its next batch: the floor's count), or the kernel gave its core to "
        "another thread or process; the two columns tell the GIL from a busy machine. Host: "
        "decode and preprocessing per image, wall time on its worker (a thread, or a thread "
        "waiting for its process)."
    )
    header = ["decode", "wait ms / batch", "forward ms / batch", "wait share",
              "blocked / batch", "preempted / batch", "images / batch", "images/s",
              "host ms / image"]  # fmt: skip
    return conditions, table(header, rows)


# The page's plans: the GPU run's 448x448 photos, and small ones, whose forward is many
# short operations (closer to a GPU's launches) beside a decode of about the same length.
PAGE_PLANS = (Plan(), Plan(side=112, per_batch=16))


def sections(quick: bool, plans: tuple[Plan, ...] = PAGE_PLANS) -> list[Section]:
    parts = []
    for plan in plans:
        if quick:
            plan = dataclasses.replace(plan, seconds=3.0, repeats=3)
        parts += measure(plan)
    command = " and ".join(f"`{plan.command}`" for plan in plans).strip("`")
    return [Section("Decode off the forward's GIL", command, parts)]


def argv_names_a_plan(argv: list[str] | None) -> bool:
    """Whether the command line sets the plan (else the page's plans run)."""
    words = sys.argv[1:] if argv is None else argv
    return any(w.split("=")[0] in ("--preset", "--side", "--per-batch", "--workers") for w in words)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--preset", default=Plan.preset)
    parser.add_argument("--side", type=int, default=Plan.side, help="of the square JPEGs")
    parser.add_argument("--per-batch", type=int, default=Plan.per_batch, help="images")
    parser.add_argument("--workers", type=int, default=Plan.workers, help="decode workers")

    def make(args) -> list[Section]:
        plan = Plan(args.preset, args.side, args.per_batch, args.workers)
        return sections(args.quick, (plan,) if argv_names_a_plan(argv) else PAGE_PLANS)

    return standalone(__doc__, make, argv, parser)


if __name__ == "__main__":
    sys.exit(main())
