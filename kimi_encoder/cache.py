"""Feature cache: full-length content keys and a byte-bounded LRU.

``item_key`` is the one key of an image's features, wherever they are kept or
looked for: the ranks' caches, the ingress's cache and its record of which rank
holds what. It covers everything that changes an item's features: the model (its
name), the dtype it computes in and the dtype the features are delivered in, the
item's grid, and either the original file bytes (as their SHA-256, computed once
per item and carried with it from the ingress to the rank; all a rank gets of an
image its cache holds) with the whole deferred-preprocessing record (backend,
normalization, background, resize) and the image size, or the pixel tensor's
dtype, shape and bytes. Fields are length-prefixed before hashing, so no two
different inputs share a byte stream; the digest is the full SHA-256, never
truncated and never Python's per-process ``hash()``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .items import EncoderItem


def _field(h, tag: str, payload: bytes) -> None:
    h.update(tag.encode())
    h.update(len(payload).to_bytes(8, "little"))
    h.update(payload)


def item_key(item: EncoderItem, model: str, model_dtype: str, feature_dtype: str) -> str:
    """Full-length hex digest identifying the features of ``item`` encoded by ``model``
    (its name, as ``config.resolve_configs`` gives it) computing in ``model_dtype`` and
    delivered in ``feature_dtype``."""
    h = hashlib.sha256()
    _field(h, "model", model.encode())
    _field(h, "model-dtype", model_dtype.encode())
    _field(h, "feature-dtype", feature_dtype.encode())
    _field(h, "grid", json.dumps(item.grid_thws.tolist()).encode())
    if item.pixel_values is not None:
        pixels = item.pixel_values.detach().contiguous().cpu()
        _field(h, "pixel-meta", f"{pixels.dtype}{tuple(pixels.shape)}".encode())
        _field(h, "pixels", pixels.view(torch.uint8).numpy().tobytes())
    else:
        if item.deferred is None or (item.image is None and not item.sent_by_digest):
            raise ValueError("cannot key an image item without its bytes and deferred record")
        _field(h, "image-sha256", item.image_digest())
        _field(h, "size", json.dumps(item.original_size).encode())
        _field(h, "preprocess", json.dumps(item.deferred, default=vars, sort_keys=True).encode())
    return h.hexdigest()


Features = torch.Tensor | np.ndarray

# Most entries a feature cache keeps by default (FeatureCache's doc says why).
MAX_ENTRIES = 1024


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


class FeatureCache:
    """Thread-safe LRU of feature arrays (torch tensors or numpy arrays), bounded in bytes
    (0 disables it) and in entries. Entries are handed out as they are, shared: never
    modify one.

    The entry bound caps what the cache costs besides the features' bytes: each entry's
    key and record (and, in a rank, its object-store reference: about 2 KiB of Ray's
    bookkeeping) live on the heap among each request's short-lived allocations, so a
    cache that is still filling keeps pages of the heap from being given back. Small
    features (a small model, thumbnails) reach the entry bound long before the byte bound
    (docs/benchmarks.md, Soak)."""

    def __init__(self, max_bytes: int, max_entries: int = MAX_ENTRIES):
        if max_bytes < 0:
            raise ValueError(f"cache max_bytes must be >= 0, got {max_bytes}.")
        if max_entries < 1:
            raise ValueError(f"cache max_entries must be >= 1, got {max_entries}.")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._data: OrderedDict[str, Features] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key: str) -> Features | None:
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self._data.move_to_end(key)
            self.stats.hits += 1
            return value

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def put(self, key: str, value: Features) -> None:
        size = value.nbytes
        if size > self.max_bytes:
            return
        if isinstance(value, np.ndarray):
            value.setflags(write=False)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.stats.bytes -= old.nbytes
            self._data[key] = value
            self.stats.bytes += size
            while self.stats.bytes > self.max_bytes or len(self._data) > self.max_entries:
                _, evicted = self._data.popitem(last=False)
                self.stats.bytes -= evicted.nbytes
                self.stats.evictions += 1
            self.stats.entries = len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.stats.bytes = self.stats.entries = 0
