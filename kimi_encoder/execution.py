"""How the tower and projector run: ``eager``, ``compiled``, ``graphs``, or ``auto``.

- ``eager``: the model's own forward, op by op: the reference every other mode is
  tested against.
- ``compiled``: the same forward with its pieces between attention calls compiled by
  ``torch.compile`` (``kimi_encoder.compiled``; ``kimi_encoder.model`` says why attention
  stays outside them). The patch or token count is an unbacked dynamic dimension of every
  piece, so one compilation per piece serves every batch (a single 2x2 image, one token,
  included). The pieces compile at start, one at a time, on a small synthetic batch, with
  a bounded pool of compile workers, and one process of a node at a time: the others
  then load what it compiled from inductor's on-disk cache. A call past dynamo's
  recompile limit runs eagerly, counted (``compiled_fallbacks``).
- ``graphs``: CUDA graphs of ``VisionTower.encode`` (pixels to the final norm)
  captured at start for a few patch budgets, the buckets (``kimi_encoder.buckets``). A
  batch runs in the smallest bucket that holds its patches and its images: its pixels,
  position embeddings and rotary tables are copied into the bucket's static buffers,
  the rows after them zeroed, and its padding attends in segments of bounded length, so
  padding costs rows, not their square. The padding rows are sliced off before the patch
  merge, so no feature sees them; merge and projector run eagerly. A batch with more
  patches than the largest bucket, or more images than a bucket holds, runs eagerly. A
  rank's batcher forms its batches to fill the buckets (``Execution.take``). Attention
  inside a graph must be one ``varlen_attn`` call per layer (per-image SDPA needs the
  lengths on the host): a CUDA device of compute capability 8.0+, bfloat16 or float16,
  and a torch with ``varlen_attn``. The same bucketing and padding run without capture
  on any device (``capture=False``: per-segment SDPA), which is how the CPU tests check
  them against the unpadded batch.
- ``auto``: on CPU, eager (``CPU_RULE``). On CUDA the encoder measures the candidates
  this device can run, eager, graphs and compiled in that order, on its own device at
  start, on a synthetic probe (``probe_batches``: one 32x32-patch image, batches that
  fill the largest bucket, half of it plus one image, and a mix of sizes), each cut into
  batches as the rank's batcher would cut it (``Execution.take``), and keeps the fastest.
  ``auto_budget_s`` bounds the whole choice, compile and capture included. Eager, the
  fallback, is always timed; every other candidate is built in steps (one compiled piece,
  or one bucket's graphs, at a time; for compiled, waiting for another process's compile
  first) and timed, and the budget is read before each step: when it is spent the
  candidate is undone and skipped, named in ``skipped``. So the choice ends at most one
  step past the budget: one piece's compile, one bucket's capture, or one candidate's
  timing (a few passes over the probe). One that fails is skipped with its error.
  ``Execution.info`` says what was measured and why the mode was chosen.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .buckets import BucketRunner, fifo, parts, split_rows
from .compiled import BudgetSpent, CompiledRun, Deadline, build_compiled
from .model import Grid, KimiVisionModel, varlen_function, varlen_unsupported

log = logging.getLogger(__name__)

EXECUTION_MODES = ("eager", "compiled", "graphs", "auto")
CPU_RULE = (
    "eager on CPU: compiled measured about as fast as eager there (docs/benchmarks.md, "
    "'Tower execution modes') and costs a compilation at start"
)
# Buckets halve from the batch budget down to this many patches, at most MAX_BUCKETS of them.
MIN_BUCKET_PATCHES = 512
MAX_BUCKETS = 8
PROBE_SIDE = 32  # the auto probe's images: 32 x 32 patches, a 448 x 448 photo
PROBE_REPEATS = 3

Run = Callable[[torch.Tensor, Sequence[Grid]], torch.Tensor]


DEFAULT_BATCH_PATCHES = 16384  # a rank's batch budget (ranks.batching.max_batch_patches)


def default_buckets(max_batch_patches: int) -> tuple[int, ...]:
    """Patch budgets of the captured graphs for a rank batching up to ``max_batch_patches``.

    >>> default_buckets(16384)
    (512, 1024, 2048, 4096, 8192, 16384)
    >>> default_buckets(65536)
    (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    >>> default_buckets(1000)
    (1000,)
    """
    buckets = [max_batch_patches]
    while len(buckets) < MAX_BUCKETS and buckets[-1] // 2 >= MIN_BUCKET_PATCHES:
        buckets.append(buckets[-1] // 2)
    return tuple(sorted(buckets))


def check_buckets(buckets) -> tuple[int, ...]:
    """``buckets`` sorted and without repeats; refused unless every one holds a 2x2 image."""
    if not buckets or min(buckets) < 4:
        raise ValueError(
            f"graph_buckets must be patch counts of at least 4 (one 2x2 image), got "
            f"{list(buckets)}."
        )
    return tuple(sorted(set(buckets)))


def check_mode(mode: str) -> str:
    if mode not in EXECUTION_MODES:
        raise ValueError(
            f"Unknown execution {mode!r}; allowed: {', '.join(EXECUTION_MODES)} ('auto': "
            "eager on CPU, the fastest measured at start on CUDA)."
        )
    return mode


@dataclass(frozen=True)
class ExecutionConfig:
    """How the tower runs (module docstring)."""

    mode: str = "auto"
    # The rank derives them from its batch budget; a library encoder from the rank's default.
    graph_buckets: tuple[int, ...] = default_buckets(DEFAULT_BATCH_PATCHES)
    graph_max_images: int = 64  # cumulative-length slots of a bucket: images per graph
    auto_budget_s: float = 120.0
    # A rank's CPUs; None: this process's. Either way at most compiled.MAX_COMPILE_THREADS.
    compile_threads: int | None = None

    def __post_init__(self) -> None:
        check_mode(self.mode)
        object.__setattr__(self, "graph_buckets", check_buckets(self.graph_buckets))
        if self.graph_max_images < 1:
            raise ValueError(f"graph_max_images must be at least 1, got {self.graph_max_images}.")
        if self.auto_budget_s < 0:
            raise ValueError(f"auto_budget_s must be >= 0, got {self.auto_budget_s}.")
        if self.compile_threads is not None and self.compile_threads < 1:
            raise ValueError(
                f"compile_threads must be at least 1 (or None: this process's CPUs), got "
                f"{self.compile_threads}."
            )

    @classmethod
    def of(cls, execution: str | ExecutionConfig) -> ExecutionConfig:
        return execution if isinstance(execution, ExecutionConfig) else cls(mode=execution)


def graphs_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the tower's CUDA graphs cannot be captured on ``device`` in ``dtype``, or None."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, got device {device.type!r}"
    capability = torch.cuda.get_device_capability(device)
    why = varlen_unsupported("cuda", dtype, capability, varlen_function())
    if why is None:
        return None
    return f"attention inside a graph is one varlen_attn call per layer, which {why}"


def check_execution(config: ExecutionConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a mode this device and dtype cannot run (before any weights load)."""
    if config.mode == "graphs" and (why := graphs_unsupported(torch.device(device), dtype)):
        raise ValueError(
            f"execution 'graphs' cannot run here: {why}. Use execution 'compiled', 'eager' or "
            "'auto' (which measures what this device can run)."
        )


# --- choosing and building ----------------------------------------------------------------


@dataclass
class Built:
    """A mode made ready on a model: how to run it and how to undo it."""

    run: Run
    undo: Callable[[], None] = lambda: None
    build_s: float = 0.0


def build(
    mode: str, model: KimiVisionModel, config: ExecutionConfig, deadline: Deadline | None = None
) -> Built:
    """``mode`` (not 'auto') made ready on ``model``: compiled and warmed up, or captured,
    one piece or bucket at a time while ``deadline`` (None: none) has not passed; else
    ``BudgetSpent``, with what was built undone."""
    started = time.perf_counter()
    if mode == "eager":
        return Built(model)
    if mode == "graphs":
        runner = capture_graphs(model, config, deadline or Deadline())
        return Built(runner, build_s=time.perf_counter() - started)
    run = build_compiled(model, deadline, config.compile_threads)
    return Built(run, run.undo, run.report["compile_s"])


@torch.inference_mode()
def capture_graphs(model: KimiVisionModel, config: ExecutionConfig, deadline: Deadline):
    """The graphs mode's runner, its buckets captured one at a time as ``BucketRunner``
    captures them (the largest first: the others share its memory pool), ``deadline``
    read between them."""
    if deadline.at is None:
        return BucketRunner(model, config.graph_buckets, config.graph_max_images, capture=True)
    runner = BucketRunner(model, config.graph_buckets, config.graph_max_images, capture=False)
    pool, order = torch.cuda.graph_pool_handle(), runner.buckets[::-1]
    for done, bucket in enumerate(order):
        if deadline.passed():
            raise BudgetSpent(f"after {done} of {len(order)} buckets captured")
        bucket.capture(model, pool)
    runner.capture = True
    return runner


# The probe's mix of sizes (patch rows, columns): a 448 x 448 photo, a 4:3 one, a small one.
PROBE_MIX = ((PROBE_SIDE, PROBE_SIDE), (24, 40), (16, 20))


def probe_batches(model: KimiVisionModel, config: ExecutionConfig) -> list[tuple]:
    """(pixels, grids) the auto rule times (seeded pixels): one 32x32-patch image; as many
    as fill the largest bucket; one more than fill the bucket below it (half the largest
    plus one image: no bucket fits it well); and about half the largest bucket of a mix
    of sizes (``PROBE_MIX``)."""
    p, side = model.cfg.patch_size, PROBE_SIDE
    device = model.vision_tower.patch_embed.proj.weight.device
    largest = config.graph_buckets[-1]
    count = max(1, min(largest // side**2, config.graph_max_images))
    shapes = [[(side, side)], [(side, side)] * count, [(side, side)] * (count // 2 + 1)]
    mixed, patches = [], 0
    while patches < largest // 2 and len(mixed) < config.graph_max_images:
        h, w = PROBE_MIX[len(mixed) % len(PROBE_MIX)]
        mixed.append((h, w))
        patches += h * w
    shapes.append(mixed)
    out = []
    for seed, sizes in enumerate(shapes):
        if sizes in shapes[:seed]:
            continue  # a small bucket: the same batch twice
        grids = [(1, h, w) for h, w in sizes]
        rows = sum(h * w for h, w in sizes)
        pixels = torch.randn(rows, 3, p, p, generator=torch.Generator().manual_seed(seed))
        out.append((pixels.to(device), grids))
    return out


def time_probe(
    run: Run, batches: Sequence[tuple], device: torch.device, budget: int | None = None
) -> float:
    """Median seconds of one pass over ``batches`` (after one warm-up pass), each cut into
    the batches a rank's batcher of ``budget`` patches would run (``take_for``)."""
    cut = [
        piece
        for pixels, grids in batches
        for piece in split_rows(pixels, grids, parts(_lengths(grids), take_for(run, budget)))
    ]

    def once() -> float:
        started = time.perf_counter()
        for pixels, grids in cut:
            run(pixels, grids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    once()
    return statistics.median(once() for _ in range(PROBE_REPEATS))


def _lengths(grids: Sequence[Grid]) -> list[int]:
    return [t * h * w for t, h, w in grids]


def take_for(run: Run, budget: int | None) -> Callable[[Sequence[int]], list[int]]:
    """How a batcher of ``budget`` patches (None: no limit) takes its next batch from a
    queue of patch counts for ``run``: filling its buckets, or first in, first out."""
    limit = budget if budget is not None else float("inf")
    if isinstance(run, BucketRunner):
        return lambda lengths: run.take(lengths, limit)
    return lambda lengths: fifo(lengths, limit)


@dataclass
class Execution:
    """A model as it runs: call it as the model; ``info()`` says how and why."""

    mode: str
    run: Run
    report: dict

    def __call__(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        return self.run(pixels, grids)

    def take(self, lengths: Sequence[int], budget: int) -> list[int]:
        """Indices of the queued images (patch counts ``lengths``, oldest first) that form
        the next batch of at most ``budget`` patches (the oldest always): in the graphs
        mode the ones that fill a bucket best (``kimi_encoder.buckets.take``), otherwise
        the queue's head."""
        return take_for(self.run, budget)(lengths)

    @property
    def padding_share(self) -> float:
        """Padding rows per real row of the batches run in buckets so far (0 without)."""
        return self.run.padding_share if isinstance(self.run, BucketRunner) else 0.0

    def info(self) -> dict:
        out = {"mode": self.mode, **self.report}
        if isinstance(self.run, (BucketRunner, CompiledRun)):
            out.update(self.run.info())
        return out


def candidates(device: torch.device, dtype: torch.dtype) -> tuple[list[str], dict[str, str]]:
    """The modes 'auto' measures here, in order, and those it cannot run, with why."""
    if device.type != "cuda":
        return ["eager"], {}
    why = graphs_unsupported(device, dtype)
    if why:
        return ["eager", "compiled"], {"graphs": why}
    return ["eager", "graphs", "compiled"], {}


def choose_fastest(
    model: KimiVisionModel,
    config: ExecutionConfig,
    names: Sequence[str],
    skipped: dict,
    clock: Callable[[], float] = time.perf_counter,
) -> Execution:
    """Build and time each of ``names`` within ``config.auto_budget_s`` on ``clock`` (module
    docstring); keep the fastest. The first, eager, is always timed: the fallback."""
    device = model.vision_tower.patch_embed.proj.weight.device
    batches = probe_batches(model, config)
    started = time.perf_counter()
    deadline = Deadline.after(config.auto_budget_s, clock)
    spent = f"auto_budget_s ({config.auto_budget_s:g} s) spent"
    measured: dict[str, float] = {}
    built: dict[str, Built] = {}
    for name in names:
        if measured and deadline.passed():
            skipped[name] = f"{spent} before it started"
            continue
        try:
            made = build(name, model, config, deadline if measured else None)
            if measured and deadline.passed():
                made.undo()
                skipped[name] = f"{spent} once built, before it was timed; undone"
                continue
            built[name] = made
            measured[name] = time_probe(made.run, batches, device, config.graph_buckets[-1])
        except BudgetSpent as exc:
            skipped[name] = f"{spent} {exc}; undone"
        except Exception as exc:  # noqa: BLE001 - a mode this device cannot run: skipped, named
            log.warning("execution 'auto': %s failed: %s: %s", name, type(exc).__name__, exc)
            skipped[name] = f"{type(exc).__name__}: {exc}"
            if name in built:
                built.pop(name).undo()
    best = min(measured, key=measured.get)
    for name, other in built.items():
        if name != best:
            other.undo()
    report = {
        "requested": "auto",
        "reason": "the fastest measured at start on this device",
        "probe_patches": [sum(_lengths(grids)) for _, grids in batches],
        "measured_ms": {k: round(v * 1e3, 3) for k, v in measured.items()},
        "build_s": {k: round(b.build_s, 2) for k, b in built.items()},
        "skipped": skipped,
        "auto_s": round(time.perf_counter() - started, 2),
    }
    return Execution(best, built[best].run, report)


@torch.inference_mode()
def prepare(model: KimiVisionModel, execution: str | ExecutionConfig) -> Execution:
    """``model`` made ready to run as ``execution`` says (module docstring)."""
    config = ExecutionConfig.of(execution)
    weight = model.vision_tower.patch_embed.proj.weight
    check_execution(config, weight.device, weight.dtype)
    if config.mode != "auto":
        made = build(config.mode, model, config)
        report = {"requested": config.mode, "build_s": round(made.build_s, 2)}
        chosen = Execution(config.mode, made.run, report)
    elif weight.device.type != "cuda":
        chosen = Execution("eager", model, {"requested": "auto", "reason": CPU_RULE})
    else:
        names, skipped = candidates(weight.device, weight.dtype)
        chosen = choose_fastest(model, config, names, skipped)
    log.info("execution %s: %s", chosen.mode, chosen.info())
    return chosen
