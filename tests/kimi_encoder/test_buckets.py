"""The graphs mode's buckets (kimi_encoder/buckets.py), on CPU without capture.

What a batch costs in a bucket (its segment layout, counted by hand), which batch the
batcher takes from its queue, and features: a padded batch against the unpadded one
within a stated tolerance (other row counts run other BLAS kernels, so no more than
that is promised across row counts), and bit for bit between two paddings of the same
bucket (the same rows through the same kernels).
"""

from __future__ import annotations

import random

import pytest
import torch

from kimi_encoder import buckets as bk
from kimi_encoder.config import get_preset
from kimi_encoder.weights import random_model

TINY = get_preset("tiny").vision
# Features of a padded batch against the unpadded one, across row counts: float32 within
# a few roundings of features of magnitude ~3; bfloat16 within the drift of its rounding.
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (None, 1e-2)}  # (max abs, rel L2)


def pixels_of(grids, seed: int = 0, patch: int = 14) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, patch, patch, generator=torch.Generator().manual_seed(seed))


def assert_close_across_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    max_abs, rel = TOLERANCE[want.dtype]
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all()
    if max_abs is not None:
        assert (got - want).abs().max() <= max_abs
    assert (got - want).norm() / want.norm() <= rel
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) >= 0.9995


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    ("patches", "chunk", "tiers"),
    [
        (4, 4, (4,)),
        (512, 128, (512,)),
        (1024, 128, (1024,)),
        (4096, 128, (1024, 4096)),
        (16384, 256, (1024, 4096, 16384)),
        (65536, 1024, (1024, 4096, 16384, 65536)),
        (1 << 20, 16384, (16384, 1 << 20)),
    ],
    ids=lambda v: str(v) if isinstance(v, int) else None,
)
def test_chunks_and_length_tiers(patches, chunk, tiers):
    assert bk.pad_chunk(patches) == chunk
    assert bk.max_len_tiers(patches) == tiers
    assert all(chunk <= t <= patches for t in tiers)


def test_a_batch_costs_rows_not_squares_by_hand():
    """33 images of 16 x 16 patches in the 16384 bucket: 7936 padding rows. In one segment
    they cost 7936**2 query-key pairs, 30x the images' own 33 * 256**2; in 31 segments of
    256 (16384 / 64 slots), 31 * 256**2, as much as 31 more images."""
    model = random_model(TINY, seed=0, device="cpu", dtype=torch.float32)
    bucket = bk.Bucket(model, 16384, 64)
    layout = bucket.layout([256] * 33)
    assert layout == [256] * 64
    assert bk.attention_work(layout) == 64 * 256 * 256 == 4_194_304
    assert bk.attention_work([256] * 33 + [7936]) == 33 * 65_536 + 62_980_096
    # K3's largest bucket: 33 images of 32 x 32, 31744 padding rows in 31 segments of 1024.
    assert bk.padding_lengths(65536 - 33 * 1024, bk.pad_chunk(65536)) == [1024] * 31


