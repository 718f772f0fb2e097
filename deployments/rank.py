"""``EncoderRank``: one vision-data-parallel rank holding one encoder."""

from __future__ import annotations

import asyncio
import io
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import ray
import torch
from PIL import Image

from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.engines.sglang import push_frames
from kimi_encoder.engines.transport import ZmqPusher
from kimi_encoder.engines.vllm import write_ec_array
from kimi_encoder.features import dtype_name, storage_dtype, to_numpy
from kimi_encoder.hub import is_hub

from .args import ModelArgs, RankArgs
from .batcher import RankBatcher
from .batching import NOT_CACHED, raise_first_error
from .heap import start_trimming
from .leases import MemoryLeases, items_bytes
from .metrics import DELIVER, RankMetrics
from .ranks.calls import EncodeCall
from .ranks.records import LoadReport, RankReply
from .sinks import EcFiles, Kept, PartPush, Written, part_frames
from .stored import StoredFeatures
from .vllm_push import EcPushes, PushMetrics, push_images

log = logging.getLogger("ray.serve")

# Builds the rank's encoder; called like ``VisionEncoder.from_pretrained`` (checkpoint,
# device, dtype, backend, seed). Tests pass their own to slow down or break a rank.
EncoderFactory = Callable[..., VisionEncoder]

# Relative bound of the health check's probe against its start-up features, by dtype:
# kernels may pick other algorithms between runs (a few roundings of the dtype's step).
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4 * 2.0**-8, torch.float16: 4 * 2.0**-11}


