"""A rank's batcher without Ray: cross-call batching, the cache, load reports, thread count.

The batcher is the rank's engine (deployments/batcher.py); these tests drive it
with the real tiny encoder on an asyncio loop, as the rank's replica does.
tests/serve/test_throughput.py checks the same behaviour over HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from images import gray_png, image_bytes

from deployments.batcher import BatchingConfig, RankBatcher
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.items import EncoderInputError
from kimi_encoder.load import Work

SIZES = [(64, 48), (120, 90), (40, 40), (90, 45), (30, 150), (150, 30)]


@pytest.fixture(scope="module")
def encoder() -> VisionEncoder:
    return VisionEncoder.from_pretrained("tiny", device="cpu", backend="cpu")


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [image_bytes("RGBA" if i % 2 else "RGB", s, seed=i) for i, s in enumerate(SIZES)]


def batcher(encoder, **config) -> RankBatcher:
    base = dict(max_batch_wait_ms=0.0, cache_bytes=0, calibration_grids=())
    return RankBatcher(encoder, BatchingConfig(**{**base, **config}), num_threads=1)


def one_at_a_time(encoder, items) -> list[np.ndarray]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [encoder.encode([item])[0].float().numpy() for item in items]
    finally:
        torch.set_num_threads(before)


def test_concurrent_calls_share_one_forward_and_match_unbatched(encoder, images):
    b = batcher(encoder, max_batch_wait_ms=200.0)
    calls = [[encoder.plan(images[0]), encoder.plan(images[1])], [encoder.plan(images[2])]]
    calls.append([encoder.plan(images[3])])

    async def run():
        return await asyncio.gather(*(b.encode(items, f"c{i}") for i, items in enumerate(calls)))

    outputs = asyncio.run(run())
    assert b.counters.batches == 1 and b.counters.max_batch_calls == 3
    assert b.counters.max_batch_images == 4 and b.counters.forwarded == 4
    for items, (results, stages) in zip(calls, outputs, strict=True):
        assert set(stages) == {"queue_wait", "preprocess", "forward"}
        for got, want in zip(results, one_at_a_time(encoder, items), strict=True):
            assert got.dtype == np.float32 and got.flags.c_contiguous
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_patch_budget_splits_batches(encoder, images):
    items = [encoder.plan(data) for data in images[:4]]
    largest = max(item.num_patches for item in items)
    b = batcher(encoder, max_batch_patches=largest, max_batch_wait_ms=100.0)

    async def run():
        return await asyncio.gather(*(b.encode([item], "c") for item in items))

    asyncio.run(run())
    assert b.counters.forwarded == 4 and b.counters.batches >= 2


def test_cache_hit_skips_preprocessing_and_forward(encoder, images):
    b = batcher(encoder, cache_bytes=1 << 20)
    item = encoder.plan(images[0])
    (first,), _ = asyncio.run(b.encode([item], "c"))
    assert (b.counters.preprocessed, b.counters.forwarded, b.counters.cache_hits) == (1, 1, 0)
    (again,), _ = asyncio.run(b.encode([encoder.plan(images[0])], "c"))
    assert (b.counters.preprocessed, b.counters.forwarded, b.counters.cache_hits) == (1, 1, 1)
    np.testing.assert_array_equal(first, again)


def test_transposed_image_and_background_change_miss(encoder, images):
    b = batcher(encoder, cache_bytes=1 << 20)
    raw = np.random.default_rng(0).integers(0, 256, 30 * 150, dtype=np.uint8).tobytes()
    tall, wide = (encoder.plan(gray_png(raw, size)) for size in ((30, 150), (150, 30)))
    (f_tall, f_wide), _ = asyncio.run(b.encode([tall, wide], "c"))
    assert b.counters.cache_hits == 0 and b.counters.forwarded == 2
    assert f_tall.shape != f_wide.shape or not np.array_equal(f_tall, f_wide)

    rgba = encoder.plan(images[1])  # RGBA: the background shows
    asyncio.run(b.encode([rgba], "c"))
    white = dataclasses.replace(
        rgba,
        deferred=dataclasses.replace(rgba.deferred, transparent_bg_config={"pattern": "white"}),
    )
    (f_white,), _ = asyncio.run(b.encode([white], "c"))
    assert b.counters.cache_hits == 0 and b.counters.forwarded == 4
    (f_again,), _ = asyncio.run(b.encode([encoder.plan(images[1])], "c"))
    assert b.counters.cache_hits == 1 and not np.array_equal(f_again, f_white)


def test_duplicates_in_flight_are_encoded_once(encoder, images):
    b = batcher(encoder, cache_bytes=1 << 20, max_batch_wait_ms=100.0)

    async def run():
        calls = [b.encode([encoder.plan(images[1])], f"c{i}") for i in range(3)]
        return await asyncio.gather(*calls)

    outputs = asyncio.run(run())
    assert b.counters.forwarded == 1 and b.counters.joined_in_flight == 2
    for (result,), _ in outputs[1:]:
        np.testing.assert_array_equal(result, outputs[0][0][0])


def test_bad_image_fails_only_its_own_call(encoder, images):
    b = batcher(encoder, max_batch_wait_ms=100.0)
    good, bad = encoder.plan(images[0]), encoder.plan(images[1])
    bad.image = bad.image[: len(bad.image) // 2]  # header intact, body cut

    async def run():
        return await asyncio.gather(b.encode([good], "a"), b.encode([bad], "b"))

    (ok, _), (failed, _) = asyncio.run(run())
    assert isinstance(ok[0], np.ndarray)
    assert isinstance(failed[0], EncoderInputError)


def test_load_report_counts_queued_work_by_caller(encoder, images):
    b = batcher(encoder, max_batch_wait_ms=300.0, max_batch_patches=1 << 20)
    items = [encoder.plan(data) for data in images[:3]]

    async def run():
        task = asyncio.ensure_future(b.encode(items[:2], "ingress-a"))
        other = asyncio.ensure_future(b.encode(items[2:], "ingress-b"))
        await asyncio.sleep(0.05)  # both queued, the batch window still open
        report = b.load()
        await asyncio.gather(task, other)
        return report, b.load()

    during, after = asyncio.run(run())
    assert during["by_caller"] == {
        "ingress-a": Work.of(i.num_patches for i in items[:2]).as_list(),
        "ingress-b": Work.of([items[2].num_patches]).as_list(),
    }
    assert after["by_caller"] == {}
    assert set(during["cost_model"]) == {"a", "b", "c"}


def test_forward_thread_uses_the_allotted_threads(encoder):
    b = RankBatcher(encoder, BatchingConfig(calibration_grids=()), num_threads=2)
    assert b.worker_threads == 2 and b.info()["num_threads"] == 2


def test_calibration_fits_a_cost_that_grows(encoder):
    b = batcher(encoder, calibration_grids=(4, 8, 16))
    model = b.cost_model
    # non-negative terms: never decreasing (strictly growing is a timing, not a property)
    assert min(model.a, model.b, model.c) >= 0 and model(256) >= model(16) > 0
    assert b.info()["cost_model"]["grids"] == [4, 8, 16]


def test_bad_config_is_refused(encoder):
    with pytest.raises(ValueError, match="max_batch_patches must be >= 1"):
        batcher(encoder, max_batch_patches=0)
