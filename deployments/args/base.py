"""Sections and the options every deployment takes (Ray Serve's and Ray's)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# What the replica processes ask of glibc's malloc: never hand a large block its own mmap
# (mmap_max=0), and give memory back to the kernel only when more than 256 MB is free at
# the top of a heap (trim_threshold). An answer body of tens of MB is otherwise a fresh
# mapping each time, every page of it faulted in and zeroed on first write, then unmapped
# when freed; kept in the heap, the next body reuses pages already mapped. It moved more
# answer bytes per second than glibc's defaults and than huge-page malloc (docs/api.md,
# "Measurements behind the code"). The price: up to trim_threshold of freed memory stays
# resident per heap. And at most two malloc arenas (arena_max=2) however many threads
# allocate: with glibc's default (8 per core) each of a replica's dozens of threads
# (Ray's, Serve's, decode, forward) scatters its long-lived blocks over its own heaps,
# whose free space between them is never given back; with two, a 60-minute soak's
# processes stayed within max(16 MiB, 5%) of their size after warm-up at the same
# throughput (docs/benchmarks.md, "Soak").
GLIBC_TUNABLES = (
    "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=268435456:glibc.malloc.arena_max=2"
)
# The replicas' environment variable of ``malloc_trim_s`` (deployments/heap.py).
TRIM_ENV = "KIMI_ENCODER_MALLOC_TRIM_S"
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
