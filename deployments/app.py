"""``build_app``: the one place where deployments are declared and bound.

Configs name it as ``import_path: deployments.app:build_app``; Serve validates
the ``args:`` block into ``AppArgs`` (a bad value fails the deploy).
"""

# No `from __future__ import annotations` here: Serve reads build_app's parameter
# annotation as a class to validate `args:` into AppArgs; a string annotation
# would make it pass the raw dict.

import logging
from typing import Any

from ray import serve
from ray.serve import Application

from kimi_encoder.config import PRESETS

from .args import AppArgs
from .ingress import EncodeServer
from .rank import EncoderRank

log = logging.getLogger("ray.serve")

INGRESS_NAME = "EncodeServer"
RANK_MAX_ONGOING_REQUESTS = 64
# Bounded queues (issue 6): past them a rank's caller gets BackPressureError (the ingress
# sends the images to another rank, or answers 503), and the proxy answers 503 with
# Retry-After. A config's `deployments:` entries override these.
RANK_MAX_QUEUED_REQUESTS = 64
INGRESS_MAX_ONGOING_REQUESTS = 32
INGRESS_MAX_QUEUED_REQUESTS = 64
BACKPRESSURE = {"status_code": 503, "retry_after_s": 1}


def rank_name(rank: int) -> str:
    """Deployment name of encoder rank ``rank``; config ``deployments:`` entries use it."""
    return f"EncoderRank_{rank}"


def build_app(args: AppArgs) -> Application:
    """Ingress plus ``dp_size`` encoder ranks (the configs' ``import_path``)."""
    return bind_app(args)


def bind_app(
    args: AppArgs,
    deployment_options: dict[str, Any] | None = None,
    ingress_options: dict[str, Any] | None = None,
) -> Application:
    """Ingress plus ``dp_size`` encoder ranks; ``deployment_options`` go to every deployment.

    ``deployment_options`` (e.g. ``graceful_shutdown_timeout_s``) play the role of a
    config's ``deployments:`` entries for callers of ``serve.run`` such as tests;
    ``ingress_options`` (e.g. ``num_replicas``) go to the ingress only.
    """
    if args.checkpoint in PRESETS:
        log.warning(
            "checkpoint %r is a preset: seeded random weights (seed %d), features are "
            "meaningless; pass a checkpoint directory for real ones.",
            args.checkpoint,
            args.seed,
        )
    extra = deployment_options or {}
    actor = args.rank_actor_options
    # One single-replica deployment per rank, the rank a constructor argument (option A
    # of shared/notes/ray-serve-2.60.md), not one N-replica deployment behind a custom
    # RequestRouter: deployments and handles are stable public API; each rank gets its own
    # dashboard row, log file, queue/backpressure and config overrides; the rank is known
    # even in local testing mode. RequestRouter is alpha, its replica metadata goes stale
    # when ranks are reassigned, and a router with no matching replica spins unless it
    # sets should_backoff.
    ranks = [
        serve.deployment(EncoderRank)
        .options(
            name=rank_name(r),
            num_replicas=1,
            ray_actor_options={
                "num_cpus": actor.num_cpus,
                "num_gpus": actor.num_gpus,
                **({"resources": actor.resources} if actor.resources else {}),
            },
            # Cross-request batching needs calls in flight, and load reports must get in
            # while a rank is busy: a rank holds many cheap awaiting calls.
            **{
                "max_ongoing_requests": RANK_MAX_ONGOING_REQUESTS,
                "max_queued_requests": RANK_MAX_QUEUED_REQUESTS,
                **extra,
            },
        )
        .bind(
            r,
            args.checkpoint,
            device=args.rank_device,
            dtype=args.dtype,
            backend=args.default_backend,
            seed=args.seed,
            num_cpus=actor.num_cpus,
            batching=args.batching_config(),
            max_inflight_bytes=args.max_inflight_bytes,
            fault_injection=args.fault_injection,
        )
        for r in range(args.dp_size)
    ]
    # The ingress only parses headers and moves arrays: no CPU reservation.
    ingress = serve.deployment(EncodeServer).options(
        **{
            "name": INGRESS_NAME,
            "num_replicas": 1,
            "ray_actor_options": {"num_cpus": 0},
            "max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
            "max_queued_requests": INGRESS_MAX_QUEUED_REQUESTS,
            "backpressure_config": BACKPRESSURE,
            **extra,
            **(ingress_options or {}),
        }
    )
    return ingress.bind(ranks, args)
