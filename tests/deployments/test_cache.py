"""Feature cache keys cover everything that changes features; the LRU is bounded in bytes."""

import asyncio
import dataclasses
import pickle

import numpy as np
import pytest
import torch
from fakes import FakeRank
from images import gray_png

from deployments.args import BatchingArgs, DispatchArgs
from deployments.batcher import RankBatcher
from deployments.dispatch import HOLDERS_CAPACITY, Dispatcher, Plan
from deployments.ranks.roster import Roster
from kimi_encoder.cache import FeatureCache, item_key
from kimi_encoder.config import get_preset, resolve_configs
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.items import EncoderItem, plan_image

TINY = get_preset("tiny").preprocess


@pytest.fixture(scope="module")
def encoder():
    return VisionEncoder.from_pretrained("tiny", device="cpu", backend="cpu")


def test_transposed_shapes_same_bytes_differ(encoder):
    raw = np.random.default_rng(0).integers(0, 256, 30 * 150, dtype=np.uint8).tobytes()
    a = plan_image(gray_png(raw, (30, 150)), TINY, "cpu")
    b = plan_image(gray_png(raw, (150, 30)), TINY, "cpu")
    assert item_key(a, "m", "float32", "float32") != item_key(b, "m", "float32", "float32")
    fa, fb = encoder.encode([a, b])
    assert fa.shape != fb.shape or not torch.equal(fa, fb)


def test_key_follows_replaced_image_bytes():
    a = plan_image(gray_png(bytes(range(256)) * 4, (32, 32)), TINY, "cpu")
    key = item_key(a, "m", "float32", "float32")  # computes and keeps a's image digest
    b = dataclasses.replace(a, image=gray_png(bytes(range(255, -1, -1)) * 4, (32, 32)))
    assert item_key(b, "m", "float32", "float32") != key
    assert item_key(pickle.loads(pickle.dumps(a)), "m", "float32", "float32") == key


def test_pixel_tensor_shape_is_part_of_key():
    pixels = torch.randn(8, 3, 14, 14)
    a = EncoderItem(torch.tensor([[1, 2, 4]]), pixel_values=pixels)
    b = EncoderItem(torch.tensor([[1, 4, 2]]), pixel_values=pixels)
    assert item_key(a, "m", "float32", "float32") != item_key(b, "m", "float32", "float32")


@pytest.mark.parametrize(
    "change",
    [
        dict(backend="gpu"),
        dict(transparent_bg_config={"pattern": "white"}),
        dict(transparent_bg_config=None),
        dict(image_mean=(0.4, 0.5, 0.5)),
        dict(fill_stage="before_resize"),
    ],
    ids=["backend", "background", "no-background", "mean", "fill-stage"],
)
def test_preprocessing_config_changes_key(change):
    item = plan_image(gray_png(bytes(range(256)) * 4, (32, 32)), TINY, "cpu")
    other = dataclasses.replace(item, deferred=dataclasses.replace(item.deferred, **change))
    assert item_key(item, "m", "float32", "float32") != item_key(other, "m", "float32", "float32")


def test_model_and_dtypes_change_key():
    item = plan_image(gray_png(bytes(1024), (32, 32)), TINY, "cpu")
    dtypes = ("float32", "bfloat16")
    keys = {item_key(item, m, d, f) for m in ("a", "b") for d in dtypes for f in dtypes}
    assert len(keys) == 8
    assert all(len(k) == 64 for k in keys)  # full SHA-256


@pytest.mark.parametrize("feature_dtype", ["float32", "bfloat16"])
def test_the_ingress_and_the_rank_key_an_image_alike(encoder, feature_dtype):
    """The ingress's keys (cache affinity, its own cache) are the keys the rank's cache
    keeps the same images' features under."""
    images = [gray_png(bytes(range(i, 256)) * 4, (30, 30)) for i in range(3)]
    rank = RankBatcher(encoder, BatchingArgs(), 1, cache_bytes=1 << 20)
    asyncio.run(rank.encode([encoder.plan(image) for image in images], "c", feature_dtype))
    ingress = Dispatcher(
        Roster([FakeRank(0)], DispatchArgs()),
        DispatchArgs(),
        model_name=resolve_configs("tiny")[2],
        dtype="float32",
        cache_enabled=True,
    )
    keys = ingress.keys([plan_image(image, TINY, "cpu") for image in images], feature_dtype)
    assert rank.cache.stats.entries == 3
    assert all(key in rank.cache for key in keys)


