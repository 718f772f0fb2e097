"""``AppArgs``: every section, and where the flat keys of earlier releases moved."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from kimi_encoder.weights import start_allowance_s

from .base import GLIBC_TUNABLES, TRIM_ENV, TUNABLE, Section, part
from .dispatch import DispatchArgs
from .handoff import HandoffArgs
from .ingress import IngressArgs, RequestLimits
from .model import ModelArgs
from .ranks import BatchingArgs, RankArgs
from .scaling import DpRange, ScalingArgs

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
        "256 MB per heap), so each body reuses pages already faulted in, and at most two "
        "malloc arenas, so that memory stays flat under images of many shapes; '' leaves "
        "the cluster's environment as it is.",
    )
    malloc_trim_s: float = Field(
        5.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds between malloc_trim(0) calls in each replica process (ingress, "
        "ranks, hand-off registry, scaler; passed as KIMI_ENCODER_MALLOC_TRIM_S): freed heap "
        "pages go back to the kernel, so resident memory follows what is in use under images "
        "of many shapes (docs/benchmarks.md, Soak); 0: never.",
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
        env = {TRIM_ENV: f"{self.malloc_trim_s:g}"}
        if self.glibc_tunables:
            env["GLIBC_TUNABLES"] = self.glibc_tunables
        return {"runtime_env": {"env_vars": env}}
