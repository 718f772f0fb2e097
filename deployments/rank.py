"""``EncoderRank``: one vision-data-parallel rank holding one ``VisionEncoder``."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.items import EncoderInputError, EncoderItem

from .metrics import RankMetrics

log = logging.getLogger("ray.serve")


class EncoderRank:
    """Encodes the items this rank owns, in one call, and returns float32 numpy features.

    The rank index is a constructor argument (one deployment per rank), so it is
    known in every mode, including Serve's local testing mode.
    """

    def __init__(
        self,
        rank: int,
        checkpoint: str,
        *,
        device: str,
        dtype: str,
        backend: str,
        seed: int,
        num_cpus: float,
    ):
        self.rank = rank
        self.num_threads = max(1, int(num_cpus))
        torch.set_num_threads(self.num_threads)
        started = time.perf_counter()
        self.encoder = VisionEncoder.from_pretrained(
            checkpoint, device=device, dtype=dtype, backend=backend, seed=seed
        )
        self.load_s = time.perf_counter() - started
        self.calls = 0
        self.items = 0
        self.patches = 0
        self.metrics = RankMetrics(rank)
        log.info(
            "rank %d ready: %s on %s in %.1f s",
            rank,
            self.encoder.name,
            self.encoder.device,
            self.load_s,
        )

    def encode(
        self, indices: Sequence[int], items: Sequence[EncoderItem], sent_at: float | None = None
    ) -> dict:
        """Features of ``items`` (one contiguous float32 array each, input order).

        ``indices`` are the request's item indices, used only to name a bad item;
        ``sent_at`` is the caller's ``time.time()`` when it sent them (queue wait).
        """
        assert len(indices) == len(items), (len(indices), len(items))
        self.calls += 1
        self.items += len(items)
        self.patches += sum(item.num_patches for item in items)
        started = time.perf_counter()
        stages: dict[str, float] = {}
        if sent_at is not None:  # wall clocks of two processes: clamp a skew to 0
            stages["queue_wait"] = max(0.0, time.time() - sent_at) * 1e3
        try:
            pixels = self.encoder.materialize(items)
            materialized = time.perf_counter()
            features = self.encoder.forward(pixels, items)
            stages["preprocess"] = (materialized - started) * 1e3
            stages["forward"] = (time.perf_counter() - materialized) * 1e3
        except EncoderInputError as exc:
            # type(exc): a LimitExceededError stays one (413), with the culprit named.
            raise type(exc)(str(exc), self._culprit(indices, items)) from None
        arrays = [
            np.ascontiguousarray(f.detach().to("cpu", torch.float32).numpy()) for f in features
        ]
        backend = next((i.deferred.backend for i in items if i.deferred is not None), "none")
        patches, tokens = sum(i.num_patches for i in items), sum(len(a) for a in arrays)
        self.metrics.encoded(len(items), patches, tokens, backend, stages)
        log.info(
            "rank %d encoded %d images (%d patches, %d tokens, %s backend) in %s ms",
            self.rank,
            len(items),
            patches,
            tokens,
            backend,
            {k: round(v, 2) for k, v in stages.items()},
            extra={"kimi_encoder_rank": {"rank": self.rank, "images": len(items), **stages}},
        )
        return {
            "rank": self.rank,
            "features": arrays,
            "encode_ms": (time.perf_counter() - started) * 1e3,
            "stages_ms": stages,
            "done_at": time.time(),
        }

    def _culprit(self, indices: Sequence[int], items: Sequence[EncoderItem]) -> int | None:
        """Request index of the first item whose pixels cannot be materialized (error path only)."""
        for index, item in zip(indices, items, strict=True):
            try:
                self.encoder.materialize([item])
            except EncoderInputError:
                return index
        return None

    def info(self) -> dict:
        return {
            **self.encoder.info(),
            "rank": self.rank,
            "state": "ready",
            "pid": os.getpid(),
            "num_threads": torch.get_num_threads(),
            "load_s": round(self.load_s, 3),
            "calls": self.calls,
            "items": self.items,
            "patches": self.patches,
        }

    def check_health(self) -> None:
        """Cheap liveness check: the model is loaded."""
        if self.encoder is None:
            raise RuntimeError(f"rank {self.rank} has no encoder loaded")
