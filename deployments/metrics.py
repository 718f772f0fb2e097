"""Metrics, per-request traces and summary logs of the encode server.

Every metric is a ``ray.serve.metrics`` object, exported by each node's metrics
agent with a ``ray_`` prefix (counters also get ``_total``, histograms
``_bucket``/``_sum``/``_count``); Serve adds the ``application``,
``deployment`` and ``replica`` tags. Our own tag values are bounded: a rank
index, one of ``STAGES``, ``OUTCOMES`` or ``BACKEND_TAGS``; never a request id.

The ingress records the request-level stages (admission, gather, end to end),
the transfer back from each rank and the in-flight load it has dispatched to
each rank; a rank records its queue wait, preprocessing, forward, batch size
and what it encoded. README.md ("Metrics") lists the names and tags.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ray.serve import metrics

log = logging.getLogger("ray.serve")

PREFIX = "kimi_encoder_"
# Stages, in the order a request meets them. `queue_wait`, `preprocess` and `forward`
# are measured on the owner rank, `transfer` (rank done -> ingress has the result) and
# the rest on the ingress.
STAGES = ("admission", "queue_wait", "preprocess", "forward", "transfer", "gather", "end_to_end")
RANK_STAGES = ("queue_wait", "preprocess", "forward", "transfer")
# The `type` of every error docs/api.md lists, plus `cancelled` (client gone, timeout).
OUTCOMES = (
    "ok",
    "invalid_request",
    "unauthorized",
    "limit_exceeded",
    "unsupported_media_type",
    "validation_error",
    "internal_error",
    "unavailable",
    "timeout",
    "cancelled",
)
# The error type of each status the ingress returns (one type per status, docs/api.md).
STATUS_OUTCOMES = {
    200: "ok",
    400: "invalid_request",
    401: "unauthorized",
    413: "limit_exceeded",
    415: "unsupported_media_type",
    422: "validation_error",
    500: "internal_error",
    503: "unavailable",
    504: "timeout",
}
INGRESS_RANK = "ingress"  # `rank` tag of the stages that belong to the whole request
BACKEND_TAGS = ("cpu", "gpu", "none")  # `none`: the request failed before it had one
# Milliseconds: sub-ms header parsing up to minute-long batches of big images.
MS_BOUNDARIES = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000]

# (name without prefix, kind, tag keys, description); the exported names are derived.
DEFINITIONS = (
    ("requests", "counter", ("outcome",), "Encode requests by outcome: ok or the error type."),
    ("images", "counter", ("rank",), "Images encoded by each rank."),
    ("patches", "counter", ("rank",), "Patches (sum of t*h*w) encoded by each rank."),
    ("tokens", "counter", ("rank",), "LLM tokens (feature rows) produced by each rank."),
    (
        "stage_ms",
        "histogram",
        ("stage", "rank", "backend"),
        "Milliseconds spent in each stage; rank 'ingress' for request-level stages.",
    ),
    (
        "inflight_patches",
        "gauge",
        ("rank",),
        "Patches dispatched to a rank and not yet answered (as seen by one ingress replica).",
    ),
    (
        "inflight_bytes",
        "gauge",
        ("rank",),
        "Input bytes (encoded files or pixel values) dispatched to a rank, not yet answered.",
    ),
    ("batch_images", "gauge", ("rank",), "Images in the rank's latest tower+projector batch."),
    (
        "leased_bytes",
        "gauge",
        ("rank",),
        "Bytes of inputs, pixels and features a rank holds under memory leases now.",
    ),
)


def exported_names() -> set[str]:
    """Every series name the metrics agent exports for ``DEFINITIONS`` (with ``ray_``)."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return {
        f"ray_{PREFIX}{name}{suffix}"
        for name, kind, _, _ in DEFINITIONS
        for suffix in suffixes[kind]
    }


_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "kimi_encoder_trace", default=None
)


