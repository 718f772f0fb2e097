"""A rank's batcher without Ray: cross-call batching, the pipeline, the cache, feature
dtypes, cancellation, load reports, thread count.

The batcher is the rank's engine (deployments/batcher.py); these tests drive it with
the real tiny encoder on an asyncio loop, as the rank's replica does. Where work must
overlap, a ``GatedEncoder`` (the real encoder whose forward waits on a gate the test
opens) holds a batch in its forward instead of relying on a time window.
tests/serve/test_throughput.py checks the same behaviour over HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
import torch
from images import gray_png, image_bytes

from deployments.args import BatchingArgs
from deployments.batcher import RankBatcher
from deployments.batching import NOT_CACHED
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.execution import BucketRunner, Execution
from kimi_encoder.items import EncoderInputError
from kimi_encoder.load import Work

SIZES = [(64, 48), (120, 90), (40, 40), (90, 45), (30, 150), (150, 30)]
BOUND_S = 30  # generous bound of every wait on a gate: never a timing assumption
F32 = "float32"  # the tiny CPU encoder's own dtype: its features as it computes them


class GatedEncoder(VisionEncoder):
    """The tiny encoder; while ``hold`` is set, each forward waits for ``release``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hold = threading.Event()
        self.release = threading.Event()
        self.in_forward = threading.Event()
        self.prepared: list[threading.Event] = []  # one per prepare call, set when done
        self.forwards = 0
        self.decode_gate = threading.Event()  # cleared: every prepare waits for it
        self.decode_gate.set()
        self.decoding = threading.Event()

    def prepare(self, item):
        done = threading.Event()
        self.prepared.append(done)
        self.decoding.set()
        assert self.decode_gate.wait(BOUND_S), "the test never opened the decode gate"
        try:
            return super().prepare(item)
        finally:
            done.set()

    def forward(self, pixels, items):
        self.forwards += 1
        if self.hold.is_set():
            self.in_forward.set()
            assert self.release.wait(BOUND_S), "the test never released the forward"
        return super().forward(pixels, items)


@pytest.fixture(scope="module")
def encoder() -> GatedEncoder:
    return GatedEncoder.from_pretrained("tiny", device="cpu", backend="cpu")


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [image_bytes("RGBA" if i % 2 else "RGB", s, seed=i) for i, s in enumerate(SIZES)]


def batcher(encoder, keep=None, cache_bytes=0, calibration_grids=(), **batching) -> RankBatcher:
    encoder.hold.clear()
    encoder.release.clear()
    encoder.in_forward.clear()
    config = BatchingArgs(**{"max_batch_wait_ms": 0.0, **batching})
    return RankBatcher(
        encoder,
        config,
        num_threads=1,
        cache_bytes=cache_bytes,
        calibration_grids=calibration_grids,
        keep=keep,
    )


def one_at_a_time(encoder, items) -> list[np.ndarray]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [VisionEncoder.encode(encoder, [item])[0].float().numpy() for item in items]
    finally:
        torch.set_num_threads(before)


async def behind_a_held_forward(b: RankBatcher, encoder: GatedEncoder, first, calls):
    """``first`` runs a forward that holds; ``calls`` queue behind it; then release."""
    encoder.hold.set()
    blocker = asyncio.ensure_future(b.encode(first, "blocker", F32))
    assert await asyncio.to_thread(encoder.in_forward.wait, BOUND_S)
    tasks = [asyncio.ensure_future(call) for call in calls]
    while b.load().by_caller.keys() <= {"blocker"}:  # the calls have queued their images
        await asyncio.sleep(0)
    encoder.hold.clear()
    encoder.release.set()
    return await blocker, await asyncio.gather(*tasks)


