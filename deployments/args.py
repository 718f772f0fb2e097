"""``AppArgs``: the builder arguments of ``build_app`` (the ``args:`` block of a config),
grouped by the component that reads them.

``model`` (the checkpoint and its dtypes: ranks and ingress), ``dp_size``, ``ranks``
(``EncoderRank`` and its ``RankBatcher``), ``ingress`` (``EncodeServer``, its
``Admission``), ``dispatch`` (owner assignment and failover at the ingress:
``Dispatcher``, ``FanOut``, ``RankHealth``), ``handoff`` (the engine hand-off:
``Handoff``, ``HandoffRegistry``) and ``glibc_tunables`` (every replica process).
``build_app`` hands each component its own section and the few values derived from
others (the model as the ranks run it, the object-store share of the ingress cache).
The runtime imports these models; this module imports no runtime code.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import PurePath
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kimi_encoder.engines.media import FetchPolicy
from kimi_encoder.engines.transport import DEFAULT_RECEIVE_NETWORKS, ReceivePolicy, parse_networks
from kimi_encoder.execution import ExecutionConfig, check_mode, default_buckets
from kimi_encoder.features import AUTO_RULE, FeatureDtype, auto_dtype
from kimi_encoder.items import resolve_backend
from kimi_encoder.weights import start_allowance_s

# What the replica processes ask of glibc's malloc: never hand a large block its own mmap
# (mmap_max=0), and give memory back to the kernel only when more than 256 MB is free at
# the top of a heap (trim_threshold). An answer body of tens of MB is otherwise a fresh
# mapping each time, every page of it faulted in and zeroed on first write, then unmapped
# when freed; kept in the heap, the next body reuses pages already mapped. It moved more
# answer bytes per second than glibc's defaults and than huge-page malloc (docs/api.md,
# "Measurements behind the code"). The price: up to trim_threshold of freed memory stays
# resident per heap.
GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=268435456"
TUNABLE = re.compile(r"glibc\.[a-z_]+\.[a-z_]+=[^:=\s]+")


class Section(BaseModel):
    """A part of the config: a key it does not define is refused, naming it."""

    model_config = ConfigDict(extra="forbid")


def part(default: Callable[[], Section], description: str) -> Any:
    """A component's nested section: built by ``default`` unless the config gives it."""
    return Field(default_factory=default, description=description)


class ActorOptions(Section):
    """Resources of each replica of a deployment (Ray actor options)."""

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

    def ray_resources(self) -> dict[str, float]:
        """These options in Ray's resource names (what a replica is assigned)."""
        return {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}


class ServeOptions(Section):
    """Serve deployment options that ``build_app`` gives a deployment (every rank, or the
    ingress). A config's ``deployments:`` entry may still override one deployment."""

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


class ImageUrlOptions(Section):
    """How the engine hand-off reads an http(s) image URL that a prefill forwards (sglang's
    ``mm_items``). Data URLs and base64 are always decoded locally; ``file://``, local
    paths and other schemes are always refused."""

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