class EncoderRank:
    """Encodes the items this rank owns and answers their features in the asked dtype.

    The rank index is a constructor argument (one deployment per rank), so it is
    known in every mode, including Serve's local testing mode. Images of
    concurrent calls are batched together, cached and counted as outstanding
    work by a ``RankBatcher`` (deployments/batcher.py). Each call holds a memory
    lease for its images' bytes while it runs (deployments/leases.py), and the
    health check encodes a small synthetic image and compares it with the
    features the rank computed for it at start-up.

    With the feature cache on, each image's features are written once into Ray's
    object store (``StoredFeatures``) as they leave the encoder; the cache keeps the
    ref and an answer carries refs, which the ingress reads in place
    (``handles.RankCall``). A cache hit then costs the rank no copy: returning the
    arrays themselves would write every byte into the object store again on every
    hit, which costs the processes several times the CPU of answering refs
    (docs/api.md, "Measurements behind the code"). If the rank dies, its refs die
    with it and the ingress re-dispatches those images, as for any lost rank.
    """

    def __init__(
        self,
        rank: int,
        model: ModelArgs,
        ranks: RankArgs,
        ingress_cache_share: int = 0,
        encoder_factory: EncoderFactory = VisionEncoder.from_pretrained,
    ):
        """``model`` as the ranks run it (``AppArgs.model_as_run``: nothing 'auto'),
        ``ranks`` as this rank runs it; ``ingress_cache_share`` the object-store bytes the
        ingress caches may keep alive (``check_cache_fits``)."""
        self.rank = rank
        start_trimming()
        check_resources(rank, ranks.actor_options.ray_resources(), ray.get_runtime_context())
        num_threads = ranks.num_threads
        torch.set_num_threads(num_threads)
        started = time.perf_counter()
        # A hub checkpoint's fetch reports to this replica's log (its progress, what it read).
        hub = {"hub_log": log} if is_hub(model.checkpoint) else {}
        self.encoder = encoder_factory(
            model.checkpoint,
            device=model.device,
            dtype=model.dtype,
            backend=model.preprocess_backend,
            seed=model.seed,
            execution=model.execution_config(ranks.batching.max_batch_patches, num_threads),
            **hub,
        )
        if ranks.cache_bytes:
            store = node_object_store_bytes()
            check_cache_fits(rank, ranks.cache_bytes, store, ingress_cache_share)
        self.batcher = RankBatcher(
            self.encoder,
            ranks.batching,
            num_threads,
            cache_bytes=ranks.cache_bytes,
            cache_entries=ranks.cache_entries,
            calibration_grids=ranks.calibration_grids,
            keep=StoredFeatures.put if ranks.cache_bytes else None,
        )
        self.vision = self.encoder.vision
        self.leases = MemoryLeases(ranks.max_inflight_bytes)
        self.probe_item = self.encoder.plan(_probe_image())
        self.probe_features = self.batcher.run_in_worker_sync(self._probe)
        self.probe_tolerance = PROBE_TOLERANCE[self.encoder.dtype]
        self.health_checks = 0
        self.ec_entries = 0  # vLLM encoder-cache files this rank wrote
        self.pushed = 0  # sglang parts this rank pushed
        self._pusher: ZmqPusher | None = None
        self._ec_pusher = None  # vllm_push output: made at first use, on this loop
        self.load_s = time.perf_counter() - started
        self.metrics = RankMetrics(rank)
        self.metrics.leased(0)
        execution = self.encoder.execution.info()
        log.info(
            "rank %d ready: %s on %s in %.1f s, execution %s (%s)",
            rank,
            self.encoder.name,
            self.encoder.device,
            self.load_s,
            execution["mode"],
            ", ".join(f"{k} {v}" for k, v in execution.items() if k != "mode"),
        )

    def __del__(self) -> None:
        """Serve's shutdown of the replica: the decode worker processes end with it."""
        batcher = getattr(self, "batcher", None)  # absent when the constructor failed
        if batcher is not None:
            batcher.close()

    async def encode(self, call: EncodeCall) -> RankReply:
        """Features of ``call.items``: one array per item (or its object-store ref, with
        the cache on), in input order, in ``call.feature_dtype`` (as admission chose and
        checked it; bfloat16 as uint16 words, see ``kimi_encoder.features``). With a
        ``call.sink`` (``EcFiles``, ``Kept``, ``EcPushes``) the features go there from this
        rank instead, and each item is answered with what was delivered
        (``sinks.Written``). ``ranks.calls.EncodeCall`` says what each field is."""
        indices, items, feature_dtype = call.indices, call.items, call.feature_dtype
        sent_at, caller, sink = call.sent_at, call.caller, call.sink
        started = time.perf_counter()
        stages: dict[str, float] = {}
        if sent_at is not None:  # wall clocks of two processes: clamp a skew to 0
            stages["queue_wait"] = max(0.0, time.time() - sent_at) * 1e3
        # Released on success, error, timeout and cancellation (the end of `async with`).
        try:
            async with self.leases.hold(items_bytes(items, self.vision)):
                self.metrics.leased(self.leases.held)
                results, batch_stages = await self.batcher.encode(items, caller, feature_dtype)
        finally:
            self.metrics.leased(self.leases.held)
        stages["queue_wait"] = stages.get("queue_wait", 0.0) + batch_stages.pop("queue_wait")
        stages.update(batch_stages)
        results = raise_first_error(results, indices)
        # Sent by digest but no longer cached: answered as missing, the ingress sends them
        # again with their bytes (handles.RankCall).
        missing = [k for k, r in enumerate(results) if r is NOT_CACHED]
        tensors = [r for r in results if r is not NOT_CACHED]
        # Each image's features are already a host buffer of their own (the one copy that
        # left the device), or with the cache on that buffer written once into the object
        # store (StoredFeatures). Arrays are carried as they are: Ray writes the answer
        # into one object-store object, every array's bytes once, and the ingress reads
        # each in place. Concatenating them here first would copy every byte once more.
        if sink is None:
            features = [_carried(r) for r in results]
        elif isinstance(sink, Kept):
            features = await asyncio.to_thread(_kept, results)
        elif isinstance(sink, EcPushes):
            delivered_at = time.perf_counter()
            features = await self._push_ec(sink, results)
            stages[DELIVER] = (time.perf_counter() - delivered_at) * 1e3
        else:
            delivered_at = time.perf_counter()
            features = await self._write(sink, results)
            stages[DELIVER] = (time.perf_counter() - delivered_at) * 1e3
        answered = [i for i, r in zip(items, results, strict=True) if r is not NOT_CACHED]
        backend = next((i.deferred.backend for i in answered if i.deferred is not None), "none")
        patches, tokens = sum(i.num_patches for i in answered), sum(t.shape[0] for t in tensors)
        if answered:  # Ray's counters take no increment of 0
            self.metrics.encoded(len(answered), patches, tokens, backend, stages)
            self.metrics.padded(self.encoder.execution.padding_share)
        log.info(
            "rank %d encoded %d images (%d patches, %d tokens, %s backend; %d not cached) in %s ms",
            self.rank,
            len(answered),
            patches,
            tokens,
            backend,
            len(missing),
            {k: round(v, 2) for k, v in stages.items()},
            extra={"kimi_encoder_rank": {"rank": self.rank, "images": len(answered), **stages}},
        )
        return RankReply(
            rank=self.rank,
            features=features,
            dtype=feature_dtype,
            encode_ms=(time.perf_counter() - started) * 1e3,
            stages_ms=stages,
            done_at=time.time(),
            load=self.batcher.load(),  # saves the ingress a poll
            missing=missing,
        )

    async def _write(self, sink: EcFiles, results: Sequence) -> list[Written | None]:
        """Each image's encoder-cache entries, written from its host features or, for a
        cache hit, from the object store in place; None where it is ``NOT_CACHED``."""
        arrays = [
            None if r is NOT_CACHED else (await r.ref if isinstance(r, StoredFeatures) else r)
            for r in results
        ]
        written = await asyncio.to_thread(_write_entries, sink, arrays)
        self.ec_entries += sum(len(w.sizes) for w in written if w is not None)
        return written

    async def _push_ec(self, sink: EcPushes, results: Sequence) -> list:
        """Push each image to the vLLM workers of ``sink`` from its host features or, for a
        cache hit, from the object store in place; answered once all acknowledged."""
        arrays = [
            None if r is NOT_CACHED else (await r.ref if isinstance(r, StoredFeatures) else r)
            for r in results
        ]
        dtypes = [None if a is None else _storage(a)[1] for a in arrays]
        arrays = [None if a is None else _storage(a)[0] for a in arrays]
        if self._ec_pusher is None:
            self._ec_pusher, self._push_metrics = sink.limits.pusher(), PushMetrics(self.rank)
        try:
            return await push_images(self._ec_pusher, sink, arrays, dtypes)
        finally:
            self._push_metrics.publish(self._ec_pusher.info())

    async def push(self, part: PartPush, stored: Sequence[StoredFeatures]) -> dict:
        """Push an sglang part from this rank: its images' features (``stored``, in item
        order, kept by this rank or others: Ray brings another node's here) joined into
        frame 1, frame 0 beside it, sent to every endpoint of the part."""
        started = time.perf_counter()
        arrays = await asyncio.gather(*(features.ref for features in stored))
        frames = await asyncio.to_thread(part_frames, part, arrays)
        if self._pusher is None:  # made here: a pusher belongs to the loop it sends from
            self._pusher = ZmqPusher(send_timeout_s=part.send_timeout_s)
        await push_frames(frames, part.endpoints, self._pusher, reuse=not part.one_off)
        self.pushed += 1
        push_ms = (time.perf_counter() - started) * 1e3
        nbytes = sum(array.nbytes for array in arrays)
        return {"rank": self.rank, "bytes": nbytes, "push_ms": push_ms}

    async def load(self) -> LoadReport:
        """Outstanding work by caller and the fitted cost model (polled by the ingress)."""
        return self.batcher.load()

    async def hold(self, seconds: float) -> LoadReport:
        """Answer the load report after ``seconds``: an elastic rank the ingress wants has
        one such call open at all times, which keeps Serve from releasing its replica
        (deployments/ranks/scaler.py)."""
        await asyncio.sleep(seconds)
        return self.batcher.load()

    def info(self) -> dict:
        return {
            **self.encoder.info(),
            "rank": self.rank,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "load_s": round(self.load_s, 3),
            "health_checks": self.health_checks,
            "ec_entries": self.ec_entries,
            "parts_pushed": self.pushed,
            "ec_push": self._ec_pusher.info() if self._ec_pusher is not None else {},
            "leases": self.leases.info(),
            **self.batcher.info(),  # calls, items, patches, num_threads (the encode thread's)
        }

    async def check_health(self) -> None:
        """A real tiny encode: the start-up probe image again, through preprocess and tower.

        Runs on the encode worker (after the batch in progress); fails if the features
        are not finite or differ from the start-up ones by more than the dtype's
        tolerance (relative to their largest value), so Serve replaces the rank.
        """
        self.health_checks += 1
        features = await self.batcher.run_in_worker(self._probe)
        want = self.probe_features
        if features.shape != want.shape:
            raise RuntimeError(
                f"rank {self.rank} health check failed: probe features {features.shape}, "
                f"start-up gave {want.shape}"
            )
        error = float(np.nan_to_num(np.abs(features - want), nan=np.inf).max())
        bound = self.probe_tolerance * float(np.abs(want).max())
        if not error <= bound:
            raise RuntimeError(
                f"rank {self.rank} health check failed: probe features differ from "
                f"start-up's by {error:.3g} (> {bound:.3g})"
            )

    def _probe(self) -> np.ndarray:
        """Encode the probe image alone (encode worker thread); float32 features."""
        with torch.inference_mode():
            pixels = self.encoder.materialize([self.probe_item])
            (features,) = self.encoder.forward(pixels, [self.probe_item])
        return features.detach().to("cpu").float().numpy()


