"""``EncoderRank``: one vision-data-parallel rank holding one ``VisionEncoder``."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch

from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.items import EncoderItem

from .batcher import BatchingConfig, RankBatcher, raise_first_error
from .metrics import RankMetrics

log = logging.getLogger("ray.serve")


class EncoderRank:
    """Encodes the items this rank owns and returns float32 numpy features.

    The rank index is a constructor argument (one deployment per rank), so it is
    known in every mode, including Serve's local testing mode. Images of
    concurrent calls are batched together, cached and counted as outstanding
    work by a ``RankBatcher`` (deployments/batcher.py).
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
        batching: BatchingConfig | None = None,
    ):
        self.rank = rank
        self.num_threads = max(1, int(num_cpus))
        torch.set_num_threads(self.num_threads)
        started = time.perf_counter()
        self.encoder = VisionEncoder.from_pretrained(
            checkpoint, device=device, dtype=dtype, backend=backend, seed=seed
        )
        self.batcher = RankBatcher(self.encoder, batching or BatchingConfig(), self.num_threads)
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

    async def encode(
        self,
        indices: Sequence[int],
        items: Sequence[EncoderItem],
        sent_at: float | None = None,
        caller: str = "",
    ) -> dict:
        """Features of ``items`` (one contiguous float32 array each, input order).

        ``indices`` are the request's item indices, used only to name a bad item;
        ``sent_at`` is the caller's ``time.time()`` when it sent them (queue wait);
        ``caller`` names the ingress replica in this rank's load report.
        """
        assert len(indices) == len(items), (len(indices), len(items))
        self.calls += 1
        self.items += len(items)
        self.patches += sum(item.num_patches for item in items)
        started = time.perf_counter()
        stages: dict[str, float] = {}
        if sent_at is not None:  # wall clocks of two processes: clamp a skew to 0
            stages["queue_wait"] = max(0.0, time.time() - sent_at) * 1e3
        results, batch_stages = await self.batcher.encode(items, caller)
        stages["queue_wait"] = stages.get("queue_wait", 0.0) + batch_stages.pop("queue_wait")
        stages.update(batch_stages)
        arrays = raise_first_error(results, indices)
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
            "load": self.batcher.load(),  # saves the ingress a poll
        }

    async def load(self) -> dict:
        """Outstanding work by caller and the fitted cost model (polled by the ingress)."""
        return self.batcher.load()

    def info(self) -> dict:
        return {
            **self.encoder.info(),
            "rank": self.rank,
            "state": "ready",
            "pid": os.getpid(),
            "load_s": round(self.load_s, 3),
            "calls": self.calls,
            "items": self.items,
            "patches": self.patches,
            **self.batcher.info(),  # num_threads: as the encode thread sees it
        }

    def check_health(self) -> None:
        """Cheap liveness check: the model is loaded."""
        if self.encoder is None:
            raise RuntimeError(f"rank {self.rank} has no encoder loaded")
