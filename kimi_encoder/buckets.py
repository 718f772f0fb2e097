"""Padded patch buckets: the static shapes the ``graphs`` mode replays, and batches that
fill them.

A bucket is a patch budget with static buffers (pixels, position embeddings, rotary
tables, cumulative lengths). A batch of ``n`` patches runs in the smallest bucket that
holds its patches and its images: its rows first, zeros after them up to the budget.

**Segments.** The cumulative lengths hold the batch's images, then its padding split
into segments of at most ``chunk`` rows (``pad_chunk``: the budget over ``PAD_SLOTS``, at
least ``MIN_CHUNK``), then empty segments up to the buffer's end. Attention costs the sum
of each segment's length squared, so padding of ``r`` rows costs at most ``r * chunk``:
linear in the padding, where one segment of padding cost ``r**2`` (``attention_work``
counts it; 33 images of 16 x 16 patches in the 16384 bucket: 4.2 M instead of 65 M).
Every row belongs to a segment, so attention writes every row of its output: no row is
left holding what an earlier replay (or another bucket's graph, in the shared pool) put
there, and the padding rows, zeros with zero rotary tables, attend uniformly and stay
finite.

**Longest segment.** Flash attention launches blocks for the longest segment it is told
of in every segment, and a graph fixes that number at capture. So each bucket is
captured once per length tier (``max_len_tiers``: 1024, 4096, 16384 and the budget, each
no longer than the budget): a batch of 448 x 448 images (1024 patches) in the 65536
bucket launches for 1024 rows a segment, not 65536.

**Filling.** ``take`` chooses which queued images form the next batch: the oldest
first, then, first fit in queue order, whatever else fits; when that batch would pad
its bucket by more than ``PAD_TARGET`` of its rows, the largest smaller bucket that the
queue fills at least as well is taken instead, and the rest waits for the next batch
(which starts at once). A rank's batcher calls it through ``Execution.take``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from itertools import accumulate

import torch

from .model import Grid, KimiVisionModel, Segments, cumulative_lengths, merge_patches

PAD_SLOTS = 64  # most padding segments in a bucket
MIN_CHUNK = 128  # shortest padding segment: flash attention's block of rows
MAX_LEN_TIERS = (1024, 4096, 16384)  # longest segments a bucket's graphs are captured for
PAD_TARGET = 0.125  # padded rows per bucket row a batch may leave before a smaller bucket


def pad_chunk(patches: int) -> int:
    """Longest padding segment of a ``patches`` bucket.

    >>> [pad_chunk(n) for n in (16, 512, 16384, 65536, 1 << 20)]
    [16, 128, 256, 1024, 16384]
    """
    return min(patches, max(MIN_CHUNK, -(-patches // PAD_SLOTS)))


def max_len_tiers(patches: int) -> tuple[int, ...]:
    """The longest segment of each graph a ``patches`` bucket captures (each at least its
    padding chunk, none over its budget).

    >>> max_len_tiers(512), max_len_tiers(4096), max_len_tiers(65536)
    ((512,), (1024, 4096), (1024, 4096, 16384, 65536))
    """
    chunk = pad_chunk(patches)
    return tuple(sorted({min(patches, max(t, chunk)) for t in MAX_LEN_TIERS} | {patches}))


def padding_lengths(pad: int, chunk: int) -> list[int]:
    """``pad`` rows as segments of ``chunk`` rows, the last one shorter.

    >>> padding_lengths(600, 256), padding_lengths(512, 256), padding_lengths(0, 256)
    ([256, 256, 88], [256, 256], [])
    """
    full, rest = divmod(pad, chunk)
    return [chunk] * full + ([rest] if rest else [])


def attention_work(lengths: Sequence[int]) -> int:
    """Query-key pairs attention computes over segments of ``lengths``: its cost, up to a
    factor of the width.

    >>> attention_work([256] * 33 + [7936]), attention_work([256] * 64)
    (65142784, 4194304)
    """
    return sum(n * n for n in lengths)


def fifo(lengths: Sequence[int], budget: int, max_images: int | None = None) -> list[int]:
    """The queue's head up to ``budget`` patches (and ``max_images``), the oldest always.

    >>> fifo([300, 300, 100, 50], 650), fifo([900, 10], 650), fifo([1, 1, 1], 10, 2)
    ([0, 1], [0], [0, 1])
    """
    taken, total = [0], lengths[0]
    for i in range(1, len(lengths)):
        if total + lengths[i] > budget or (max_images is not None and len(taken) >= max_images):
            break
        taken.append(i)
        total += lengths[i]
    return taken


def first_fit(lengths: Sequence[int], limit: int, max_images: int) -> tuple[list[int], int]:
    """The oldest, then every later one that still fits ``limit`` patches, in queue order,
    up to ``max_images``: (indices, patches); ([], 0) when the oldest does not fit.

    >>> first_fit([500, 600, 300, 200], 1024, 8)
    ([0, 2, 3], 1000)
    """
    if lengths[0] > limit:
        return [], 0
    taken, total = [0], lengths[0]
    for i in range(1, len(lengths)):
        if len(taken) >= max_images or total == limit:
            break
        if total + lengths[i] <= limit:
            taken.append(i)
            total += lengths[i]
    return taken, total


def take(lengths: Sequence[int], buckets: Sequence[int], max_images: int, budget: int) -> list[int]:
    """Indices of the queued images (patch counts ``lengths``, oldest first) that form the
    next batch for ``buckets`` (module docstring, "Filling"); at most ``budget`` patches
    unless the oldest alone is larger (it then runs alone, eagerly).

    One bucket's worth plus one image: the bucket's worth, then the one left alone.

    >>> take([1024] * 33, (1024, 2048, 4096, 8192, 16384, 32768, 65536), 64, 65536)[-1]
    31

    All four would pad the 4096 bucket by 27%: the three that fill 1024 go first, then
    the 2000 fills 2048 (3072 rows in all, not 4096).

    >>> take([300, 2000, 500, 200], (512, 1024, 2048, 4096), 8, 4096)
    [0, 2, 3]
    >>> take([600], (512, 1024), 8, 1024), take([5000], (512, 1024), 8, 1024)
    ([0], [0])
    """
    limit = min(budget, buckets[-1])
    best, total = first_fit(lengths, limit, max_images)
    if not best:
        return [0]
    fill = total / bucket_for(total, buckets)
    if fill >= 1 - PAD_TARGET:
        return best
    for size in sorted((b for b in buckets if b < total), reverse=True):
        taken, patches = first_fit(lengths, size, max_images)
        if not taken:
            break  # the oldest is larger than every smaller bucket
        if patches / size > fill:
            best, fill = taken, patches / size
        if fill >= 1 - PAD_TARGET:
            break
    return best


def bucket_for(patches: int, buckets: Sequence[int]) -> int:
    """The smallest of ``buckets`` holding ``patches`` (the largest when none does)."""
    return next((b for b in buckets if patches <= b), buckets[-1])


class Bucket:
    """Static buffers of one patch budget and, once captured, a graph and an output per
    length tier."""

    def __init__(self, model: KimiVisionModel, patches: int, max_images: int):
        cfg, weight = model.cfg, model.vision_tower.patch_embed.proj.weight
        device, dtype = weight.device, weight.dtype
        self.patches, self.max_images = patches, max_images
        self.chunk = pad_chunk(patches)
        self.tiers = max_len_tiers(patches)
        p = cfg.patch_size
        self.pixels = torch.zeros(patches, 3, p, p, device=device, dtype=dtype)
        self.pos = torch.zeros(patches, cfg.hidden_size, device=device, dtype=dtype)
        self.rope = torch.zeros(patches, cfg.head_dim // 2, 2, device=device)
        # the leading 0, an offset per image and per padding segment; unused ones repeat
        # the end (empty segments)
        slots = max_images + -(-patches // self.chunk)
        self.cu_seqlens = torch.full((slots + 1,), patches, dtype=torch.int32, device=device)
        self.cu_seqlens[0] = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outs: dict[int, torch.Tensor] = {}

    def layout(self, lengths: Sequence[int]) -> list[int]:
        """The segments of a batch of images of ``lengths`` patches: its images, then its
        padding in chunks (module docstring)."""
        return [*lengths, *padding_lengths(self.patches - sum(lengths), self.chunk)]

    def tier(self, longest: int) -> int:
        """The shortest length tier holding a segment of ``longest`` rows."""
        return next(t for t in self.tiers if longest <= t)

    def load(self, pixels: torch.Tensor, pos: torch.Tensor, rope: torch.Tensor, lengths) -> None:
        """A batch into the static buffers: its rows first, zeros after, its offsets then
        the padding segments', then the end repeated."""
        n = pixels.shape[0]
        for buffer, rows in ((self.pixels, pixels), (self.pos, pos), (self.rope, rope)):
            buffer[:n].copy_(rows)
            buffer[n:].zero_()
        offsets, _ = cumulative_lengths(self.layout(lengths))
        assert len(offsets) <= self.cu_seqlens.shape[0], (len(offsets), self.cu_seqlens.shape)
        offsets += [self.patches] * (self.cu_seqlens.shape[0] - len(offsets))
        host = torch.tensor(offsets, dtype=torch.int32)
        if self.cu_seqlens.is_cuda:  # pinned and asynchronous, as Segments.of does
            host = host.pin_memory()
        self.cu_seqlens.copy_(host, non_blocking=True)

    def encode(self, model: KimiVisionModel, segments: Segments) -> torch.Tensor:
        """(patches, hidden): the tower over the static buffers, eagerly."""
        return model.vision_tower.encode(self.pixels, self.pos, self.rope, segments)

    def capture(self, model: KimiVisionModel, pool) -> None:
        """For each length tier: warm up on a side stream (lazy initialisation stays out of
        the graph), then capture ``encode`` with one varlen call per layer over the static
        offsets, told that no segment is longer than the tier."""
        for max_len in self.tiers:
            segments = Segments([], max_len, "varlen", self.cu_seqlens)
            current = torch.cuda.current_stream(self.pixels.device)
            side = torch.cuda.Stream(self.pixels.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self.encode(model, segments)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outs[max_len] = self.encode(model, segments)
            self.graphs[max_len] = graph


class BucketRunner:
    """Tower and projector over padded patch buckets (kimi_encoder.execution, ``graphs``).

    With ``capture`` each bucket's graphs are captured here (CUDA only) and replayed per
    batch; without, the padded buffers run eagerly with per-segment SDPA (the padding
    segments as more images): the same buckets, layouts and padding, on any device.
    Calls are serialized (the buffers are shared) and must come from threads on one CUDA
    stream, as the rank's forward thread is.
    """

    def __init__(
        self, model: KimiVisionModel, buckets: Sequence[int], max_images: int, capture: bool
    ):
        self.model = model
        self.buckets = [Bucket(model, n, max_images) for n in sorted(set(buckets))]
        self.sizes = tuple(b.patches for b in self.buckets)
        self.max_images = max_images
        self.capture = capture
        self.bucket_batches: Counter[int] = Counter()  # batches run in each bucket
        self.eager_batches = 0  # batches too large for every bucket
        self.real_rows = 0  # patches of the batches run in a bucket
        self.padded_rows = 0  # ... and the padding rows added to them
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

    def take(self, lengths: Sequence[int], budget: int) -> list[int]:
        """Which of the queued images (patch counts, oldest first) form the next batch."""
        return take(lengths, self.sizes, self.max_images, budget)

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
            self.real_rows += n
            self.padded_rows += bucket.patches - n
            pos, rope = tower.patch_embed.pos_emb(grids), tower.rope(grids, pixels.device)
            bucket.load(pixels, pos, rope, lengths)
            if self.capture:
                max_len = bucket.tier(max(lengths))
                bucket.graphs[max_len].replay()
                hidden = bucket.outs[max_len]
            else:
                layout = bucket.layout(lengths)
                hidden = bucket.encode(self.model, Segments(layout, max(layout), "sdpa"))
            merged = merge_patches(hidden[:n], grids, self.model.cfg.merge_kernel_size)
        return self.model.mm_projector(merged)

    @property
    def padding_share(self) -> float:
        """Padding rows per real row of the batches run in buckets so far."""
        return self.padded_rows / self.real_rows if self.real_rows else 0.0

    def info(self) -> dict:
        return {
            "buckets": list(self.sizes),
            "graph_max_images": self.max_images,
            "graphs_captured": sum(len(b.graphs) for b in self.buckets),
            "bucket_batches": {str(k): v for k, v in sorted(self.bucket_batches.items())},
            "eager_batches": self.eager_batches,
            "padded_rows": self.padded_rows,
            "real_rows": self.real_rows,
            "padding_share": round(self.padding_share, 4),
        }


def parts(lengths: Sequence[int], take_next) -> list[list[int]]:
    """A queue of images (patch counts ``lengths``) cut into the batches that ``take_next``
    (a queue's lengths -> the indices of its next batch) makes of it, in the order they run.

    >>> [len(b) for b in parts([1024] * 33, lambda q: take(q, (1024, 32768, 65536), 64, 65536))]
    [32, 1]
    """
    queue, out = list(range(len(lengths))), []
    while queue:
        chosen = set(take_next([lengths[i] for i in queue]))
        out.append([q for k, q in enumerate(queue) if k in chosen])
        queue = [q for k, q in enumerate(queue) if k not in chosen]
    return out


def split_rows(pixels: torch.Tensor, grids: Sequence[Grid], batches: Sequence[Sequence[int]]):
    """(pixels, grids) of each of ``batches`` (indices into ``grids``) of a packed batch."""
    starts = [0, *accumulate(t * h * w for t, h, w in grids)]
    for batch in batches:
        rows = torch.cat([pixels[starts[i] : starts[i + 1]] for i in batch])
        yield rows, [grids[i] for i in batch]