def test_calls_queued_together_share_one_forward_and_match_unbatched(encoder, images):
    b = batcher(encoder)
    calls = [[encoder.plan(images[0]), encoder.plan(images[1])], [encoder.plan(images[2])]]
    calls.append([encoder.plan(images[3])])
    coros = [b.encode(items, f"c{i}", F32) for i, items in enumerate(calls)]
    _, outputs = asyncio.run(behind_a_held_forward(b, encoder, [encoder.plan(images[4])], coros))
    assert b.counters.batches == 2
    assert b.counters.max_batch_calls == 3
    assert b.counters.max_batch_images == 4
    assert b.counters.forwarded == 5
    for items, (results, stages) in zip(calls, outputs, strict=True):
        assert set(stages) == {"queue_wait", "preprocess", "forward"}
        for got, want in zip(results, one_at_a_time(encoder, items), strict=True):
            assert got.dtype == torch.float32
            assert got.is_contiguous()
            np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-5)


def test_next_batch_decodes_while_a_forward_runs(encoder, images):
    """The host stage of images queued behind a running forward finishes before that
    forward does: decode of batch k+1 overlaps the forward of batch k."""
    b = batcher(encoder)

    async def run():
        forwards = encoder.forwards
        encoder.hold.set()
        first = asyncio.ensure_future(b.encode([encoder.plan(images[0])], "a", F32))
        assert await asyncio.to_thread(encoder.in_forward.wait, BOUND_S)
        start = len(encoder.prepared)
        second = asyncio.ensure_future(b.encode([encoder.plan(d) for d in images[1:4]], "b", F32))
        while len(encoder.prepared) < start + 3:
            await asyncio.sleep(0)
        for done in encoder.prepared[start:]:  # decoded while batch 1 is held in its forward
            assert await asyncio.to_thread(done.wait, BOUND_S)
        assert not first.done()
        assert encoder.forwards == forwards + 1
        encoder.hold.clear()
        encoder.release.set()
        return await first, await second

    (one, _), (three, _) = asyncio.run(run())
    assert len(one) == 1
    assert len(three) == 3
    assert b.counters.batches == 2


def test_patch_budget_splits_batches(encoder, images):
    items = [encoder.plan(data) for data in images[:4]]
    largest = max(item.num_patches for item in items)
    b = batcher(encoder, max_batch_patches=largest)
    coros = [b.encode([item], "c", F32) for item in items]
    asyncio.run(behind_a_held_forward(b, encoder, [encoder.plan(images[4])], coros))
    groups, used = 0, largest  # first in, first out, each batch within the budget
    for item in items:
        if used + item.num_patches > largest:
            groups, used = groups + 1, 0
        used += item.num_patches
    assert groups >= 2
    assert b.counters.forwarded == 5
    assert b.counters.batches == 1 + groups


def test_with_buckets_a_batch_fills_one(images):
    """The graphs mode's buckets (64 and 128 patches, run without capture): queued images
    of 80, 64 and 48 patches run as 80 + 48 (the 128 bucket full), then 64 (the 64 bucket
    full), not first in, first out (80 alone, padded by 48, then 64 + 48, padded by 16);
    the features are those of each image alone (other row counts: within 1e-4)."""
    encoder = GatedEncoder.from_pretrained("tiny", device="cpu", backend="cpu")
    runner = BucketRunner(encoder.model, (64, 128), 8, capture=False)
    encoder.execution = Execution("graphs", runner, {})
    b = batcher(encoder, max_batch_patches=128)
    data = [
        image_bytes("RGB", size, seed=i)
        for i, size in enumerate([(120, 90), (112, 112), (30, 150)])
    ]
    items = [encoder.plan(d) for d in data]
    assert [item.num_patches for item in items] == [80, 64, 48]
    coros = [b.encode([item], f"c{i}", F32) for i, item in enumerate(items)]
    blocker = [encoder.plan(images[2])]  # 16 patches, in the 64 bucket
    _, outputs = asyncio.run(behind_a_held_forward(b, encoder, blocker, coros))
    info = encoder.execution.info()
    assert info["bucket_batches"] == {"64": 2, "128": 1}
    assert (info["real_rows"], info["padded_rows"]) == (16 + 128 + 64, 48)
    with torch.inference_mode():  # the eager model, each image alone
        alone = [encoder.model(encoder.materialize([i])[0], [i.grid]) for i in items]
    for (results, _), want in zip(outputs, alone, strict=True):
        np.testing.assert_allclose(results[0].numpy(), want.numpy(), rtol=0, atol=1e-4)