def check_resources(rank: int, wanted: Mapping[str, float], context) -> None:
    """Refuse to start when Ray gave this rank other resources than
    ``ranks.actor_options``.

    ``build_app`` derives every rank's ``ray_actor_options`` from ``ranks.actor_options``
    (and the device, thread count and memory budget from them); a config's
    ``deployments:`` entry that overrides them for one rank would silently disagree.
    """
    got = context.get_assigned_resources()
    keys = set(wanted) | {k for k in got if "_group_" not in k}  # not placement-group names
    if all(math.isclose(wanted.get(k, 0.0), got.get(k, 0.0)) for k in keys):
        return
    raise ValueError(
        f"rank {rank} was started with Ray resources {dict(sorted(got.items()))}, but "
        f"ranks.actor_options asks for {dict(sorted(wanted.items()))}: a config's "
        f"`deployments:` entry for EncoderRank_{rank} overrides its ray_actor_options. Set the "
        "resources once in the application's args (ranks: {actor_options: ...}) and remove "
        "the override."
    )


def _kept(results: Sequence) -> list[StoredFeatures | None]:
    """Each image's features in the object store (a cache hit's already are), answered as
    refs for the rank that pushes the part; None stays None (``NOT_CACHED``)."""
    return [
        None if r is NOT_CACHED else r if isinstance(r, StoredFeatures) else StoredFeatures.put(r)
        for r in results
    ]


