"""How the tower and projector run: ``eager``, ``compiled``, ``graphs``, or ``auto``.

- ``eager``: the model's own forward, op by op: the reference every other mode is
  tested against.
- ``compiled``: the same forward with its pieces between attention calls compiled by
  ``torch.compile`` (``compile_pieces``; ``kimi_encoder.model`` says which pieces and
  why attention stays outside them). The patch or token count is an unbacked dynamic
  dimension of every piece, so one compilation per piece serves every batch (a single
  2x2 image, one token, included). The pieces compile at start, on a small synthetic
  batch.
- ``graphs``: CUDA graphs of ``VisionTower.encode`` (pixels to the final norm)
  captured at start for a few patch budgets, the buckets (``BucketRunner``). A batch
  runs in the smallest bucket that holds its patches and its images: its pixels,
  position embeddings and rotary tables are copied into the bucket's static buffers,
  the rows after them zeroed, and the cumulative lengths padded with one more
  segment, the padding, attended only by itself, then with empty segments up to the
  bucket's image capacity. The padding rows are sliced off before the patch merge, so
  no feature sees them; merge and projector run eagerly. A batch with more patches
  than the largest bucket, or more images than a bucket holds, runs eagerly.
  Attention inside a graph must be one ``varlen_attn`` call per layer (per-image SDPA
  needs the lengths on the host): a CUDA device of compute capability 8.0+, bfloat16
  or float16, and a torch with ``varlen_attn``. The same bucketing and padding run
  without capture on any device (``capture=False``: per-image SDPA, the padding one
  more image), which is how the CPU tests check them bit for bit against the unpadded
  batch.
- ``auto``: on CPU, eager (``CPU_RULE``). On CUDA the encoder measures the candidates
  this device can run, eager, graphs and compiled in that order, on its own device at
  start, on a synthetic probe (one 32x32-patch image, then a batch of them filling the
  largest bucket), and keeps the fastest. A candidate starts only while
  ``auto_budget_s`` has time left (its compile or capture counts; one that has started
  runs to its end); one that fails is skipped with its error. ``Execution.info`` says
  what was measured and why the mode was chosen.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .model import (
    Grid,
    KimiVisionModel,
    Segments,
    cumulative_lengths,
    merge_patches,
    varlen_attn,
    varlen_unsupported,
)

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
    graph_buckets: tuple[int, ...] = default_buckets(16384)
    graph_max_images: int = 64  # cumulative-length slots of a bucket: images per graph
    auto_budget_s: float = 120.0

    def __post_init__(self) -> None:
        check_mode(self.mode)
        buckets = tuple(sorted(set(self.graph_buckets)))
        object.__setattr__(self, "graph_buckets", buckets)
        if not buckets or buckets[0] < 4:
            raise ValueError(
                f"graph_buckets must be patch counts of at least 4 (one 2x2 image), got "
                f"{list(self.graph_buckets)}."
            )
        if self.graph_max_images < 1:
            raise ValueError(f"graph_max_images must be at least 1, got {self.graph_max_images}.")
        if self.auto_budget_s < 0:
            raise ValueError(f"auto_budget_s must be >= 0, got {self.auto_budget_s}.")

    @classmethod
    def of(cls, execution: str | ExecutionConfig) -> ExecutionConfig:
        return execution if isinstance(execution, ExecutionConfig) else cls(mode=execution)


def graphs_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the tower's CUDA graphs cannot be captured on ``device`` in ``dtype``, or None."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, got device {device.type!r}"
    why = varlen_unsupported("cuda", dtype, torch.cuda.get_device_capability(device), varlen_attn)
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


# --- compiled -----------------------------------------------------------------------------


def _rows_dynamic(fn: Callable) -> Callable:
    """``fn`` with dim 0 (patches or tokens) of every tensor argument dynamic and unbacked,
    so no batch size, one included, compiles it again. Under inference mode a tensor made
    outside it (the position table of an image of the table's own size is a view of the
    weight) is copied first: a compiled graph is specialized on the kind of tensor too."""

    def run(*args):
        inference = torch.is_inference_mode_enabled()
        args = [_inference_copy(arg, inference) for arg in args]
        for arg in args:
            if isinstance(arg, torch.Tensor):
                torch._dynamo.decorators.mark_unbacked(arg, 0)
        return fn(*args)

    return run


def _inference_copy(arg, inference: bool):
    if inference and isinstance(arg, torch.Tensor) and not arg.is_inference():
        return arg.clone()
    return arg


def compile_pieces(model: KimiVisionModel) -> Callable[[], None]:
    """Put compiled pieces in place of the model's own (its patch embedding, each block's
    pre- and post-attention parts, its projector); returns what takes them out again.
    Every block runs the same compiled code: it is compiled once."""
    tower = model.vision_tower
    targets: list[tuple[torch.nn.Module, str]] = [
        (tower.patch_embed, "forward"),
        (model.mm_projector, "forward"),
    ]
    for block in tower.encoder.blocks:
        targets += [(block, "pre_attention"), (block, "post_attention")]
    for owner, name in targets:
        setattr(owner, name, _rows_dynamic(torch.compile(getattr(owner, name))))

    def remove() -> None:
        for owner, name in targets:
            delattr(owner, name)  # the class's own method shows again

    return remove


def warm_up(model: KimiVisionModel) -> None:
    """One forward over two small synthetic images: compiles what is compiled lazily."""
    p, device = model.cfg.patch_size, model.vision_tower.patch_embed.proj.weight.device
    model(torch.zeros(4 + 24, 3, p, p, device=device), [(1, 2, 2), (1, 4, 6)])


# --- graphs over patch buckets ------------------------------------------------------------


class Bucket:
    """Static buffers of one patch budget and, once captured, its graph and output."""

    def __init__(self, model: KimiVisionModel, patches: int, max_images: int):
        cfg, weight = model.cfg, model.vision_tower.patch_embed.proj.weight
        device, dtype = weight.device, weight.dtype
        self.patches = patches
        p = cfg.patch_size
        self.pixels = torch.zeros(patches, 3, p, p, device=device, dtype=dtype)
        self.pos = torch.zeros(patches, cfg.hidden_size, device=device, dtype=dtype)
        self.rope = torch.zeros(patches, cfg.head_dim // 2, 2, device=device)
        # images, the padding segment, and the leading 0
        self.cu_seqlens = torch.full((max_images + 2,), patches, dtype=torch.int32, device=device)
        self.cu_seqlens[0] = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    @property
    def max_images(self) -> int:
        return self.cu_seqlens.shape[0] - 2

    def load(self, pixels: torch.Tensor, pos: torch.Tensor, rope: torch.Tensor, lengths) -> None:
        """A batch into the static buffers: its rows first, zeros after, its offsets then
        the padding's end repeated (the padding segment, then empty ones)."""
        n = pixels.shape[0]
        for buffer, rows in ((self.pixels, pixels), (self.pos, pos), (self.rope, rope)):
            buffer[:n].copy_(rows)
            buffer[n:].zero_()
        offsets, _ = cumulative_lengths(lengths)
        offsets += [self.patches] * (self.cu_seqlens.shape[0] - len(offsets))
        host = torch.tensor(offsets, dtype=torch.int32)
        if self.cu_seqlens.is_cuda:  # pinned and asynchronous, as Segments.of does
            host = host.pin_memory()
        self.cu_seqlens.copy_(host, non_blocking=True)

    def encode(self, model: KimiVisionModel, segments: Segments) -> torch.Tensor:
        """(patches, hidden): the tower over the static buffers, eagerly."""
        return model.vision_tower.encode(self.pixels, self.pos, self.rope, segments)

    def capture(self, model: KimiVisionModel, pool) -> None:
        """Warm up on a side stream (lazy initialisation stays out of the graph), then
        capture ``encode`` with one varlen call per layer over the static offsets."""
        segments = Segments([], self.patches, "varlen", self.cu_seqlens)
        current = torch.cuda.current_stream(self.pixels.device)
        side = torch.cuda.Stream(self.pixels.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.encode(model, segments)
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.out = self.encode(model, segments)


class BucketRunner:
    """Tower and projector over padded patch buckets (module docstring, ``graphs``).

    With ``capture`` each bucket's graph is captured here (CUDA only) and replayed per
    batch; without, the padded buffers run eagerly with per-image SDPA. Calls are
    serialized (the buffers are shared) and must come from threads on one CUDA stream,
    as the rank's forward thread is.
    """

    def __init__(
        self, model: KimiVisionModel, buckets: Sequence[int], max_images: int, capture: bool
    ):
        self.model = model
        self.buckets = [Bucket(model, n, max_images) for n in sorted(set(buckets))]
        self.capture = capture
        self.bucket_batches: Counter[int] = Counter()  # batches run in each bucket
        self.eager_batches = 0
        self._lock = threading.Lock()
        if capture:
            with torch.inference_mode():
                pool = torch.cuda.graph_pool_handle()
                for bucket in reversed(self.buckets):  # the largest first: the others share
                    bucket.capture(model, pool)  # its memory pool

    def pick(self, patches: int, images: int) -> Bucket | None:
        """The smallest bucket holding ``patches`` and ``images``; None: run eagerly."""
        for bucket in self.buckets:
            if patches <= bucket.patches and images <= bucket.max_images:
                return bucket
        return None

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        lengths = [t * h * w for t, h, w in grids]
        n = sum(lengths)
        bucket = self.pick(n, len(grids))
        if bucket is None:
            self.eager_batches += 1
            return self.model(pixels, grids)
        tower = self.model.vision_tower
        with self._lock:
            self.bucket_batches[bucket.patches] += 1
            pos, rope = tower.patch_embed.pos_emb(grids), tower.rope(grids, pixels.device)
            bucket.load(pixels, pos, rope, lengths)
            if self.capture:
                bucket.graph.replay()
                hidden = bucket.out
            else:
                padding = [bucket.patches - n] if n < bucket.patches else []
                segments = Segments(lengths + padding, bucket.patches, "sdpa")
                hidden = bucket.encode(self.model, segments)
            merged = merge_patches(hidden[:n], grids, self.model.cfg.merge_kernel_size)
        return self.model.mm_projector(merged)

    def info(self) -> dict:
        return {
            "buckets": [b.patches for b in self.buckets],
            "graph_max_images": self.buckets[0].max_images,
            "bucket_batches": {str(k): v for k, v in sorted(self.bucket_batches.items())},
            "eager_batches": self.eager_batches,
        }


# --- choosing and building ----------------------------------------------------------------


@dataclass
class Built:
    """A mode made ready on a model: how to run it and how to undo it."""

    run: Run
    undo: Callable[[], None] = lambda: None
    build_s: float = 0.0


def build(mode: str, model: KimiVisionModel, config: ExecutionConfig) -> Built:
    """``mode`` (not 'auto') made ready on ``model``: compiled and warmed up, or captured."""
    started = time.perf_counter()
    if mode == "eager":
        return Built(model)
    if mode == "graphs":
        runner = BucketRunner(model, config.graph_buckets, config.graph_max_images, capture=True)
        return Built(runner, build_s=time.perf_counter() - started)
    remove = compile_pieces(model)
    try:
        warm_up(model)
    except Exception:
        remove()
        raise
    return Built(model, remove, time.perf_counter() - started)


def probe_batches(model: KimiVisionModel, config: ExecutionConfig) -> list[tuple]:
    """(pixels, grids) the auto rule times: one 32x32-patch image, then as many as fill
    the largest bucket (seeded pixels)."""
    p, side = model.cfg.patch_size, PROBE_SIDE
    device = model.vision_tower.patch_embed.proj.weight.device
    count = max(1, min(config.graph_buckets[-1] // side**2, config.graph_max_images))
    out = []
    for images in (1, count):
        g = torch.Generator().manual_seed(images)
        pixels = torch.randn(images * side * side, 3, p, p, generator=g).to(device)
        out.append((pixels, [(1, side, side)] * images))
    return out


def time_probe(run: Run, batches: Sequence[tuple], device: torch.device) -> float:
    """Median seconds of one pass over ``batches`` (after one warm-up pass)."""

    def once() -> float:
        started = time.perf_counter()
        for pixels, grids in batches:
            run(pixels, grids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    once()
    return statistics.median(once() for _ in range(PROBE_REPEATS))


@dataclass
class Execution:
    """A model as it runs: call it as the model; ``info()`` says how and why."""

    mode: str
    run: Run
    report: dict

    def __call__(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        return self.run(pixels, grids)

    def info(self) -> dict:
        out = {"mode": self.mode, **self.report}
        if isinstance(self.run, BucketRunner):
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
    model: KimiVisionModel, config: ExecutionConfig, names: Sequence[str], skipped: dict
) -> Execution:
    """Build and time each of ``names`` within ``config.auto_budget_s``; keep the fastest."""
    device = model.vision_tower.patch_embed.proj.weight.device
    batches = probe_batches(model, config)
    started = time.perf_counter()
    measured: dict[str, float] = {}
    built: dict[str, Built] = {}
    for name in names:
        if measured and time.perf_counter() - started > config.auto_budget_s:
            skipped[name] = f"auto_budget_s ({config.auto_budget_s:g} s) spent"
            continue
        try:
            built[name] = build(name, model, config)
            measured[name] = time_probe(built[name].run, batches, device)
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
        "probe_patches": [sum(t * h * w for t, h, w in grids) for _, grids in batches],
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
