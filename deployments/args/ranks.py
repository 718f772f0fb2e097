"""``ranks``: every encoder rank, its batching and its cache."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from kimi_encoder.cache import MAX_ENTRIES
from kimi_encoder.execution import DEFAULT_BATCH_PATCHES

from .base import ActorOptions, Section, ServeOptions, part


class BatchingArgs(Section):
    """How a rank batches the images of concurrent calls (``RankBatcher``)."""

    model_config = ConfigDict(frozen=True)

    max_batch_patches: int = Field(
        DEFAULT_BATCH_PATCHES,  # the library's, which its graph buckets follow
        ge=1,
        description="Patch budget of one forward on a rank: images of concurrent requests are "
        "batched up to it (an image larger than it runs alone).",
    )
    max_batch_wait_ms: float = Field(
        2.0,
        ge=0,
        description="Longest a queued image waits on an idle rank for others to join its batch.",
    )
    decode: Literal["threads", "processes"] = Field(
        "threads",
        description="Where a rank decodes and preprocesses images ahead of the forward: "
        "'threads' (decode_threads threads of the rank's process; PIL releases the GIL, "
        "Python between its calls holds it) or 'processes' (decode_threads worker "
        "processes, pixels back through shared memory: the forward thread never waits for "
        "the GIL held by a decode; the gpu backend's torch ops stay on the rank's device).",
    )
    decode_threads: int = Field(
        2,
        ge=1,
        description="Decode workers per rank (threads, or processes with decode: processes) "
        "that decode and preprocess images ahead of the forward; about the rank's CPU "
        "allotment on a GPU node.",
    )


class RankArgs(Section):
    """Every encoder rank: its resources, Serve options, batching, cache and memory."""

    actor_options: ActorOptions = part(ActorOptions, "Resources of each encoder rank.")
    # Cross-request batching needs calls in flight, and load reports must get in while a
    # rank is busy: a rank holds many cheap awaiting calls.
    serve_options: ServeOptions = part(
        lambda: ServeOptions(max_ongoing_requests=64, max_queued_requests=64),
        "Serve options of every rank (queue limits, health checks, shutdown).",
    )
    batching: BatchingArgs = part(BatchingArgs, "Cross-request batching: budget, wait, threads.")
    cache_bytes: int = Field(
        256 << 20,
        ge=0,
        description="Per-rank LRU feature cache in bytes, kept in Ray's object store (0 "
        "disables it and cache affinity).",
    )
    cache_entries: int = Field(
        MAX_ENTRIES,
        ge=1,
        description="Most images the rank's feature cache keeps, whatever their bytes: each "
        "entry's key, record and object-store reference (about 2 KiB) live on the rank's "
        "heap, so a cache of many small features stops growing there once this many are "
        "kept. Real-model features (about 14 KB a token) reach cache_bytes first.",
    )
    # Small sides: calibration must stay a few seconds on a CPU; GPU configs add larger ones.
    calibration_grids: list[int] = Field(
        [8, 16, 32],
        description="Sides (in patches) of the square images each rank times at start-up to fit "
        "the cost model (dispatch.cost_model 'fitted'); even numbers; empty: no calibration "
        "(patch counts).",
    )
    max_inflight_bytes: int = Field(
        1 << 30,
        ge=1,
        description="Memory lease budget of each rank: input bytes plus float32 pixels and "
        "features of the images it holds at once; more images wait (one larger than the "
        "budget runs alone).",
    )

    @field_validator("calibration_grids")
    @classmethod
    def _even_grids(cls, value: list[int]) -> list[int]:
        bad = [side for side in value if side < 2 or side % 2]
        if bad:
            raise ValueError(
                f"calibration_grids must be even sides >= 2 (the 2x2 patch merge), got {bad}."
            )
        return value

    @property
    def num_threads(self) -> int:
        """torch threads of each rank's forward: its CPU allotment, at least one."""
        return max(1, int(self.actor_options.num_cpus))