def _write_entries(sink: EcFiles, arrays: Sequence) -> list[Written | None]:
    """``EcFiles``' entries of each image (a host tensor or a stored array); None stays
    None. A file that cannot be written fails the call, naming its root."""
    written: list[Written | None] = []
    for uuids, features in zip(sink.uuids, arrays, strict=True):
        if features is None:
            written.append(None)
            continue
        if isinstance(features, torch.Tensor):
            array, dtype = to_numpy(features), dtype_name(features.dtype)
        else:  # an object-store array: its dtype is its storage's (kimi_encoder.features)
            array, dtype = features, storage_dtype(features)
        entries = [write_ec_array(sink.root, uuid, array, dtype) for uuid in uuids]
        sizes = {entry.uuid: entry.nbytes for entry in entries}
        written.append(Written((int(array.shape[0]), int(array.shape[1])), dtype, sizes))
    return written


def _storage(features) -> tuple[np.ndarray, str]:
    """A host tensor or a stored array as a storage array and its dtype's name."""
    if isinstance(features, torch.Tensor):
        return to_numpy(features), dtype_name(features.dtype)
    return features, storage_dtype(features)  # an object-store array (kimi_encoder.features)


def _carried(result) -> object:
    """What an answer carries for one image: its object-store ref, its array, or None
    (``NOT_CACHED``: listed in the answer's ``missing``)."""
    if result is NOT_CACHED:
        return None
    return result.ref if isinstance(result, StoredFeatures) else to_numpy(result)


def node_object_store_bytes() -> float | None:
    """The object-store capacity of this process's Ray node (None if Ray does not say)."""
    node = ray.get_runtime_context().get_node_id()
    for entry in ray.nodes():
        if entry.get("NodeID") == node:
            return entry.get("Resources", {}).get("object_store_memory")
    return None


def check_cache_fits(
    rank: int, cache_bytes: int, store_bytes: float | None, ingress_share: int = 0
) -> None:
    """Refuse a feature cache larger than half of its node's object store, where it lives
    (``StoredFeatures``): the node's other ranks and every answer in flight share it, and
    Ray would spill cached features to disk rather than fail. ``ingress_share``: what the
    ingress replicas' caches may keep alive of them (``ingress.cache_bytes``), counted too."""
    if store_bytes is None or cache_bytes + ingress_share <= store_bytes / 2:
        return
    also = f" plus ingress.replicas x ingress.cache_bytes={ingress_share}" if ingress_share else ""
    raise ValueError(
        f"rank {rank}: ranks.cache_bytes={cache_bytes}{also} is more than half of this "
        f"node's Ray object store ({int(store_bytes)} bytes), which holds the cached features "
        "of every rank on the node and the answers in flight. Lower ranks.cache_bytes (0 "
        "disables the cache) or ingress.cache_bytes, or start Ray with a larger "
        "--object-store-memory."
    )


def _probe_image() -> bytes:
    """A small seeded RGB PNG (56x42 pixels: a 4x3-patch grid), the health-check input."""
    rng = np.random.default_rng(0)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (42, 56, 3), dtype=np.uint8), "RGB").save(out, "PNG")
    return out.getvalue()