@dataclass
class RequestTrace:
    """What one encode request did, filled in as it goes; logged once at the end."""

    request_id: str
    started: float = field(default_factory=time.perf_counter)
    status: int = 500  # the HTTP status answered; the ingress sets it
    backend: str = "none"
    images: int = 0
    patches: int = 0
    owners: list[int] = field(default_factory=list)
    results_at: float | None = None  # perf_counter when every rank's result was in
    stages_ms: dict[str, float] = field(default_factory=dict)  # request-level stages
    ranks_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> stage -> ms

    def mark(self, stage: str, since: float) -> float:
        """Record ``stage`` as lasting from ``since`` (perf_counter) until now; its ms."""
        self.stages_ms[stage] = (time.perf_counter() - since) * 1e3
        return self.stages_ms[stage]

    def admitted(self, items: list[Any], admitted_at: float) -> None:
        """Note what admission let through and when it finished (perf_counter)."""
        self.stages_ms["admission"] = (admitted_at - self.started) * 1e3
        self.images = len(items)
        self.patches = sum(item.num_patches for item in items)
        deferred = [item.deferred for item in items if item.deferred is not None]
        self.backend = deferred[0].backend if deferred else "none"

    def ranks_done(self, ranks: list[int], results: list[dict], calls: list[Stamped]) -> None:
        """Each rank's own stage times plus its transfer back to the ingress."""
        for rank, result, call in zip(ranks, results, calls, strict=True):
            stages = dict(result.get("stages_ms", {}))
            if call.arrived_at is not None and "done_at" in result:
                stages["transfer"] = max(0.0, call.arrived_at - result["done_at"]) * 1e3
            self.ranks_ms[rank] = stages

    def rank_timings(self) -> dict[str, float]:
        """``rank_R_<stage>`` keys for the response's ``timings_ms``."""
        return {
            f"rank_{rank}_{stage}": ms
            for rank, stages in sorted(self.ranks_ms.items())
            for stage, ms in stages.items()
        }


def current_trace() -> RequestTrace | None:
    """The trace of the request this task is serving (set by ``IngressMetrics.trace``)."""
    return _current.get()


def request_id_of(headers: Mapping[str, str]) -> str:
    """The incoming ``X-Request-ID`` (Serve's proxy sets one when the client did not)."""
    return headers.get("x-request-id") or uuid.uuid4().hex


class Stamped:
    """A Serve ``DeploymentResponse`` that notes the ``time.time()`` its result arrived.

    Awaitable and cancellable like the response it wraps; ``arrived_at`` minus the
    rank's ``done_at`` is that rank's transfer-back time.
    """

    def __init__(self, response: Any):
        self.response = response
        self.arrived_at: float | None = None

    def __await__(self) -> Any:
        result = yield from self.response.__await__()
        self.arrived_at = time.time()
        return result

    def cancel(self) -> None:
        self.response.cancel()


def dispatch_loads(groups: Mapping[int, list[int]], items: list[Any]) -> dict[int, tuple]:
    """``{rank: (images, patches, bytes)}`` of a fan-out (``groups``: rank -> item indices)."""

    def size(item: Any) -> int:
        return len(item.image) if item.image is not None else item.pixel_values.nbytes

    return {
        rank: (len(idx), sum(items[i].num_patches for i in idx), sum(size(items[i]) for i in idx))
        for rank, idx in groups.items()
    }


def _make(name: str) -> Any:
    for short, kind, tag_keys, description in DEFINITIONS:
        if short == name:
            full = PREFIX + short
            if kind == "counter":
                return metrics.Counter(full, description=description, tag_keys=tag_keys)
            if kind == "gauge":
                return metrics.Gauge(full, description=description, tag_keys=tag_keys)
            return metrics.Histogram(
                full, description=description, boundaries=MS_BOUNDARIES, tag_keys=tag_keys
            )
    raise KeyError(name)


def _backend_tag(backend: str | None) -> str:
    return backend if backend in BACKEND_TAGS else "none"