def test_cache_hit_skips_preprocessing_and_forward(encoder, images):
    b = batcher(encoder, cache_bytes=1 << 20)
    item = encoder.plan(images[0])
    (first,), _ = asyncio.run(b.encode([item], "c", F32))
    assert (b.counters.preprocessed, b.counters.forwarded, b.counters.cache_hits) == (1, 1, 0)
    (again,), _ = asyncio.run(b.encode([encoder.plan(images[0])], "c", F32))
    assert (b.counters.preprocessed, b.counters.forwarded, b.counters.cache_hits) == (1, 1, 1)
    assert again is first  # the cached buffer itself: no copy on the way in or out


def test_an_image_sent_by_digest_is_a_hit_or_asked_for_again(encoder, images):
    """Without its bytes, an image is answered from the cache, joins its own copy in
    flight, or is answered NOT_CACHED (evicted): never encoded from nothing, never an
    error."""
    b = batcher(encoder, cache_bytes=1 << 20, keep=lambda t: t.clone())
    item = encoder.plan(images[0])
    (first,), _ = asyncio.run(b.encode([item], "c", F32))
    (hit, missing), _ = asyncio.run(
        b.encode(
            [encoder.plan(images[0]).by_digest(), encoder.plan(images[2]).by_digest()], "c", F32
        )
    )
    assert hit is first  # what keep made of it, as the cache keeps it
    assert missing is NOT_CACHED
    counters = b.counters
    assert (counters.by_digest, counters.not_cached, counters.cache_hits) == (2, 1, 1)
    assert (counters.preprocessed, counters.forwarded) == (1, 1)
    b.cache.clear()  # evicted
    (gone,), _ = asyncio.run(b.encode([encoder.plan(images[0]).by_digest()], "c", F32))
    assert gone is NOT_CACHED
    assert counters.not_cached == 2

    async def joined():  # its copy with bytes is in the forward: it waits for that one
        encoder.hold.set()
        full = asyncio.ensure_future(b.encode([encoder.plan(images[0])], "a", F32))
        assert await asyncio.to_thread(encoder.in_forward.wait, BOUND_S)
        light = asyncio.ensure_future(b.encode([encoder.plan(images[0]).by_digest()], "b", F32))
        while counters.joined_in_flight == 0:
            await asyncio.sleep(0)
        encoder.hold.clear()
        encoder.release.set()
        return await full, await light

    ((a,), _), ((c,), _) = asyncio.run(joined())
    assert a is c  # one forward for both calls
    assert torch.equal(a, first)


def test_an_item_without_bytes_or_digest_cannot_go_by_digest(encoder, images):
    item = encoder.plan(images[0])
    light = item.by_digest()
    assert light.image is None
    assert light.sent_by_digest
    assert item.image is not None  # the original keeps its bytes
    assert light.image_digest() == item.image_digest()
    with pytest.raises(ValueError, match="only an image item with its bytes"):
        light.by_digest()


