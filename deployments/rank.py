"""``EncoderRank``: one vision-data-parallel rank holding one ``VisionEncoder``."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import time
from collections.abc import Sequence

import numpy as np
import ray
import torch
from PIL import Image

from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.items import EncoderItem

from .batcher import BatchingConfig, RankBatcher, raise_first_error
from .leases import MemoryLeases, items_bytes
from .metrics import RankMetrics

log = logging.getLogger("ray.serve")


class EncoderRank:
    """Encodes the items this rank owns and returns float32 numpy features.

    The rank index is a constructor argument (one deployment per rank), so it is
    known in every mode, including Serve's local testing mode. Images of
    concurrent calls are batched together, cached and counted as outstanding
    work by a ``RankBatcher`` (deployments/batcher.py). Each call holds a memory
    lease for its images' bytes while it runs (deployments/leases.py), and the
    health check encodes a small synthetic image and compares it with the
    features the rank computed for it at start-up.
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
        max_inflight_bytes: int = 1 << 30,
        fault_injection: bool = False,
    ):
        self.rank = rank
        self.num_threads = max(1, int(num_cpus))
        torch.set_num_threads(self.num_threads)
        started = time.perf_counter()
        self.encoder = VisionEncoder.from_pretrained(
            checkpoint, device=device, dtype=dtype, backend=backend, seed=seed
        )
        self.batcher = RankBatcher(self.encoder, batching or BatchingConfig(), self.num_threads)
        vision = self.encoder.vision
        self.text_hidden, self.merge = vision.text_hidden_size, vision.merge_kernel_size[0]
        self.leases = MemoryLeases(max_inflight_bytes)
        self.fault_injection = fault_injection
        self.faults: dict[str, float | str] = {}
        self.probe_item = self.encoder.plan(_probe_image())
        self.probe_features = self.batcher.run_in_worker_sync(self._probe)
        self.health_checks = 0
        self.load_s = time.perf_counter() - started
        self.calls = 0
        self.items = 0
        self.patches = 0
        self.metrics = RankMetrics(rank)
        self.metrics.leased(0)
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
        # Released on success, error, timeout and cancellation (the end of `async with`).
        try:
            async with self.leases.hold(items_bytes(items, self.text_hidden, self.merge)):
                self.metrics.leased(self.leases.held)
                if delay := float(self.faults.get("encode_delay_s", 0)):
                    await asyncio.sleep(delay)  # tests only (inject_fault)
                results, batch_stages = await self.batcher.encode(items, caller)
        finally:
            self.metrics.leased(self.leases.held)
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
            "node_id": ray.get_runtime_context().get_node_id(),
            "load_s": round(self.load_s, 3),
            "calls": self.calls,
            "items": self.items,
            "patches": self.patches,
            "health_checks": self.health_checks,
            "leases": self.leases.info(),
            **self.batcher.info(),  # num_threads: as the encode thread sees it
        }

    async def check_health(self) -> None:
        """A real tiny encode: the start-up probe image again, through preprocess and tower.

        Runs on the encode worker (after the batch in progress); fails if the features
        are not finite or differ from the start-up ones, so Serve replaces the rank.
        """
        self.health_checks += 1
        if reason := self.faults.get("health"):
            raise RuntimeError(f"rank {self.rank} health check failed: injected fault {reason!r}")
        features = await self.batcher.run_in_worker(self._probe)
        want = self.probe_features
        if features.shape != want.shape:
            raise RuntimeError(
                f"rank {self.rank} health check failed: probe features {features.shape}, "
                f"start-up gave {want.shape}"
            )
        error = float(np.nan_to_num(np.abs(features - want), nan=np.inf).max())
        if error > 1e-3:
            raise RuntimeError(
                f"rank {self.rank} health check failed: probe features differ from "
                f"start-up's by {error:.3g} (> 1e-3)"
            )

    def _probe(self) -> np.ndarray:
        """Encode the probe image alone (encode worker thread); float32 features."""
        with torch.inference_mode():
            pixels = self.encoder.materialize([self.probe_item])
            (features,) = self.encoder.forward(pixels, [self.probe_item])
        return features.detach().to("cpu").float().numpy()

    def inject_fault(self, kind: str, value: float | str | None) -> dict:
        """Tests only (``AppArgs.fault_injection``): ``health`` (a reason: health checks
        fail) or ``encode_delay_s`` (seconds each encode call waits); None clears it."""
        if not self.fault_injection:
            raise PermissionError(
                "inject_fault is disabled; it exists for tests (AppArgs.fault_injection=True)."
            )
        if kind not in ("health", "encode_delay_s"):
            raise ValueError(f"unknown fault {kind!r}; known: 'health', 'encode_delay_s'.")
        if value is None:
            self.faults.pop(kind, None)
        else:
            self.faults[kind] = value
        return {"pid": os.getpid(), "faults": dict(self.faults)}


def _probe_image() -> bytes:
    """A small seeded RGB PNG (56x42 pixels: a 4x3-patch grid), the health-check input."""
    rng = np.random.default_rng(0)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (42, 56, 3), dtype=np.uint8), "RGB").save(out, "PNG")
    return out.getvalue()