class IngressMetrics:
    """Request outcomes, request-level stages, transfers and in-flight load per rank."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self.requests = _make("requests")
        self.stage_ms = _make("stage_ms")
        self.inflight_patches = _make("inflight_patches")
        self.inflight_bytes = _make("inflight_bytes")
        # rank -> [requests, images, patches, bytes] dispatched and not yet answered.
        self.inflight = {rank: [0, 0, 0, 0] for rank in range(dp_size)}
        for rank in range(dp_size):
            self._publish(rank)

    @contextmanager
    def trace(self, request_id: str) -> Iterator[RequestTrace]:
        """Trace one request; count its outcome, observe its stages and log its summary.

        The caller sets ``trace.status``; an exception escaping the block counts as
        ``internal_error``, a cancellation (client gone, timeout) as ``cancelled``.
        """
        trace = RequestTrace(request_id)
        token = _current.set(trace)
        try:
            yield trace
        except BaseException as exc:
            trace.status = 499 if isinstance(exc, asyncio.CancelledError) else 500
            raise
        finally:
            _current.reset(token)
            self.finish(trace, trace.status)

    def finish(self, trace: RequestTrace, status: int) -> None:
        outcome = "cancelled" if status == 499 else STATUS_OUTCOMES.get(status, "internal_error")
        backend = _backend_tag(trace.backend)
        trace.stages_ms["end_to_end"] = (time.perf_counter() - trace.started) * 1e3
        self.requests.inc(1, tags={"outcome": outcome})
        for stage, ms in trace.stages_ms.items():
            self.observe(stage, INGRESS_RANK, backend, ms)
        for rank, stages in trace.ranks_ms.items():
            if "transfer" in stages:  # the rank itself observes its other stages
                self.observe("transfer", str(rank), backend, stages["transfer"])
        summary = {
            "outcome": outcome,
            "status": status,
            "backend": trace.backend,
            "images": trace.images,
            "patches": trace.patches,
            "owners": trace.owners,
            "stages_ms": {k: round(v, 3) for k, v in trace.stages_ms.items()},
            "ranks_ms": {
                str(r): {k: round(v, 3) for k, v in s.items()}
                for r, s in sorted(trace.ranks_ms.items())
            },
        }
        log.info(
            "encode request %s done: %s (HTTP %d), %d images, %d patches, owners %s, %.1f ms",
            trace.request_id,
            outcome,
            status,
            trace.images,
            trace.patches,
            trace.owners,
            trace.stages_ms["end_to_end"],
            extra={"kimi_encoder_summary": summary},
        )

    def observe(self, stage: str, rank: str, backend: str, ms: float) -> None:
        assert stage in STAGES, stage
        self.stage_ms.observe(ms, tags={"stage": stage, "rank": rank, "backend": backend})

    @contextmanager
    def dispatched(self, loads: Mapping[int, tuple[int, int, int]]) -> Iterator[None]:
        """Count ``{rank: (images, patches, bytes)}`` as in flight while the block runs."""
        for rank, (images, patches, size) in loads.items():
            self._add(rank, 1, images, patches, size)
        try:
            yield
        finally:
            for rank, (images, patches, size) in loads.items():
                self._add(rank, -1, -images, -patches, -size)

    def load(self) -> list[dict[str, int]]:
        """Each rank's in-flight requests, images, patches and bytes (this ingress replica)."""
        keys = ("requests", "images", "patches", "bytes")
        return [
            {"rank": rank, **{f"inflight_{k}": v for k, v in zip(keys, counts, strict=True)}}
            for rank, counts in self.inflight.items()
        ]

    def _add(self, rank: int, *deltas: int) -> None:
        counts = self.inflight[rank]
        for i, delta in enumerate(deltas):
            counts[i] += delta
        self._publish(rank)

    def _publish(self, rank: int) -> None:
        tags = {"rank": str(rank)}
        self.inflight_patches.set(self.inflight[rank][2], tags=tags)
        self.inflight_bytes.set(self.inflight[rank][3], tags=tags)


class RankMetrics:
    """What one rank encoded, its stage times and its batch sizes."""

    def __init__(self, rank: int):
        self.tags = {"rank": str(rank)}
        self.images = _make("images")
        self.patches = _make("patches")
        self.tokens = _make("tokens")
        self.stage_ms = _make("stage_ms")
        self.batch_images = _make("batch_images")
        self.batch_images.set(0, tags=self.tags)
        self.leased_bytes = _make("leased_bytes")

    def leased(self, nbytes: int) -> None:
        """The bytes the rank's memory leases hold now (max_inflight_bytes bounds them)."""
        self.leased_bytes.set(nbytes, tags=self.tags)

    def encoded(
        self, images: int, patches: int, tokens: int, backend: str, stages_ms: Mapping[str, float]
    ) -> None:
        self.images.inc(images, tags=self.tags)
        self.patches.inc(patches, tags=self.tags)
        self.tokens.inc(tokens, tags=self.tags)
        self.batch_images.set(images, tags=self.tags)
        for stage, ms in stages_ms.items():
            assert stage in RANK_STAGES, stage
            tags = {**self.tags, "stage": stage, "backend": _backend_tag(backend)}
            self.stage_ms.observe(ms, tags=tags)
