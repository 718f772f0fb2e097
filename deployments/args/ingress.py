"""``ingress``: the HTTP ingress, its limits and body pace."""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator

from kimi_encoder.cache import MAX_ENTRIES

from .base import ActorOptions, Section, ServeOptions, part


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
    cache_entries: int = Field(
        MAX_ENTRIES,
        ge=1,
        description="Most images this cache keeps, whatever their bytes: each entry's key and "
        "mapped array live on the ingress's heap (ranks.cache_entries says why).",
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