def test_lru_bounded_in_bytes():
    cache = FeatureCache(max_bytes=3 * 400)
    for i in range(5):
        cache.put(f"k{i}", np.zeros(100, dtype=np.float32))  # 400 bytes each
    assert cache.stats.bytes == 1200
    assert cache.stats.entries == 3
    assert cache.stats.evictions == 2
    assert cache.get("k0") is None
    assert cache.get("k4") is not None
    cache.get("k2")  # touch: k3 becomes the oldest
    cache.put("k5", np.zeros(100, dtype=np.float32))
    assert "k3" not in cache
    assert "k2" in cache
    assert cache.stats.hits == 2
    assert cache.stats.misses == 1


def test_lru_bounded_in_entries_whatever_the_bytes():
    """Small features reach the entry bound first: past it the oldest go, bytes to spare."""
    cache = FeatureCache(max_bytes=1 << 20, max_entries=3)
    for i in range(7):
        cache.put(f"k{i}", np.zeros(4, dtype=np.float32))
        cache.get("k0")  # kept warm: the least recently used go, not the first put
    assert cache.stats.entries == 3
    assert cache.stats.bytes == 3 * 16
    assert cache.stats.evictions == 4
    assert [f"k{i}" in cache for i in range(7)] == [True, False, False, False, False, True, True]


def test_a_rank_keeps_at_most_cache_entries_images(encoder):
    """A rank's cache, filled past ``cache_entries`` with images whose features are far
    below ``cache_bytes``, keeps that many: the most recent."""
    images = [gray_png(bytes(range(i, 256)) * 4, (30, 30)) for i in range(5)]
    rank = RankBatcher(encoder, BatchingArgs(), 1, cache_bytes=1 << 20, cache_entries=2)
    for image in images:
        asyncio.run(rank.encode([encoder.plan(image)], "c", "float32"))
    stats = rank.info()["cache"]
    assert (stats["entries"], stats["max_entries"], stats["evictions"]) == (2, 2, 3)
    assert stats["bytes"] < stats["max_bytes"] // 100
    again = asyncio.run(rank.encode([encoder.plan(images[-1])], "c", "float32"))
    assert rank.info()["cache"]["hits"] == 1, again


def test_oversized_value_not_cached_and_values_read_only():
    cache = FeatureCache(max_bytes=100)
    cache.put("big", np.zeros(1000, dtype=np.float32))
    assert "big" not in cache
    cache.put("small", np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match="assignment destination is read-only"):
        cache.get("small")[0] = 1.0


def test_negative_size_rejected():
    with pytest.raises(ValueError, match="cache max_bytes must be >= 0"):
        FeatureCache(-1)
    with pytest.raises(ValueError, match="cache max_entries must be >= 1, got 0"):
        FeatureCache(1024, max_entries=0)


def test_the_ingress_remembers_at_most_holders_capacity_image_keys():
    """Cache affinity remembers which rank caches each image for the latest
    ``HOLDERS_CAPACITY`` keys: unique images without end keep it at that size."""
    dispatcher = Dispatcher(
        Roster([FakeRank(0)], DispatchArgs()),
        DispatchArgs(),
        model_name="tiny",
        dtype="float32",
        cache_enabled=True,
    )
    n = HOLDERS_CAPACITY + 100
    keys = [f"{i:064x}" for i in range(n)]
    plan = Plan([0] * n, {0: list(range(n))}, list(range(n)), keys, [], set())
    dispatcher.record(plan)
    assert len(dispatcher._holders) == HOLDERS_CAPACITY
    assert next(iter(dispatcher._holders)) == keys[100]  # the oldest were let go
    assert keys[-1] in dispatcher._holders