def test_transposed_image_and_background_change_miss(encoder, images):
    b = batcher(encoder, cache_bytes=1 << 20)
    raw = np.random.default_rng(0).integers(0, 256, 30 * 150, dtype=np.uint8).tobytes()
    tall, wide = (encoder.plan(gray_png(raw, size)) for size in ((30, 150), (150, 30)))
    (f_tall, f_wide), _ = asyncio.run(b.encode([tall, wide], "c", F32))
    assert b.counters.cache_hits == 0
    assert b.counters.forwarded == 2
    assert f_tall.shape != f_wide.shape or not torch.equal(f_tall, f_wide)

    rgba = encoder.plan(images[1])  # RGBA: the background shows
    asyncio.run(b.encode([rgba], "c", F32))
    white = dataclasses.replace(
        rgba,
        deferred=dataclasses.replace(rgba.deferred, transparent_bg_config={"pattern": "white"}),
    )
    (f_white,), _ = asyncio.run(b.encode([white], "c", F32))
    assert b.counters.cache_hits == 0
    assert b.counters.forwarded == 4
    (f_again,), _ = asyncio.run(b.encode([encoder.plan(images[1])], "c", F32))
    assert b.counters.cache_hits == 1
    assert not torch.equal(f_again, f_white)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_feature_dtype_is_the_float32_features_rounded(encoder, images, dtype):
    """Cast on the device before the copy: equal to the float32 features rounded to the
    dtype; the cache keeps each dtype apart."""
    b = batcher(encoder, cache_bytes=1 << 20)
    item = encoder.plan(images[2])
    (full,), _ = asyncio.run(b.encode([item], "c", F32))
    (low,), _ = asyncio.run(b.encode([encoder.plan(images[2])], "c", dtype))
    assert low.dtype == getattr(torch, dtype)
    assert b.counters.cache_hits == 0
    assert torch.equal(low, full.to(low.dtype))
    (again,), _ = asyncio.run(b.encode([encoder.plan(images[2])], "c", dtype))
    assert again is low
    assert b.counters.cache_hits == 1


def test_duplicates_in_flight_are_encoded_once(encoder, images):
    b = batcher(encoder, cache_bytes=1 << 20)
    coros = [b.encode([encoder.plan(images[1])], f"c{i}", F32) for i in range(3)]
    _, outputs = asyncio.run(behind_a_held_forward(b, encoder, [encoder.plan(images[0])], coros))
    assert b.counters.forwarded == 2
    assert b.counters.joined_in_flight == 2
    for (result,), _ in outputs[1:]:
        assert result is outputs[0][0][0]


def test_a_cancelled_call_takes_back_its_queued_images(encoder, images):
    """Images nobody waits for any more never reach the tower; a shared one still does."""
    b = batcher(encoder, cache_bytes=1 << 20)

    async def run():
        encoder.hold.set()
        first = asyncio.ensure_future(b.encode([encoder.plan(images[0])], "a", F32))
        assert await asyncio.to_thread(encoder.in_forward.wait, BOUND_S)
        gone = asyncio.ensure_future(b.encode([encoder.plan(d) for d in images[1:4]], "gone", F32))
        stays = asyncio.ensure_future(b.encode([encoder.plan(images[3])], "stays", F32))
        while set(b.load().by_caller) != {"a", "gone"}:
            await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        during = b.load().by_caller
        encoder.hold.clear()
        encoder.release.set()
        return during, await first, await stays

    during, _, (shared, _) = asyncio.run(run())
    assert set(during) == {"a", "gone"}  # "gone" keeps only the image "stays" awaits
    assert during["gone"] == Work.of([encoder.plan(images[3]).num_patches])
    assert b.counters.dropped == 2
    assert b.counters.forwarded == 2
    assert b.load().by_caller == {}
    assert not b._in_flight
    assert shared[0].shape[0] > 0


def test_images_taken_back_while_their_batch_decodes_never_reach_the_tower(encoder, images):
    b = batcher(encoder)

    async def run():
        forwards = encoder.forwards
        encoder.decoding.clear()
        encoder.decode_gate.clear()
        call = asyncio.ensure_future(b.encode([encoder.plan(images[5])], "gone", F32))
        assert await asyncio.to_thread(encoder.decoding.wait, BOUND_S)
        while not b._drain or b._queue:  # the drain has taken it and waits for its decode
            await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        encoder.decode_gate.set()
        (after,), _ = await b.encode([encoder.plan(images[0])], "next", F32)
        return forwards, after

    try:
        forwards, after = asyncio.run(run())
    finally:
        encoder.decode_gate.set()
    assert b.counters.dropped == 1
    assert encoder.forwards == forwards + 1
    assert b.load().by_caller == {}
    assert after.shape[0] > 0


