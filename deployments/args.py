"""``AppArgs``: the builder arguments of ``build_app`` (the ``args:`` block of a config)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kimi_encoder.engines.media import FetchPolicy
from kimi_encoder.features import AUTO_RULE, FeatureDtype, auto_dtype
from kimi_encoder.items import resolve_backend

from .batcher import BatchingConfig

# What the replica processes ask of glibc's malloc: never hand a large block its own mmap
# (mmap_max=0), and give memory back to the kernel only when more than 256 MB is free at
# the top of a heap (trim_threshold). An answer body of tens of MB is otherwise a fresh
# mapping each time (above 32 MB always), every 4 KB page of it faulted in and zeroed on
# first write, then unmapped when freed; kept in the heap, the next body reuses pages
# already mapped. Measured side by side on the 2-core test machine (bench_bytes' hit
# cells, 448x448 images at width 7168, 4 per request, dp 2, five 3 s windows): against
# glibc's defaults, MB/s 1.37x (float32 safetensors), 1.19x (bfloat16 safetensors),
# 1.11x (bfloat16 JSON), float32 JSON within noise (0.94x, 0.69-1.55); huge-page malloc
# (glibc.malloc.hugetlb=1, the previous default) gave 1.13x, 1.04x, 0.88x, 1.01x.
# The price: up to trim_threshold of freed memory stays resident per heap.
GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=268435456"
TUNABLE = re.compile(r"glibc\.[a-z_]+\.[a-z_]+=[^:=\s]+")


@dataclass(frozen=True)
class BodyPace:
    """How fast a body must arrive: all of it within ``timeout_s``, and after ``grace_s``
    at least ``min_bytes_per_s`` on average (a real client on a slow link passes; one
    that trickles bytes to hold a connection does not)."""

    timeout_s: float = 60.0
    grace_s: float = 10.0
    min_bytes_per_s: float = 16384.0

    def deadline(self, received: int) -> float:
        """Seconds since the body's start by which more than ``received`` bytes must be in."""
        return min(self.timeout_s, max(self.grace_s, received / self.min_bytes_per_s))


class ActorOptions(BaseModel):
    """Resources of each replica of a deployment (Ray actor options)."""

    model_config = ConfigDict(extra="forbid")

    num_gpus: float = Field(0, ge=0, description="GPUs per replica: 1 per rank on a GPU node.")
    # 0 so that the ingress and two ranks fit a 2-core machine; torch still gets one thread.
    num_cpus: float = Field(
        0, ge=0, description="Logical CPUs per replica; a rank's torch thread count (at least 1)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. {encoder_slot: 1} with one slot per "
        "node to spread ranks over nodes (ray start --resources='{\"encoder_slot\": 1}').",
    )