@pytest.mark.parametrize(
    ("patches", "lengths"),
    [
        (16384, [4]),  # the most padding a bucket can have
        (16384, [256] * 33),
        (16384, [16384]),  # no padding
        (64, [4] * 8),  # every image slot used
        (65536, [1000, 3, 17]),
    ],
    ids=["one small image", "33 images", "full", "every slot", "uneven"],
)
def test_every_row_is_in_a_segment(patches, lengths):
    """The offsets end at the bucket's size, whatever the batch: attention writes every
    row, so no row keeps what an earlier batch or another graph left in the pool."""
    model = random_model(TINY, seed=0, device="cpu", dtype=torch.float32)
    bucket = bk.Bucket(model, patches, 8 if patches == 64 else 64)
    layout = bucket.layout(lengths)
    assert sum(layout) == patches
    assert max(layout[len(lengths) :], default=0) <= bucket.chunk <= bucket.tier(max(layout))
    n = sum(lengths)
    p = TINY.patch_size
    rows = (
        torch.ones(n, 3, p, p),
        torch.ones(n, TINY.hidden_size),
        torch.ones(n, TINY.head_dim // 2, 2),
    )
    bucket.load(*rows, lengths)
    offsets = bucket.cu_seqlens.tolist()
    assert offsets[: len(layout) + 1] == [0, *torch.tensor(layout).cumsum(0).tolist()]
    assert set(offsets[len(layout) :]) == {patches}  # the empty segments after
    assert bucket.pixels[n:].abs().sum() == 0
    assert bucket.rope[n:].abs().sum() == 0


# ----------------------------------------------------------------------------- taking a batch

K3_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

# name: (queued patch counts, buckets, images per bucket, budget, the batch taken)
TAKES = {
    "one image": ([1024], K3_BUCKETS, 64, 65536, [0]),
    "fills its bucket": ([1024] * 4, K3_BUCKETS, 64, 65536, [0, 1, 2, 3]),
    "one bucket plus one image": ([1024] * 33, K3_BUCKETS, 64, 65536, list(range(32))),
    "the oldest over every bucket": ([70000, 10], K3_BUCKETS, 64, 65536, [0]),
    "the oldest always, even when it fits badly": ([600, 512], (512, 1024), 8, 1024, [0]),
    "a later one fills the gap": ([700, 600, 300], (512, 1024), 8, 1024, [0, 2]),
    "images per bucket": ([4] * 10, (64,), 8, 64, list(range(8))),
    "a smaller bucket filled better": (
        [300, 2000, 500, 200],
        (512, 1024, 2048, 4096),
        8,
        4096,
        [0, 2, 3],
    ),
    "good enough is kept": ([1000, 900, 1700], (1024, 2048, 4096), 8, 4096, [0, 1, 2]),
    "the budget below the largest bucket": ([1024] * 8, K3_BUCKETS, 64, 4096, [0, 1, 2, 3]),
}


@pytest.mark.parametrize(
    ("lengths", "buckets", "images", "budget", "want"), TAKES.values(), ids=TAKES
)
def test_take(lengths, buckets, images, budget, want):
    taken = bk.take(lengths, buckets, images, budget)
    assert taken == want
    assert taken[0] == 0
    assert taken == sorted(set(taken))


def test_parts_cover_the_queue_once_in_order_of_age():
    lengths = [1024, 256, 4000, 1024, 300, 64, 2048, 1024, 900]
    batches = bk.parts(lengths, lambda q: bk.take(q, K3_BUCKETS, 64, 4096))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert [b[0] for b in batches] == sorted(
        b[0] for b in batches
    )  # each starts with the oldest left
    assert all(sum(lengths[i] for i in b) <= 4096 for b in batches)


def test_filling_pads_mixed_queues_less_than_taking_their_head():
    """Queues of 1 to 20 images drawn from a mix (448 x 448 photos, a large one, 4:3 and
    small ones; seeded): padding rows per real row when each queue is cut into batches
    that fill the buckets, against batches of the queue's head (the budget 16384)."""
    rng = random.Random(0)
    mix = [1024] * 6 + [4096, 10000, 960, 320, 720, 256]
    queues = [[rng.choice(mix) for _ in range(rng.randint(1, 20))] for _ in range(500)]

    def share(take_next) -> float:
        real = rows = 0
        for sizes in queues:
            real += sum(sizes)
            for batch in bk.parts(sizes, take_next):
                rows += bk.bucket_for(sum(sizes[i] for i in batch), K3_BUCKETS)
        return (rows - real) / real

    filled = share(lambda q: bk.take(q, K3_BUCKETS, 64, 16384))
    head = share(lambda q: bk.fifo(q, 16384, 64))
    assert filled <= 0.15
    assert head >= 0.2


# ----------------------------------------------------------------------------- features

# name: (buckets, images per bucket, grids, the bucket expected or None: eager)
EDGES = {
    "fills a bucket": ((16, 64), 8, [(1, 4, 4)], 16),
    "one patch over a bucket": ((15, 64), 8, [(1, 4, 4)], 64),
    "one patch over the largest": ((15,), 8, [(1, 4, 4)], None),
    "one image in a bucket": ((64,), 8, [(1, 2, 2)], 64),
    "several images": ((64, 256), 8, [(1, 4, 4), (1, 2, 6), (1, 2, 2)], 64),
    "several images fill a bucket": ((32, 64), 8, [(1, 4, 4), (1, 2, 8)], 32),
    "more images than a bucket holds": ((64,), 2, [(1, 2, 2)] * 3, None),
    "as many images as it holds": ((64,), 3, [(1, 2, 2)] * 3, 64),
    "frames": ((64,), 8, [(2, 2, 4), (1, 2, 2)], 64),
    "a large batch": ((512, 2048), 8, [(1, 30, 22), (1, 16, 16), (1, 8, 12)], 2048),
    "padding in several segments": ((1024,), 8, [(1, 8, 8), (1, 4, 6)], 1024),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("buckets", "max_images", "grids", "bucket"), EDGES.values(), ids=EDGES)
def test_padded_bucket_matches_the_unpadded_batch(buckets, max_images, grids, bucket, dtype):
    model = random_model(TINY, seed=2, device="cpu", dtype=dtype)
    runner = bk.BucketRunner(model, buckets, max_images, capture=False)
    pixels = pixels_of(grids)
    other = [(1, 2, 4)]
    with torch.inference_mode():
        want = model(pixels, grids)
        got = runner(pixels, grids)
        info = runner.info()
        runner(pixels_of(other, 1), other)  # another batch in the same buffers between
        again = runner(pixels, grids)
    assert_close_across_rows(got, want)
    assert torch.equal(again, got)  # the same bucket, the same rows: bit for bit
    assert info["bucket_batches"] == ({str(bucket): 1} if bucket else {})
    assert info["eager_batches"] == (0 if bucket else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_paddings_of_one_bucket_are_bitwise_equal(dtype):
    """The same images in the same bucket, their padding in segments of 16 rows or in one
    segment (the layout before padding was cut): the features are the same bits."""
    model = random_model(TINY, seed=2, device="cpu", dtype=dtype)
    runner = bk.BucketRunner(model, (256,), 8, capture=False)
    grids = [(1, 6, 4), (1, 2, 2)]
    pixels = pixels_of(grids, 3)
    (bucket,) = runner.buckets
    assert bucket.chunk == 128
    assert len(bucket.layout([24, 4])) == 4
    with torch.inference_mode():
        chunked = runner(pixels, grids)
        bucket.chunk = 256  # the whole padding one segment
        assert len(bucket.layout([24, 4])) == 3
        whole = runner(pixels, grids)
    assert torch.equal(chunked, whole)


def test_a_bucket_forgets_the_batch_before(encoder_in, oracle_dir):
    """A small batch after a large one in the same bucket: its padding rows held the large
    batch's data, and its features are those of the small batch in a fresh bucket, bit
    for bit, and the unpadded batch's within the tolerance."""
    encoder = encoder_in(oracle_dir / "checkpoint", "padded")
    large, small = [(1, 30, 22), (1, 16, 16)], [(1, 4, 6), (1, 30, 8)]
    fresh = bk.BucketRunner(encoder.model, encoder.execution.run.sizes, 8, capture=False)
    with torch.inference_mode():
        first = fresh(pixels_of(small, 2), small)
        encoder.execution(pixels_of(large, 1), large)
        got = encoder.execution(pixels_of(small, 2), small)
        want = encoder.model(pixels_of(small, 2), small)
    assert torch.equal(got, first)
    assert_close_across_rows(got, want)


def test_runner_counts_padding():
    model = random_model(TINY, seed=2, device="cpu", dtype=torch.float32)
    runner = bk.BucketRunner(model, (64, 256), 8, capture=False)
    with torch.inference_mode():
        for grids in ([(1, 4, 4)] * 3, [(1, 8, 8)], [(1, 16, 18)]):  # 48 in 64, 64 in 64, eager
            runner(pixels_of(grids), grids)
    info = runner.info()
    assert info["bucket_batches"] == {"64": 2}
    assert info["eager_batches"] == 1
    assert (info["real_rows"], info["padded_rows"]) == (112, 16)
    assert info["padding_share"] == round(16 / 112, 4) == round(runner.padding_share, 4)
