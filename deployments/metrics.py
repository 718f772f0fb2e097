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
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ray.serve import metrics

from kimi_encoder.items import EncoderItem

from .errors import OUTCOMES, classify
from .fanout import Gathered

log = logging.getLogger("ray.serve")

PREFIX = "kimi_encoder_"
# Stages, in the order a request meets them. `queue_wait`, `preprocess` and `forward`
# are measured on the owner rank, `transfer` (rank done -> ingress has the result) and
# the rest on the ingress.
STAGES = (
    "admission",
    "queue_wait",
    "preprocess",
    "forward",
    "deliver",
    "transfer",
    "gather",
    "end_to_end",
)
RANK_STAGES = ("queue_wait", "preprocess", "forward", "transfer")  # of every rank call
DELIVER = "deliver"  # of a call whose rank delivers its features itself (sinks.py)
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
        "padding_share",
        "gauge",
        ("rank",),
        "Padding rows per real row of a rank's batches in graph buckets since it started "
        "(0 outside the graphs mode).",
    ),
    (
        "leased_bytes",
        "gauge",
        ("rank",),
        "Bytes of inputs, pixels and features a rank holds under memory leases now.",
    ),
    (
        "ranks_live",
        "gauge",
        (),
        "Ranks with a running replica taking work: as the ingress replicas see them (a fixed "
        "dp_size), or as the app's scaler decided (elastic ranks).",
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


@dataclass
class RequestTrace:
    """What one encode request did, filled in as it goes; logged once at the end."""

    request_id: str
    started: float = field(default_factory=time.perf_counter)
    status: int = 500  # the HTTP status answered
    outcome: str = "internal_error"  # "ok" or the error type (deployments/errors.py)
    backend: str = "none"
    images: int = 0
    patches: int = 0
    owners: list[int] = field(default_factory=list)
    admitted_at: float | None = None  # perf_counter when admission finished
    gathered_at: float | None = None  # perf_counter when every rank's result was in
    rank_encode_ms: dict[int, float] = field(default_factory=dict)  # rank -> its encode call
    stages_ms: dict[str, float] = field(default_factory=dict)  # request-level stages
    ranks_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> stage -> ms

    def admitted(self, items: Sequence[EncoderItem]) -> None:
        """Note what admission let through, and that it finished now."""
        self.admitted_at = time.perf_counter()
        self.stages_ms["admission"] = (self.admitted_at - self.started) * 1e3
        self.images = len(items)
        self.patches = sum(item.num_patches for item in items)
        deferred = [item.deferred for item in items if item.deferred is not None]
        self.backend = deferred[0].backend if deferred else "none"

    def gathered(self, gathered: Gathered) -> None:
        """Owners, and each rank's own stage times plus its transfer back to the ingress."""
        self.gathered_at = time.perf_counter()
        self.owners = list(gathered.owners)
        for rank, answer in gathered.answers.items():
            self.rank_encode_ms[rank] = answer.reply.encode_ms
            self.ranks_ms[rank] = {**answer.reply.stages_ms, "transfer": answer.transfer_ms}

    def timings(self) -> dict[str, float]:
        """The response's ``timings_ms``: admit, encode, rank_R, rank_R_<stage>, gather, total;
        marks the end of ``gather`` (the response body is written by then)."""
        assert self.admitted_at is not None, self
        assert self.gathered_at is not None, self
        now = time.perf_counter()
        self.stages_ms["gather"] = (now - self.gathered_at) * 1e3
        out = {
            "admit": self.stages_ms["admission"],
            "encode": (self.gathered_at - self.admitted_at) * 1e3,
            **{f"rank_{rank}": ms for rank, ms in sorted(self.rank_encode_ms.items())},
            **{
                f"rank_{rank}_{stage}": ms
                for rank, stages in sorted(self.ranks_ms.items())
                for stage, ms in stages.items()
            },
            "gather": self.stages_ms["gather"],
            "total": (now - self.started) * 1e3,
        }
        return {k: round(v, 3) for k, v in out.items()}


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


def _input_bytes(item: EncoderItem) -> int:
    return len(item.image) if item.image is not None else item.pixel_values.nbytes


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
        self.live = _make("ranks_live")
        # rank -> [requests, images, patches, bytes] dispatched and not yet answered.
        self.inflight = {rank: [0, 0, 0, 0] for rank in range(dp_size)}
        for rank in range(dp_size):
            self._publish(rank)

    @contextmanager
    def trace(self, request_id: str) -> Iterator[RequestTrace]:
        """Trace one request; count its outcome, observe its stages and log its summary.

        A block that ends normally answered 200; an exception escaping it is classified
        by the error table (deployments/errors.py), a cancellation (client gone,
        timeout) counts as ``cancelled``.
        """
        trace = RequestTrace(request_id)
        try:
            yield trace
            trace.status, trace.outcome = 200, "ok"
        except asyncio.CancelledError:
            trace.status, trace.outcome = 499, "cancelled"
            raise
        except BaseException as exc:
            trace.status, trace.outcome = classify(exc)
            raise
        finally:
            self.finish(trace)

    def finish(self, trace: RequestTrace) -> None:
        outcome, status = trace.outcome, trace.status
        assert outcome in OUTCOMES, outcome
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
    def dispatched(self, groups: Mapping[int, Sequence[EncoderItem]]) -> Iterator[None]:
        """Count ``{rank: items}`` as in flight while the block runs."""
        loads = {
            rank: (len(items), sum(i.num_patches for i in items), sum(map(_input_bytes, items)))
            for rank, items in groups.items()
        }
        for rank, (images, patches, size) in loads.items():
            self._add(rank, 1, images, patches, size)
        try:
            yield
        finally:
            for rank, (images, patches, size) in loads.items():
                self._add(rank, -1, -images, -patches, -size)

    def ranks_live(self, count: int) -> None:
        """How many ranks take work now (elastic ranks change it)."""
        self.live.set(count)

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


class ScalerMetrics:
    """The elastic ranks' decision: how many ranks take work (one series for the app)."""

    def __init__(self):
        self.live = _make("ranks_live")

    def ranks_live(self, count: int) -> None:
        self.live.set(count)


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
        self.padding_share = _make("padding_share")
        self.padding_share.set(0, tags=self.tags)
        self.leased_bytes = _make("leased_bytes")

    def leased(self, nbytes: int) -> None:
        """The bytes the rank's memory leases hold now (max_inflight_bytes bounds them)."""
        self.leased_bytes.set(nbytes, tags=self.tags)

    def padded(self, share: float) -> None:
        """Padding rows per real row of the rank's bucket batches so far."""
        self.padding_share.set(share, tags=self.tags)

    def encoded(
        self, images: int, patches: int, tokens: int, backend: str, stages_ms: Mapping[str, float]
    ) -> None:
        self.images.inc(images, tags=self.tags)
        self.patches.inc(patches, tags=self.tags)
        self.tokens.inc(tokens, tags=self.tags)
        self.batch_images.set(images, tags=self.tags)
        for stage, ms in stages_ms.items():
            assert stage in (*RANK_STAGES, DELIVER), stage
            tags = {**self.tags, "stage": stage, "backend": _backend_tag(backend)}
            self.stage_ms.observe(ms, tags=tags)