class ServeOptions(BaseModel):
    """Serve deployment options that ``build_app`` gives a deployment (every rank, or the
    ingress). A config's ``deployments:`` entry may still override one deployment."""

    model_config = ConfigDict(extra="forbid")

    max_ongoing_requests: int = Field(ge=1, description="Calls one replica runs at once.")
    max_queued_requests: int = Field(
        description="Calls waiting per caller beyond those (-1: unbounded); past it 503."
    )
    health_check_period_s: float = Field(10, gt=0, description="Seconds between health checks.")
    health_check_timeout_s: float = Field(
        30, gt=0, description="A health check slower than this fails (the replica is replaced)."
    )
    graceful_shutdown_wait_loop_s: float = Field(
        2, gt=0, description="How often a stopping replica checks that its calls are done."
    )
    graceful_shutdown_timeout_s: float = Field(
        20, ge=0, description="Longest a stopping replica drains its calls before it is killed."
    )

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_bound(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(
                f"max_queued_requests must be -1 (unbounded) or at least 1, got {value}."
            )
        return value


class ImageUrlOptions(BaseModel):
    """How the engine hand-off reads an http(s) image URL that a prefill forwards (sglang's
    ``mm_items``). Data URLs and base64 are always decoded locally; ``file://``, local
    paths and other schemes are always refused."""

    model_config = ConfigDict(extra="forbid")

    # Off by default: fetching a client's URL makes the server a client of anyone.
    allow_http: bool = Field(
        False, description="Fetch http(s) image URLs (one GET, no redirects); off: refused."
    )
    allow_private_networks: bool = Field(
        False,
        description="Also fetch from loopback, private and link-local addresses (checked "
        "after resolving the host); off: public addresses only.",
    )
    max_bytes: int = Field(64 << 20, ge=1, description="Largest image one URL may send.")
    timeout_s: float = Field(10.0, gt=0, description="Longest one URL fetch may take.")

    def policy(self) -> FetchPolicy:
        return FetchPolicy(**self.model_dump())


class AppArgs(BaseModel):
    """Arguments of the encode server. Validation errors fail the deploy."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(
        "tiny",
        description="Kimi-K3/K2.5 checkpoint directory (original format), or a preset name "
        "(tiny, small, k3, k25). Presets get seeded random weights: meaningless features.",
    )
    dp_size: int = Field(
        1, ge=1, description="Number of encoder ranks (vision data parallelism); one per GPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Device of each rank; 'auto' means cuda when num_gpus > 0, else cpu."
    )
    dtype: Literal["auto", FeatureDtype] = Field(
        "auto", description=f"Weights and compute dtype of the ranks; 'auto': {AUTO_RULE}."
    )
    feature_dtype: FeatureDtype | None = Field(
        None,
        description="Element type of returned features unless a request asks for another; "
        "None: the model's dtype (each rank casts on its device before the copy to host).",
    )
    preprocess_backend: str = Field(
        "auto",
        description="Default pixel pipeline: 'gpu' (torch ops on the rank's device), 'cpu' "
        "(PIL) or 'auto' (gpu on a cuda rank, else cpu). Requests may override with gpu/cpu.",
    )
    rank_actor_options: ActorOptions = Field(
        default_factory=ActorOptions, description="Resources of each encoder rank."
    )
    # Cross-request batching needs calls in flight, and load reports must get in while a
    # rank is busy: a rank holds many cheap awaiting calls.
    rank_options: ServeOptions = Field(
        default_factory=lambda: ServeOptions(max_ongoing_requests=64, max_queued_requests=64),
        description="Serve options of every rank (queue limits, health checks, shutdown).",
    )
    body_timeout_s: float = Field(
        60, gt=0, description="Longest a request body may take to arrive (408 past it)."
    )
    body_grace_s: float = Field(
        10, ge=0, description="Seconds a body may arrive at any pace before body_min_bytes_per_s."
    )
    body_min_bytes_per_s: float = Field(
        16384,
        gt=0,
        description="Slowest average pace a body may arrive at after body_grace_s (408 below); "
        "16 KiB/s lets a client on a slow link through and stops one that trickles bytes.",
    )
    max_concurrent_bodies: int = Field(
        256,
        ge=1,
        description="Request bodies one ingress replica reads at once; past it a request gets "
        "503 with Retry-After at once (slow uploads cannot take the encode path's slots).",
    )
    ingress_replicas: int = Field(
        1, ge=1, description="Replicas of the ingress (HTTP, admission, owner assignment)."
    )
    # The ingress parses headers and moves arrays: by default it reserves nothing.
    ingress_actor_options: ActorOptions = Field(
        default_factory=ActorOptions,
        description="Resources of each ingress replica (no GPU), e.g. resources {head: 0.01} "
        "to keep it on the head node.",
    )
    ingress_options: ServeOptions = Field(
        # Many: a request waiting for its body or its ranks costs the ingress little, and
        # bodies are capped by max_concurrent_bodies.
        default_factory=lambda: ServeOptions(max_ongoing_requests=1024, max_queued_requests=64),
        description="Serve options of each ingress replica.",
    )
    seed: int = Field(0, description="Seed of the random weights of a preset checkpoint.")
    max_request_bytes: int = Field(
        64 << 20, ge=1, description="Largest accepted HTTP body in bytes (413 above)."
    )
    max_images_per_request: int = Field(
        64, ge=1, description="Most images per request, after splitting aggregated items (413)."
    )
    max_image_pixels: int = Field(
        50_000_000, ge=1, description="Most pixels (width*height) of one encoded image (413)."
    )
    max_patches_per_request: int = Field(
        1 << 20, ge=1, description="Most patches (sum of t*h*w over all images) per request (413)."
    )
    # Below the proxy's http_options.request_timeout_s, so clients get this 504, not a 408.
    request_timeout_s: float = Field(
        60, gt=0, description="Longest wait for the ranks' features, in seconds (504 above)."
    )
    api_key_file: str | None = Field(
        None,
        description="File holding the API key that requests must send as 'Authorization: "
        "Bearer <key>' (or set $KIMI_ENCODER_API_KEY instead). None: no key required.",
    )
    max_batch_patches: int = Field(
        16384,
        ge=1,
        description="Patch budget of one forward on a rank: images of concurrent requests are "
        "batched up to it (an image larger than it runs alone).",
    )
    decode_threads: int = Field(
        2,
        ge=1,
        description="Threads per rank that decode and preprocess images ahead of the forward "
        "(PIL releases the GIL); about the rank's CPU allotment on a GPU node.",
    )
    max_batch_wait_ms: float = Field(
        2.0,
        ge=0,
        description="Longest a queued image waits on an idle rank for others to join its batch.",
    )
    cost_model: Literal["fitted", "patches"] = Field(
        "fitted",
        description="Cost of an image in owner assignment: 'fitted' (a*p^2 + b*p + c, timed by "
        "each rank at start-up) or 'patches' (its patch count, the reference rule).",
    )
    # Small sides: calibration must stay a few seconds on a CPU; GPU configs add larger ones.
    calibration_grids: list[int] = Field(
        [8, 16, 32],
        description="Sides (in patches) of the square images each rank times at start-up to fit "
        "the cost model; even numbers; empty: no calibration (patch counts).",
    )
    feature_cache_bytes: int = Field(
        256 << 20,
        ge=0,
        description="Per-rank LRU feature cache in bytes (0 disables it and cache affinity).",
    )
    ingress_cache_bytes: int = Field(
        0,
        ge=0,
        description="Per-ingress-replica LRU, in bytes of features, of references to the "
        "features the ranks' caches wrote into Ray's object store: a repeated image is then "
        "answered by the ingress without a rank call. A referenced entry stays in the object "
        "store after its rank's cache drops it, so the store holds up to dp_size x "
        "feature_cache_bytes + ingress_replicas x this; needs feature_cache_bytes > 0. 0 "
        "disables it.",
    )
    cache_affinity_tolerance: float = Field(
        0.25,
        ge=0,
        description="A repeated image goes to the rank caching it while that rank's load is at "
        "most (1 + tolerance) x the finish of encoding it on the least-loaded rank.",
    )
    max_inflight_bytes: int = Field(
        1 << 30,
        ge=1,
        description="Memory lease budget of each rank: input bytes plus float32 pixels and "
        "features of the images it holds at once; more images wait (one larger than the "
        "budget runs alone).",
    )
    rank_route_timeout_s: float = Field(
        0.3,
        gt=0,
        description="How long an encode call may wait for Serve to route it to a replica of "
        "its rank before the rank counts as slow (dead, restarting, full or starved) and the "
        "call's images go to the other ranks too, while it goes on routing; also the longest a "
        "load poll waits to be routed.",
    )
    rank_slow_after_s: float = Field(
        1.0,
        gt=0,
        description="A rank call with no answer after max(this, rank_slow_factor x the time the "
        "fitted cost model expects) makes the rank slow: no new work, and the call's images are "
        "sent to the other ranks too (first answer wins).",
    )
    rank_slow_factor: float = Field(
        3.0, ge=1, description="Slack over the expected time before a call counts as late."
    )
    rank_cooldown_s: float = Field(
        2.0,
        gt=0,
        description="After an unavailable error (rank died, being replaced, queue full) the "
        "ingress sends a rank no work for this long, then tries it again.",
    )
    load_report_interval_ms: float = Field(
        50.0,
        ge=0,
        description="Longest age of the ranks' load reports (other ingress replicas' work and "
        "the cost model) used in owner assignment; a request polls when they are older (in "
        "the background once a rank has reported). 0: every request waits for fresh reports "
        "(exact loads across ingress replicas, one poll's latency per request).",
    )

    image_urls: ImageUrlOptions = Field(
        default_factory=ImageUrlOptions,
        description="Fetch policy of http(s) image URLs in sglang /encode parts (off by default).",
    )
    ec_root: str | None = Field(
        None,
        description="Absolute directory of vLLM's encoder cache (the consumer's "
        "ECExampleConnector shared_storage_path, on storage it shares with the ingress); "
        "/v1/encode writes there when a request asks for output kind 'vllm_ec'. None: "
        "that output is refused.",
    )
    # sglang's prefill gives up on a part after SGLANG_ENCODER_RECV_TIMEOUT (180 s).
    handoff_wait_s: float = Field(
        30.0,
        gt=0,
        description="Longest an /encode part waits for its scheduler ranks' "
        "/scheduler_receive_url addresses (zmq_to_scheduler); the part's request_timeout_s "
        "caps it.",
    )
    handoff_send_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest a push of a part's frames to one prefill address may wait (a "
        "receiver that is gone or not reading costs this once).",
    )
    handoff_max_pending: int = Field(
        4096,
        ge=1,
        description="Parts whose receive addresses are awaited or held at once, over all "
        "ingress replicas; past it /encode and /scheduler_receive_url answer 503.",
    )
    handoff_address_ttl_s: float = Field(
        180.0,
        gt=0,
        description="Registered receive addresses whose /encode never came are forgotten "
        "after this many seconds.",
    )

    glibc_tunables: str = Field(
        GLIBC_TUNABLES,
        description="GLIBC_TUNABLES of the app's replica processes (ingress, ranks, hand-off "
        "registry): the default keeps glibc's malloc from mapping and unmapping a fresh "
        "block for each multi-MB answer body (no per-block mmap, freed memory kept up to "
        "256 MB per heap), so each body reuses pages already faulted in; '' leaves the "
        "cluster's environment as it is.",
    )

    @field_validator("ec_root")
    @classmethod
    def _absolute_ec_root(cls, value: str | None) -> str | None:
        if value is not None and not PurePath(value).is_absolute():
            raise ValueError(
                f"ec_root must be an absolute directory, got {value!r}; give the consumer's "
                "shared_storage_path as it is mounted on the ingress's node."
            )
        return value

    @field_validator("glibc_tunables")
    @classmethod
    def _tunables(cls, value: str) -> str:
        bad = [t for t in value.split(":") if not TUNABLE.fullmatch(t)] if value else []
        if bad:
            raise ValueError(
                f"glibc_tunables must be ':'-separated glibc.<namespace>.<name>=<value> "
                f"entries (GLIBC_TUNABLES syntax), got {value!r} (bad: {bad}); for example "
                f"{GLIBC_TUNABLES!r}, or '' to leave the environment as it is."
            )
        return value

    @field_validator("calibration_grids")
    @classmethod
    def _even_grids(cls, value: list[int]) -> list[int]:
        bad = [side for side in value if side < 2 or side % 2]
        if bad:
            raise ValueError(
                f"calibration_grids must be even sides >= 2 (the 2x2 patch merge), got {bad}."
            )
        return value

    @field_validator("preprocess_backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        resolve_backend(value, "cpu")  # raises the library's unsupported-backend error
        return value

    @field_validator("ingress_actor_options")
    @classmethod
    def _ingress_without_gpu(cls, value: ActorOptions) -> ActorOptions:
        if value.num_gpus:
            raise ValueError(
                f"ingress_actor_options.num_gpus must be 0 (got {value.num_gpus}): the ingress "
                "never touches a GPU; give GPUs to rank_actor_options."
            )
        return value

    @model_validator(mode="after")
    def _cuda_needs_gpus(self) -> AppArgs:
        if self.device == "cuda" and self.rank_actor_options.num_gpus <= 0:
            raise ValueError(
                "device 'cuda' needs rank_actor_options.num_gpus >= 1 (got "
                f"{self.rank_actor_options.num_gpus}); set num_gpus: 1 or use device 'cpu'."
            )
        return self

    @model_validator(mode="after")
    def _ingress_cache_needs_rank_cache(self) -> AppArgs:
        if self.ingress_cache_bytes and not self.feature_cache_bytes:
            raise ValueError(
                f"ingress_cache_bytes={self.ingress_cache_bytes} keeps references to the "
                "features the ranks' caches hold, but feature_cache_bytes is 0 (no rank "
                "cache); set feature_cache_bytes > 0, or ingress_cache_bytes: 0."
            )
        return self

    @property
    def ingress_cache_share(self) -> int:
        """Object-store bytes the ingress replicas' caches may keep alive, all together."""
        return self.ingress_replicas * self.ingress_cache_bytes

    def replica_env(self) -> dict:
        """``ray_actor_options`` entries every replica of the app gets (its environment)."""
        if not self.glibc_tunables:
            return {}
        return {"runtime_env": {"env_vars": {"GLIBC_TUNABLES": self.glibc_tunables}}}

    def rank_resources(self) -> dict[str, float]:
        """Ray resources of each rank: ``ray_actor_options`` in Ray's resource names."""
        actor = self.rank_actor_options
        return {"CPU": actor.num_cpus, "GPU": actor.num_gpus, **actor.resources}

    @property
    def rank_device(self) -> str:
        """The device each rank uses: 'auto' follows the rank's GPU allotment."""
        if self.device != "auto":
            return self.device
        return "cuda" if self.rank_actor_options.num_gpus > 0 else "cpu"

    def batching_config(self) -> BatchingConfig:
        """The ranks' batching, cache and calibration settings."""
        return BatchingConfig(
            max_batch_patches=self.max_batch_patches,
            max_batch_wait_ms=self.max_batch_wait_ms,
            cache_bytes=self.feature_cache_bytes,
            calibration_grids=tuple(self.calibration_grids) if self.cost_model == "fitted" else (),
            decode_threads=self.decode_threads,
        )

    @property
    def body_pace(self) -> BodyPace:
        return BodyPace(self.body_timeout_s, self.body_grace_s, self.body_min_bytes_per_s)

    @property
    def rank_dtype(self) -> str:
        """The ranks' dtype: 'auto' follows their device."""
        if self.dtype != "auto":
            return self.dtype
        return auto_dtype(self.rank_device)

    @property
    def default_feature_dtype(self) -> str:
        """The features' wire dtype of requests that do not choose one."""
        return self.feature_dtype or self.rank_dtype

    @property
    def default_backend(self) -> str:
        """'gpu' or 'cpu': the backend of requests that do not choose one."""
        return resolve_backend(self.preprocess_backend, self.rank_device)