def test_bad_image_fails_only_its_own_call(encoder, images):
    b = batcher(encoder)
    good, bad = encoder.plan(images[0]), encoder.plan(images[1])
    bad.image = bad.image[: len(bad.image) // 2]  # header intact, body cut
    coros = [b.encode([good], "a", F32), b.encode([bad], "b", F32)]
    _, ((ok, _), (failed, _)) = asyncio.run(
        behind_a_held_forward(b, encoder, [encoder.plan(images[2])], coros)
    )
    assert isinstance(ok[0], torch.Tensor)
    assert b.counters.max_batch_images == 2
    assert isinstance(failed[0], EncoderInputError)


def test_load_report_counts_queued_work_by_caller(encoder, images):
    b = batcher(encoder)
    items = [encoder.plan(data) for data in images[:3]]

    async def run():
        encoder.hold.set()
        task = asyncio.ensure_future(b.encode(items[:2], "ingress-a", F32))
        assert await asyncio.to_thread(encoder.in_forward.wait, BOUND_S)
        other = asyncio.ensure_future(b.encode(items[2:], "ingress-b", F32))
        while "ingress-b" not in b.load().by_caller:
            await asyncio.sleep(0)
        report = b.load()
        encoder.hold.clear()
        encoder.release.set()
        await asyncio.gather(task, other)
        return report, b.load()

    during, after = asyncio.run(run())
    assert during.by_caller == {
        "ingress-a": Work.of(i.num_patches for i in items[:2]),
        "ingress-b": Work.of([items[2].num_patches]),
    }
    assert after.by_caller == {}
    assert during.cost_model == b.cost_model


def test_forward_thread_uses_the_allotted_threads(encoder):
    b = RankBatcher(encoder, BatchingArgs(), num_threads=2)
    assert b.worker_threads == 2
    assert b.info()["num_threads"] == 2


def test_calibration_fits_a_cost_that_never_falls(encoder):
    b = batcher(encoder, calibration_grids=(4, 8, 16))
    model = b.cost_model
    # non-negative terms: never decreasing (strictly growing is a timing, not a property)
    assert min(model.a, model.b, model.c) >= 0
    assert model(256) >= model(16) > 0
    assert b.info()["cost_model"]["grids"] == [4, 8, 16]


def test_bad_config_is_refused(encoder):
    with pytest.raises(ValueError, match="max_batch_patches\n  Input should be greater than or"):
        batcher(encoder, max_batch_patches=0)
    with pytest.raises(ValueError, match="max_batch_wait_ms\n  Input should be greater than or"):
        batcher(encoder, max_batch_wait_ms=-1)


def test_a_cache_larger_than_half_its_object_store_is_refused():
    from deployments.rank import check_cache_fits

    check_cache_fits(0, 256 << 20, 1 << 30)  # fits
    check_cache_fits(0, 256 << 20, None)  # Ray did not say: nothing to check
    with pytest.raises(ValueError, match="more than half") as refused:
        check_cache_fits(3, 600 << 20, 1 << 30)
    message = str(refused.value)
    assert "rank 3: ranks.cache_bytes=629145600" in message
    assert "(1073741824 bytes)" in message
    assert "--object-store-memory" in message
    check_cache_fits(0, 256 << 20, 1 << 30, ingress_share=256 << 20)  # 512 MiB: fits
    with pytest.raises(ValueError, match="more than half") as refused:
        check_cache_fits(1, 256 << 20, 1 << 30, ingress_share=300 << 20)
    message = str(refused.value)
    assert "ranks.cache_bytes=268435456 plus ingress.replicas x ingress.cache_bytes=" in message
    assert "ingress.cache_bytes, or start Ray" in message


def test_a_failing_keep_fails_only_its_image(encoder, images):
    def keep(features):
        if features.shape[0] == first_tokens:
            raise MemoryError("object store full")
        return features

    first = encoder.plan(images[0])
    first_tokens = encoder.vision.num_tokens(first.grid)
    other = encoder.plan(images[1])
    assert encoder.vision.num_tokens(other.grid) != first_tokens
    b = batcher(encoder, cache_bytes=1 << 20, keep=keep)
    (failed, kept), _ = asyncio.run(b.encode([first, other], "c", F32))
    assert isinstance(failed, MemoryError)
    assert isinstance(kept, torch.Tensor)
    assert b.cache.stats.entries == 1  # only the kept one is cached