class ModelArgs(Section):
    """The checkpoint and how the ranks compute: read by every rank (its encoder) and by
    the ingress (the checkpoint's configs, the defaults of a request)."""

    checkpoint: str = Field(
        "tiny",
        description="Kimi-K3/K2.5 checkpoint directory (original format), or a preset name "
        "(tiny, small, k3, k25). Presets get seeded random weights: meaningless features.",
    )
    seed: int = Field(0, description="Seed of the random weights of a preset checkpoint.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Device of each rank; 'auto' means cuda when the ranks have GPUs "
        "(ranks.actor_options.num_gpus > 0), else cpu.",
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

    execution: str = Field(
        "auto",
        description="How each rank runs the tower: 'eager', 'compiled' (torch.compile of the "
        "pieces between attention calls), 'graphs' (CUDA graphs over patch buckets; CUDA, "
        "bfloat16 or float16, compute capability 8.0+) or 'auto' (eager on CPU; on CUDA the "
        "fastest the rank measures at start within auto_budget_s). docs/gpu.md.",
    )
    graph_buckets: list[int] = Field(
        [],
        description="Patch budgets of the CUDA graphs ('graphs', or 'auto' measuring it); "
        "empty: ranks.batching.max_batch_patches halved down to 512, at most 8 budgets.",
    )
    graph_max_images: int = Field(
        64, ge=1, description="Most images in one graph's batch; a batch with more runs eager."
    )
    auto_budget_s: float = Field(
        120.0,
        ge=0,
        description="Seconds a CUDA rank's 'auto' may spend building (compiling, capturing, "
        "waiting for another rank's compile) and timing the modes at start; read between "
        "steps (one compiled piece, one bucket's graphs, one timing), so auto ends at most "
        "one step past it; a mode it stops is undone and skipped.",
    )

    @field_validator("preprocess_backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        resolve_backend(value, "cpu")  # raises the library's unsupported-backend error
        return value

    @field_validator("execution")
    @classmethod
    def _known_execution(cls, value: str) -> str:
        return check_mode(value)  # raises the library's unknown-execution error

    @field_validator("graph_buckets")
    @classmethod
    def _bucket_sizes(cls, value: list[int]) -> list[int]:
        bad = [n for n in value if n < 4]
        if bad:
            raise ValueError(
                f"graph_buckets must be patch counts of at least 4 (one 2x2 image), got {bad}."
            )
        return value

    def execution_config(
        self, max_batch_patches: int, compile_threads: int | None = None
    ) -> ExecutionConfig:
        """The library's execution config of a rank batching up to ``max_batch_patches``,
        compiling with at most ``compile_threads`` workers (its CPUs; None: its process's)."""
        return ExecutionConfig(
            mode=self.execution,
            graph_buckets=tuple(self.graph_buckets or default_buckets(max_batch_patches)),
            graph_max_images=self.graph_max_images,
            auto_budget_s=self.auto_budget_s,
            compile_threads=compile_threads,
        )

    def resolved(self, num_gpus: float) -> ModelArgs:
        """This section as ranks with ``num_gpus`` GPUs each run it: no 'auto', no None."""
        device = self.device if self.device != "auto" else ("cuda" if num_gpus > 0 else "cpu")
        dtype = self.dtype if self.dtype != "auto" else auto_dtype(device)
        return self.model_copy(
            update={
                "device": device,
                "dtype": dtype,
                "feature_dtype": self.feature_dtype or dtype,
                "preprocess_backend": resolve_backend(self.preprocess_backend, device),
            }
        )


class BatchingArgs(Section):
    """How a rank batches the images of concurrent calls (``RankBatcher``)."""

    model_config = ConfigDict(frozen=True)

    max_batch_patches: int = Field(
        16384,
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


class RequestLimits(Section):
    """What one request may hold; admission refuses more (413)."""

    model_config = ConfigDict(frozen=True)

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


class BodyPace(Section):
    """How fast a body must arrive: all of it within ``timeout_s``, and after ``grace_s``
    at least ``min_bytes_per_s`` on average (a real client on a slow link passes; one
    that trickles bytes to hold a connection does not)."""

    model_config = ConfigDict(frozen=True)

    timeout_s: float = Field(
        60.0, gt=0, description="Longest a request body may take to arrive (408 past it)."
    )
    grace_s: float = Field(
        10.0, ge=0, description="Seconds a body may arrive at any pace before min_bytes_per_s."
    )
    # 16 KiB/s lets a client on a slow link through and stops one that trickles bytes.
    min_bytes_per_s: float = Field(
        16384.0,
        gt=0,
        description="Slowest average pace a body may arrive at after grace_s (408 below).",
    )

    def deadline(self, received: int) -> float:
        """Seconds since the body's start by which more than ``received`` bytes must be in."""
        return min(self.timeout_s, max(self.grace_s, received / self.min_bytes_per_s))


class IngressArgs(Section):
    """The HTTP ingress (``EncodeServer``): its replicas, admission and ingress cache."""

    replicas: int = Field(
        1, ge=1, description="Replicas of the ingress (HTTP, admission, owner assignment)."
    )
    # The ingress parses headers and moves arrays: by default it reserves nothing.
    actor_options: ActorOptions = part(
        ActorOptions,
        "Resources of each ingress replica (no GPU), e.g. resources {head: 0.01} "
        "to keep it on the head node.",
    )
    # Many: a request waiting for its body or its ranks costs the ingress little, and
    # bodies are capped by max_concurrent_bodies.
    serve_options: ServeOptions = part(
        lambda: ServeOptions(max_ongoing_requests=1024, max_queued_requests=64),
        "Serve options of each ingress replica.",
    )
    limits: RequestLimits = part(
        RequestLimits, "Most bytes, images, pixels and patches of one request (413 above)."
    )
    body_pace: BodyPace = part(BodyPace, "How fast a body must arrive (408 when it falls behind).")
    max_concurrent_bodies: int = Field(
        256,
        ge=1,
        description="Request bodies one ingress replica reads at once; past it a request gets "
        "503 with Retry-After at once (slow uploads cannot take the encode path's slots).",
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
    cache_bytes: int = Field(
        0,
        ge=0,
        description="Per-ingress-replica LRU, in bytes of features, of the features the ranks' "
        "caches wrote into Ray's object store, as this replica read them: a repeated image is "
        "then answered by the ingress without a rank call. A held entry stays in the object "
        "store after its rank's cache drops it, so the store holds up to dp_size x "
        "ranks.cache_bytes + replicas x this; needs ranks.cache_bytes > 0. 0 disables it.",
    )

    @field_validator("actor_options")
    @classmethod
    def _without_gpu(cls, value: ActorOptions) -> ActorOptions:
        if value.num_gpus:
            raise ValueError(
                f"ingress.actor_options.num_gpus must be 0 (got {value.num_gpus}): the ingress "
                "never touches a GPU; give GPUs to ranks.actor_options."
            )
        return value


class DispatchArgs(Section):
    """How the ingress sends images to ranks: owner assignment (``Dispatcher``) and what
    it does about a slow or failed rank (``FanOut``, ``RankHealth``)."""

    cost_model: Literal["fitted", "patches"] = Field(
        "fitted",
        description="Cost of an image in owner assignment: 'fitted' (a*p^2 + b*p + c, timed by "
        "each rank at start-up over ranks.calibration_grids) or 'patches' (its patch count, "
        "the reference rule).",
    )
    affinity_tolerance: float = Field(
        0.25,
        ge=0,
        description="A repeated image goes to the rank caching it while that rank's load is at "
        "most (1 + tolerance) x the finish of encoding it on the least-loaded rank.",
    )
    load_report_interval_ms: float = Field(
        50.0,
        ge=0,
        description="Longest age of the ranks' load reports (other ingress replicas' work and "
        "the cost model) used in owner assignment; a request polls when they are older (in "
        "the background once a rank has reported). 0: every request waits for fresh reports "
        "(exact loads across ingress replicas, one poll's latency per request).",
    )
    route_timeout_s: float = Field(
        0.3,
        gt=0,
        description="How long an encode call may wait for Serve to route it to a replica of "
        "its rank, when the rank has shown no progress for slow_after_s, before the rank "
        "counts as slow (dead, restarting or starved) and the call's images go to the other "
        "ranks too, while it goes on routing; also the longest a load poll waits to be routed.",
    )
    slow_after_s: float = Field(
        1.0,
        gt=0,
        description="A rank call with no answer after max(this, slow_factor x the time the "
        "fitted cost model expects), counted from the rank's last progress (an answer, or a "
        "load report of more calls answered), makes the rank slow: no new work, and the "
        "call's images are sent to the other ranks too (first answer wins). A rank that keeps "
        "answering is busy, not slow.",
    )
    slow_factor: float = Field(
        3.0, ge=1, description="Slack over the expected time before a call counts as late."
    )
    cooldown_s: float = Field(
        2.0,
        gt=0,
        description="After an unavailable error (rank died, being replaced, queue full) the "
        "ingress sends a rank no work for this long, then tries it again.",
    )


class VllmPushArgs(Section):
    """Output kind 'vllm_push': each rank pushes its images' features to the vLLM
    workers a request names, and waits for their acknowledgements (docs/epd.md)."""

    ack_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest one item's push to one vLLM worker may take, from waiting for a "
        "push slot to the worker's acknowledgement; past it the request fails with 503 naming "
        "the item and the worker.",
    )
    max_in_flight: int = Field(
        64,
        ge=1,
        description="Pushes one rank has unacknowledged at once; a push waits for a slot (at "
        "most ack_timeout_s, then 503 with Retry-After).",
    )
    max_in_flight_per_destination: int = Field(
        16,
        ge=1,
        description="Pushes one rank has unacknowledged at once to one vLLM worker (the same "
        "wait, the same 503).",
    )


class EngineCallerArgs(Section):
    """Who may call the engines' routes without the API key (docs/api.md, Security)."""

    # Loopback only: a user widens it knowingly.
    networks: list[str] = Field(
        default_factory=lambda: ["127.0.0.0/8", "::1/128"],
        description="Networks (CIDR) from which, with an API key configured, a caller without "
        "the key is served on the engines' routes (sglang's /encode, /scheduler_receive_url, "
        "/health); anyone else gets 401 before the body is read. /v1/* always needs the key. "
        "The caller's address is the one Serve's proxy saw; behind Serve's HAProxy ingress, "
        "which passes no caller address, every keyless call is refused.",
    )

    @field_validator("networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        try:
            parse_networks(value)
        except ValueError as exc:
            where = "handoff.engine_callers.networks entry"
            raise ValueError(str(exc).replace("receive network", where, 1)) from None
        return value


class HandoffArgs(Section):
    """The engine hand-off: sglang's /encode parts and vLLM's encoder-cache files."""

    image_urls: ImageUrlOptions = part(
        ImageUrlOptions,
        "Fetch policy of http(s) image URLs in sglang /encode parts (off by default).",
    )
    ec_root: str | None = Field(
        None,
        description="Absolute directory of vLLM's encoder cache (the consumer's "
        "ECExampleConnector shared_storage_path, on storage it shares with the ingress and "
        "the ranks, which write the files); "
        "/v1/encode writes there when a request asks for output kind 'vllm_ec'. None: "
        "that output is refused.",
    )
    # sglang's prefill gives up on a part after SGLANG_ENCODER_RECV_TIMEOUT (180 s).
    wait_s: float = Field(
        30.0,
        gt=0,
        description="Longest an /encode part waits for its scheduler ranks' "
        "/scheduler_receive_url addresses (zmq_to_scheduler); the part's request timeout "
        "(ingress.request_timeout_s) caps it.",
    )
    send_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest a push of a part's frames to one prefill address may wait (a "
        "receiver that is gone or not reading costs this once).",
    )
    max_pending: int = Field(
        4096,
        ge=1,
        description="Parts whose receive addresses are awaited or held at once, over all "
        "ingress replicas; past it /encode and /scheduler_receive_url answer 503.",
    )
    address_ttl_s: float = Field(
        180.0,
        gt=0,
        description="Registered receive addresses whose /encode never came are forgotten "
        "after this many seconds.",
    )
    # sglang sends no API key: whoever reaches /encode names where the ingress connects.
    receive_networks: list[str] = Field(
        default_factory=lambda: list(DEFAULT_RECEIVE_NETWORKS),
        description="Networks (CIDR) that sglang's receive addresses must resolve into: an "
        "/encode part's prefill_host:embedding_port, each /scheduler_receive_url address. "
        "Any other address is refused (400) and nothing connects to it, not even for an "
        "error frame. Default: loopback and the private ranges. Link-local "
        "(169.254.0.0/16, fe80::/10) is left out, as cloud metadata services live there "
        "and a prefill listens on a routable address; list it, or a public network, to "
        "push there.",
    )

    vllm_push: VllmPushArgs = part(
        VllmPushArgs, "Output kind 'vllm_push': acknowledgement timeout and push bounds."
    )
    engine_callers: EngineCallerArgs = part(
        EngineCallerArgs, "Networks whose keyless calls the engines' routes serve."
    )

    @field_validator("receive_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        parse_networks(value)
        return value

    def receive_policy(self) -> ReceivePolicy:
        return ReceivePolicy.from_cidrs(self.receive_networks, setting="handoff.receive_networks")

    @field_validator("ec_root")
    @classmethod
    def _absolute_ec_root(cls, value: str | None) -> str | None:
        if value is not None and not PurePath(value).is_absolute():
            raise ValueError(
                f"ec_root must be an absolute directory, got {value!r}; give the consumer's "
                "shared_storage_path as it is mounted on the ingress's node."
            )
        return value


class DpRange(Section):
    """Elastic vision DP: between ``min`` and ``max`` ranks take work, as the load asks."""

    min: int = Field(ge=1, description="Ranks that always run (never parked).")
    max: int = Field(ge=1, description="Most ranks running at once (one GPU each).")

    @model_validator(mode="after")
    def _ordered(self) -> DpRange:
        if self.max < self.min:
            raise ValueError(
                f"max ({self.max}) must be at least min ({self.min}), e.g. "
                f"{{min: {self.min}, max: {2 * self.min}}}"
            )
        return self


class ScalingArgs(Section):
    """How elastic ranks (``dp_size: {min, max}``) follow the load (deployments/scaling.py).
    The ingress decides how many ranks it wants; Serve starts and releases their replicas.
    Ignored with a fixed ``dp_size``."""

    # One rank's queue of this many seconds of work is what a closed loop of a few clients
    # keeps on a busy rank; more means requests wait behind each other.
    target_queue_s: float = Field(
        0.05,
        gt=0,
        description="Work queued per rank (seconds, by the ranks' fitted cost model) above "
        "which the ingress wants one rank more.",
    )
    upscale_after_s: float = Field(
        2.0,
        gt=0,
        description="How long the queue must stay above target_queue_s per rank (on average) "
        "before another rank is started.",
    )
    downscale_after_s: float = Field(
        15.0,
        gt=0,
        description="How long the queued work must fit one rank fewer at half of "
        "target_queue_s before a rank is given no new work (then parked: park_after_s). "
        "A GPU config may wait longer: a real checkpoint takes minutes to load again.",
    )
    park_after_s: float = Field(
        10.0,
        ge=0,
        description="A rank given no new work releases its replica (process, GPU, CPUs) once "
        "it has had no call for this long (Serve's downscale_to_zero_delay_s, after its "
        "look-back window).",
    )
    start_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A rank started for the load that has not answered within this long (no "
        "GPU free, a failing start) is reported with Serve's reason and left parked; the "
        "service goes on with the live ranks and tries it again after as long. With ranks "
        "on CUDA it must cover a start: model.auto_budget_s (none with execution 'eager') "
        "+ 60 s + the checkpoint's vision weights read at 100 MB/s.",
    )

    def autoscaling_config(self) -> dict[str, Any]:
        """Serve's autoscaling of an elastic rank: 0 or 1 replica, Serve's default policy.
        A call waiting at a handle starts a replica at once (its router tells the
        controller as soon as a call queues for a deployment with none); a rank with no
        call for its look-back window and ``park_after_s`` is released, after its calls
        finish. The ingress sends an unwanted rank no call at all, so that is when it
        parks (deployments/scaling.py)."""
        return {
            "min_replicas": 0,
            "initial_replicas": 0,
            "max_replicas": 1,
            "target_ongoing_requests": 1,
            "upscale_delay_s": 0,
            "downscale_delay_s": self.park_after_s,
            "downscale_to_zero_delay_s": self.park_after_s,
            "metrics_interval_s": METRICS_INTERVAL_S,
            "look_back_period_s": LOOK_BACK_S,
        }


# Serve's defaults (10 s pushes, a 30 s window) would park an idle rank 40 s late.
METRICS_INTERVAL_S = 1.0
LOOK_BACK_S = 5.0


# Where each key of the flat args of earlier releases now lives.
MOVED = {
    **{key: f"model.{key}" for key in ModelArgs.model_fields},
    "rank_actor_options": "ranks.actor_options",
    "rank_options": "ranks.serve_options",
    **{key: f"ranks.batching.{key}" for key in BatchingArgs.model_fields},
    "feature_cache_bytes": "ranks.cache_bytes",
    "calibration_grids": "ranks.calibration_grids",
    "max_inflight_bytes": "ranks.max_inflight_bytes",
    "ingress_replicas": "ingress.replicas",
    "ingress_actor_options": "ingress.actor_options",
    "ingress_options": "ingress.serve_options",
    **{key: f"ingress.limits.{key}" for key in RequestLimits.model_fields},
    "body_timeout_s": "ingress.body_pace.timeout_s",
    "body_grace_s": "ingress.body_pace.grace_s",
    "body_min_bytes_per_s": "ingress.body_pace.min_bytes_per_s",
    "max_concurrent_bodies": "ingress.max_concurrent_bodies",
    "request_timeout_s": "ingress.request_timeout_s",
    "api_key_file": "ingress.api_key_file",
    "ingress_cache_bytes": "ingress.cache_bytes",
    "cost_model": "dispatch.cost_model",
    "cache_affinity_tolerance": "dispatch.affinity_tolerance",
    "load_report_interval_ms": "dispatch.load_report_interval_ms",
    "rank_route_timeout_s": "dispatch.route_timeout_s",
    "rank_slow_after_s": "dispatch.slow_after_s",
    "rank_slow_factor": "dispatch.slow_factor",
    "rank_cooldown_s": "dispatch.cooldown_s",
    "image_urls": "handoff.image_urls",
    "ec_root": "handoff.ec_root",
    "handoff_wait_s": "handoff.wait_s",
    "handoff_send_timeout_s": "handoff.send_timeout_s",
    "handoff_max_pending": "handoff.max_pending",
    "handoff_address_ttl_s": "handoff.address_ttl_s",
}


def nested(path: str) -> str:
    """``ranks.batching.max_batch_patches`` as YAML: ``ranks: {batching: {max_batch_patches:
    ...}}``."""
    head, _, rest = path.partition(".")
    return f"{head}: {{{nested(rest)}}}" if rest else f"{head}: ..."


class AppArgs(Section):
    """Arguments of the encode server, one section per component. Validation errors fail
    the deploy."""

    model: ModelArgs = part(
        ModelArgs,
        "The checkpoint, its seed, the ranks' device and dtypes, the default "
        "preprocessing backend.",
    )
    dp_size: int | DpRange = Field(
        1,
        description="Encoder ranks (vision data parallelism), one per GPU: an int for that many "
        "ranks always running, or {min: M, max: N} for elastic ranks that follow the load "
        "(scaling).",
    )
    ranks: RankArgs = part(
        RankArgs,
        "Every encoder rank: resources, Serve options, batching, feature cache, "
        "calibration, memory leases.",
    )
    ingress: IngressArgs = part(
        IngressArgs,
        "The HTTP ingress: replicas, resources, Serve options, request limits, "
        "body pace, timeout, API key, ingress cache.",
    )
    dispatch: DispatchArgs = part(
        DispatchArgs,
        "Owner assignment and failover at the ingress: cost model, cache "
        "affinity, load reports, slow and failed ranks.",
    )
    handoff: HandoffArgs = part(
        HandoffArgs,
        "The engine hand-off: image URLs, vLLM's encoder-cache directory, "
        "sglang's receive addresses.",
    )
    scaling: ScalingArgs = part(
        ScalingArgs,
        "Elastic ranks (dp_size {min, max}): queue target, how soon ranks start and park.",
    )
    glibc_tunables: str = Field(
        GLIBC_TUNABLES,
        description="GLIBC_TUNABLES of the app's replica processes (ingress, ranks, hand-off "
        "registry): the default keeps glibc's malloc from mapping and unmapping a fresh "
        "block for each multi-MB answer body (no per-block mmap, freed memory kept up to "
        "256 MB per heap), so each body reuses pages already faulted in; '' leaves the "
        "cluster's environment as it is.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """A flat key of earlier releases fails naming where it lives now."""
        if not isinstance(data, dict):
            return data
        moved = [key for key in data if key in MOVED]
        if moved:
            raise ValueError(
                " ".join(f"`{key}` moved: write it as `{nested(MOVED[key])}`." for key in moved)
                + " (args are grouped by component; see docs/api.md, Configuration)"
            )
        return data

    @field_validator("dp_size", mode="before")
    @classmethod
    def _dp_size(cls, value: Any) -> int | DpRange:
        """An int >= 1 or {min, max}, checked here so an error names one shape, not both."""
        if isinstance(value, DpRange):
            return value
        if isinstance(value, dict):
            try:
                return DpRange(**value)
            except ValidationError as exc:
                problems = "; ".join(
                    ".".join(map(str, e["loc"])) + ": " + e["msg"] if e["loc"] else e["msg"]
                    for e in exc.errors()
                ).replace("Value error, ", "")
                raise ValueError(
                    f"dp_size {value!r} is not a valid range ({problems}); write {{min: M, "
                    "max: N} with 1 <= M <= N, or an int for a fixed number of ranks."
                ) from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"dp_size must be an int >= 1 (ranks always running, one per GPU) or {{min: M, "
                f"max: N}} (elastic ranks), got {value!r}."
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

    @model_validator(mode="after")
    def _cuda_needs_gpus(self) -> AppArgs:
        gpus = self.ranks.actor_options.num_gpus
        if self.model.device == "cuda" and gpus <= 0:
            raise ValueError(
                f"model.device 'cuda' needs ranks.actor_options.num_gpus >= 1 (got {gpus}); "
                "set ranks: {actor_options: {num_gpus: 1}} or model: {device: cpu}."
            )
        return self

    @model_validator(mode="after")
    def _graphs_need_cuda(self) -> AppArgs:
        device = self.model_as_run.device
        if self.model.execution == "graphs" and device != "cuda":
            raise ValueError(
                f"model.execution 'graphs' captures CUDA graphs, but the ranks run on "
                f"{device!r}; set model: {{device: cuda}} with ranks: {{actor_options: "
                "{num_gpus: 1}}, or model.execution 'compiled', 'eager' or 'auto'."
            )
        return self

    @model_validator(mode="after")
    def _start_timeout_covers_a_start(self) -> AppArgs:
        """An elastic GPU rank woken for the load gets scaling.start_timeout_s to answer:
        its execution's build (model.auto_budget_s, unless eager) and its checkpoint's
        load (``weights.start_allowance_s``) must fit, or it is given up on as it warms."""
        if not self.elastic or self.model_as_run.device != "cuda":
            return self
        model, timeout = self.model, self.scaling.start_timeout_s
        build_s = 0.0 if model.execution == "eager" else model.auto_budget_s
        load_s, priced = start_allowance_s(model.checkpoint)
        if timeout < build_s + load_s:
            need = math.ceil(build_s + load_s)
            build = (
                "model.execution 'eager' (nothing built at start)"
                if model.execution == "eager"
                else f"model.auto_budget_s={build_s:g} s (model.execution {model.execution!r} "
                "builds at start)"
            )
            raise ValueError(
                f"scaling.start_timeout_s={timeout:g} is shorter than an elastic GPU rank's "
                f"start: {build} + {load_s:.0f} s to start and load model.checkpoint "
                f"{model.checkpoint!r} ({priced}) = {need} s. Set scaling: {{start_timeout_s: "
                f"{need}}} or more"
                + ("." if model.execution == "eager" else ", or a smaller model.auto_budget_s.")
            )
        return self

    @model_validator(mode="after")
    def _ingress_cache_needs_rank_cache(self) -> AppArgs:
        if self.ingress.cache_bytes and not self.ranks.cache_bytes:
            raise ValueError(
                f"ingress.cache_bytes={self.ingress.cache_bytes} keeps the features the ranks' "
                "caches hold, but ranks.cache_bytes is 0 (no rank cache); set "
                "ranks.cache_bytes > 0, or ingress.cache_bytes: 0."
            )
        return self

    @property
    def dp_min(self) -> int:
        """Ranks that always run."""
        return self.dp_size if isinstance(self.dp_size, int) else self.dp_size.min

    @property
    def dp_max(self) -> int:
        """Ranks there can be: one deployment each."""
        return self.dp_size if isinstance(self.dp_size, int) else self.dp_size.max

    @property
    def elastic(self) -> bool:
        return self.dp_max > self.dp_min

    @property
    def model_as_run(self) -> ModelArgs:
        """``model`` as the ranks run it (device, dtypes and backend resolved), for the ranks
        and the ingress alike."""
        return self.model.resolved(self.ranks.actor_options.num_gpus)

    @property
    def ranks_as_run(self) -> RankArgs:
        """``ranks`` as each rank runs it: no calibration unless assignment uses it or
        ranks are elastic (the queue in seconds is what they scale on)."""
        if self.dispatch.cost_model == "fitted" or self.elastic:
            return self.ranks
        return self.ranks.model_copy(update={"calibration_grids": []})

    @property
    def ingress_cache_share(self) -> int:
        """Object-store bytes the ingress replicas' caches may keep alive, all together."""
        return self.ingress.replicas * self.ingress.cache_bytes

    def replica_env(self) -> dict:
        """``ray_actor_options`` entries every replica of the app gets (its environment)."""
        if not self.glibc_tunables:
            return {}
        return {"runtime_env": {"env_vars": {"GLIBC_TUNABLES": self.glibc_tunables}}}
