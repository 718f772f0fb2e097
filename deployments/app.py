"""``build_app``: the one place where deployments are declared, configured and bound.

Configs name it as ``import_path: deployments.app:build_app``; Serve validates
the ``args:`` block into ``AppArgs`` (a bad value fails the deploy). Every
deployment option comes from ``AppArgs``: ``dp_size`` ranks (with ``{min, max}``,
``max`` of them, the first ``min`` with one replica always and the others autoscaled
between 0 and 1 replicas: ``scaling``), each with
``ranks.actor_options`` and ``ranks.serve_options``, ``ingress.replicas`` ingress
replicas with ``ingress.actor_options`` and ``ingress.serve_options``, one
``HandoffRegistry`` replica (the sglang receive addresses all ingress replicas
share, no CPU reserved) and, with elastic ranks, one ``RankScaler`` replica (the
decision every ingress replica follows, no CPU reserved). Each deployment is bound
with its own sections of the args, never the whole. A config's ``deployments:`` entries are only for
overriding one deployment; one that gives a rank other resources than
``ranks.actor_options`` is refused when that rank starts
(``rank.check_resources``).
"""

# No `from __future__ import annotations` here: Serve reads build_app's parameter
# annotation as a class to validate `args:` into AppArgs; a string annotation
# would make it pass the raw dict.

from ray import serve
from ray.serve import Application

from kimi_encoder.encoder import VisionEncoder

from .args import AppArgs
from .decider import RankScaler
from .handoff import HandoffRegistry
from .ingress import EncodeServer
from .rank import EncoderFactory, EncoderRank

INGRESS_NAME = "EncodeServer"
REGISTRY_NAME = "HandoffRegistry"
SCALER_NAME = "RankScaler"
SCALER_SLOTS = 256  # one open ask per ingress replica, its health checks
# Registry calls beyond the parts waiting for addresses: registrations, which return at once.
REGISTRY_SLOTS = 256
# Past the queues the proxy answers 503 with Retry-After (a rank's caller sends its
# images to another rank).
BACKPRESSURE = {"status_code": 503, "retry_after_s": 1}


def rank_name(rank: int) -> str:
    """Deployment name of encoder rank ``rank``; config ``deployments:`` entries use it."""
    return f"EncoderRank_{rank}"


def build_app(args: AppArgs) -> Application:
    """Ingress plus ``dp_size`` encoder ranks (the configs' ``import_path``)."""
    return bind_app(args)


def bind_app(
    args: AppArgs, encoder_factory: EncoderFactory = VisionEncoder.from_pretrained
) -> Application:
    """``build_app`` with the ranks' encoder made by ``encoder_factory`` (called like
    ``VisionEncoder.from_pretrained``): tests pass one that can be slowed down or broken."""
    # One single-replica deployment per rank, the rank a constructor argument, not one
    # N-replica deployment behind a custom RequestRouter: deployments and handles are
    # stable public API; each rank gets its own dashboard row, log file, queue and
    # config overrides; the rank is known even in local testing mode. RequestRouter is
    # alpha, its replica metadata goes stale when ranks are reassigned, and a router with
    # no matching replica spins unless it sets should_backoff.
    # Elastic ranks are the same deployments, each scaled between 0 and 1 replicas by
    # Serve's own autoscaler: the ingress decides which ranks it wants and sends the others
    # no call, so they park; a call waiting for a parked rank starts it (ranks/scaler.py).
    model = args.model_as_run
    rank_options = args.ranks.serve_options.model_dump()
    ranks = [
        serve.deployment(EncoderRank)
        .options(
            name=rank_name(rank),
            ray_actor_options=args.ranks.actor_options.model_dump() | args.replica_env(),
            **rank_options,
            **(
                {"num_replicas": 1}
                if rank < args.dp_min
                else {"autoscaling_config": args.scaling.autoscaling_config()}
            ),
        )
        .bind(rank, model, args.ranks_as_run, args.ingress_cache_share, encoder_factory)
        for rank in range(args.dp_max)
    ]
    ingress_options = args.ingress.serve_options
    ingress = serve.deployment(EncodeServer).options(
        name=INGRESS_NAME,
        num_replicas=args.ingress.replicas,
        ray_actor_options=args.ingress.actor_options.model_dump() | args.replica_env(),
        backpressure_config=BACKPRESSURE,
        **ingress_options.model_dump(),
    )
    # One replica: a part's /scheduler_receive_url and /encode may reach different
    # ingress replicas. Each waiting part holds one call (up to handoff.max_pending).
    registry = serve.deployment(HandoffRegistry).options(
        name=REGISTRY_NAME,
        num_replicas=1,
        ray_actor_options=args.ingress.actor_options.model_dump()
        | args.replica_env()
        | {"num_cpus": 0},
        max_ongoing_requests=args.handoff.max_pending + REGISTRY_SLOTS,
        max_queued_requests=args.handoff.max_pending,
        graceful_shutdown_wait_loop_s=ingress_options.graceful_shutdown_wait_loop_s,
        graceful_shutdown_timeout_s=ingress_options.graceful_shutdown_timeout_s,
    )
    # Elastic ranks: one replica decides how many are wanted, for every ingress replica
    # (deployments/decider.py); it holds a long call from each, so a few hundred slots.
    scaler = None
    if args.elastic:
        scaler = (
            serve.deployment(RankScaler)
            .options(
                name=SCALER_NAME,
                num_replicas=1,
                ray_actor_options=args.ingress.actor_options.model_dump()
                | args.replica_env()
                | {"num_cpus": 0},
                max_ongoing_requests=SCALER_SLOTS,
                max_queued_requests=SCALER_SLOTS,
                graceful_shutdown_wait_loop_s=ingress_options.graceful_shutdown_wait_loop_s,
                graceful_shutdown_timeout_s=ingress_options.graceful_shutdown_timeout_s,
            )
            .bind(ranks, args.dispatch, args.scaling, args.dp_min)
        )
    return ingress.bind(
        ranks,
        registry.bind(args.handoff),
        model,
        args.ingress,
        args.dispatch,
        args.handoff,
        rank_cache=args.ranks.cache_bytes > 0,
        dp_min=args.dp_min,
        scaler=scaler,
    )
