"""kimi-encoder's encoder-cache connector for vLLM 0.33.0: features pushed over the network.

Loaded by vLLM from its config, in vLLM's own processes (install kimi-encoder in vLLM's
environment; this module needs torch, pyzmq and vLLM, never Ray)::

    vllm serve <Kimi-K3 checkpoint> --ec-transfer-config '{"ec_connector":
      "KimiEncoderConnector", "ec_connector_module_path":
      "kimi_encoder.engines.vllm_connector", "ec_role": "ec_consumer",
      "ec_ip": "10.0.0.5", "ec_port": 14579}'

- Worker side (each TP worker of the first pipeline stage): a ``Receiver`` listens at
  ``ec_ip:ec_port + dp_index * tp_size + tp_rank`` and stages each pushed item by its
  mm_hash (at most ``ec_buffer_size`` bytes; a push that does not fit even after the
  oldest unreferenced items are evicted is answered busy); ``start_load_caches`` copies
  the items the scheduler planned into vLLM's encoder cache on the worker's device and
  leaves them staged.
- Scheduler side: a ``Watcher`` of its engine's workers. A request holds every item it
  names on every worker from the first time the scheduler looks at it until it finishes
  (``request_finished``), so a preempted request, or one whose item vLLM's encoder
  cache dropped, loads it again from the worker. A request is scheduled only once every
  image it still needs is staged and held on every worker (``ensure_cache_available``);
  an image that has not arrived within ``wait_timeout_s`` fails the request (vLLM
  reports it as a retryable error) saying why: never pushed, expired unclaimed, evicted
  under ``ec_buffer_size``, released, or lost with a restarted worker (that one fails
  the requests waiting for it at once). Nothing is encoded locally: this consumer takes
  every image's features from the encoder.
- Stats (``get_ec_connector_stats``, vLLM's periodic log and its Prometheus metrics
  ``vllm:kimi_encoder_ec_items_total{event=...}``): item copies staged, released,
  expired, evicted and lost, as the workers report them (one per worker), and items
  loaded and loaded again, as the scheduler plans them.

``ec_connector_extra_config``: ``wait_timeout_s`` (60), ``staged_ttl_s`` (300: a staged
item no request names is dropped after it).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from .ecreceive import (
    EVICTED,
    EXPIRED,
    LOST,
    RELEASED,
    UNSEEN,
    Receiver,
    Staging,
    Watcher,
    worker_ports,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 60.0
STAGED_TTL_S = 300.0
STAT_NAMES = ("staged", "loaded", "loaded_again", RELEASED, EXPIRED, EVICTED, LOST)
RECENT_LOADS = 1 << 16  # hashes remembered to count a load as a second one


@dataclass
class KimiEncoderMetadata(ECConnectorMetadata):
    """One step's loads: the mm_hashes to copy from staging into the encoder cache, with
    the rows the scheduler planned for each; ``step`` numbers the steps that load."""

    loads: dict[str, int] = field(default_factory=dict)
    step: int = 0


@dataclass
class KimiEncoderStats(ECConnectorStats):
    """Counts of items by what happened to them since the last report (``STAT_NAMES``)."""

    def __post_init__(self) -> None:
        for name in STAT_NAMES:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_NAMES, 0)

    def aggregate(self, other: ECConnectorStats) -> KimiEncoderStats:
        for name in STAT_NAMES:
            self.data[name] += int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data[name] for name in STAT_NAMES}

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in STAT_NAMES)


class KimiEncoderPromMetrics(ECConnectorPromMetrics):
    """``vllm:kimi_encoder_ec_items_total``, one series per event and engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(
            name="vllm:kimi_encoder_ec_items_total",
            documentation="Pushed encoder outputs by event: staged, loaded, loaded_again, "
            "released, expired, evicted, lost (kimi-encoder's connector).",
            labelnames=[*labelnames, "event"],
        )
        self._series = {
            (engine, name): counter.labels(*values, name)
            for engine, values in per_engine_labelvalues.items()
            for name in STAT_NAMES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in STAT_NAMES:
            count = int(transfer_stats_data.get(name, 0))
            if count:
                self._series[(engine_idx, name)].inc(count)


def _positive(config, key: str, default: float) -> float:
    value = config.get_from_extra_config(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(
            f"KimiEncoderConnector: ec_connector_extra_config.{key} must be a positive "
            f"number of seconds, got {value!r}; drop it for the default {default:g}."
        )
    return float(value)


class KimiEncoderConnector(ECConnectorBase):
    """Consumer of features that kimi-encoder's ranks push (``kimi_encoder.engines.ecpush``)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        if config.ec_role != "ec_consumer":
            raise ValueError(
                f"KimiEncoderConnector takes features that kimi-encoder pushes: ec_role must "
                f"be 'ec_consumer', got {config.ec_role!r}."
            )
        parallel = vllm_config.parallel_config
        self._host = str(config.ec_ip)
        self._ports = worker_ports(
            int(config.ec_port), parallel.data_parallel_index, parallel.tensor_parallel_size
        )
        self._wait_s = _positive(config, "wait_timeout_s", WAIT_TIMEOUT_S)
        self._ttl_s = _positive(config, "staged_ttl_s", STAGED_TTL_S)
        self._capacity = int(config.ec_buffer_size)
        self._receiver: Receiver | None = None
        self._watcher: Watcher | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._watcher = Watcher([f"tcp://{_bracketed(self._host)}:{p}" for p in self._ports])
        self._local: set[str] = set()  # in vLLM's encoder cache (the scheduler's mirror)
        self._loads: dict[str, int] = {}
        self._step = 0  # steps that loaded something
        self._loaded: OrderedDict[str, None] = OrderedDict()  # recently loaded hashes
        self._waiting_since: dict[str, float] = {}
        self._unavailable: set[str] = set()
        self._reported = dict.fromkeys(STAT_NAMES, 0)
        self._counts = dict.fromkeys(("loaded", "loaded_again"), 0)
        self.failures: dict[str, str] = {}  # request -> why it failed (the latest ones)

    # Worker side

    def start_worker_services(self) -> None:
        if self._receiver is not None or self.role != ECConnectorRole.WORKER:
            return
        tp_rank, first_stage = _worker_place()
        if not first_stage:
            return  # later pipeline stages hold no encoder outputs
        staging = Staging(self._capacity, self._ttl_s)
        self._receiver = Receiver(self._host, self._ports[tp_rank], staging)
        log.info("KimiEncoderConnector receives pushed features at %s", self._receiver.address)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self.start_worker_services()
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KimiEncoderMetadata), type(metadata)
        if self._receiver is None:
            return
        device = _device()
        for mm_hash, rows in metadata.loads.items():
            if mm_hash in encoder_cache:
                continue
            tensor = self._receiver.staging.get(mm_hash)
            if tensor is None or tensor.shape[0] != rows:
                got = "nothing" if tensor is None else f"{tensor.shape[0]} rows"
                raise RuntimeError(
                    f"KimiEncoderConnector: the scheduler planned {rows} rows of {mm_hash!r} "
                    f"but this worker holds {got}; it was pushed with other content under "
                    "the same uuid, or this worker restarted since the scheduler saw it."
                )
            encoder_cache[mm_hash] = tensor.to(device, non_blocking=False)
        self._receiver.loaded_through(metadata.step)

    def save_caches(self, encoder_cache, mm_hash: str, **kwargs: Any) -> None:
        return  # a consumer saves nothing

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._watcher is not None:
            self._watcher.close()

    # Scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        assert self._watcher is not None, "has_cache_item is a scheduler-side call"
        self._drain()
        return self._watcher.rows(identifier) is not None

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether every image ``request`` still needs is staged and held for it on every
        worker; an image that waited ``wait_timeout_s``, or that a restarted worker lost
        while the request waited, fails the request instead."""
        assert self._watcher is not None, "ensure_cache_available is a scheduler-side call"
        self._hold(request)
        self._drain()
        if request.request_id in self._unavailable:
            return False
        now = time.monotonic()
        ready = True
        held = self._watcher.held(request.request_id)
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue
            mm_hash = feature.identifier
            if mm_hash in self._local:
                continue
            rows = self._watcher.rows(mm_hash)
            need = request.get_num_encoder_embeds(index)
            if rows is not None and rows == need and held:
                continue
            ready = False
            if rows is not None and rows != need:
                why = f"hold {rows} rows, the prompt needs {need} (a reused uuid?)"
                self._fail(request.request_id, mm_hash, why)
                continue
            since = self._waiting_since.setdefault(request.request_id, now)
            if now - since > self._wait_s:
                self._fail(request.request_id, mm_hash, self._why_missing(mm_hash))
        if ready:
            self._waiting_since.pop(request.request_id, None)
        return ready

    def _why_missing(self, mm_hash: str) -> str:
        """Why an item is not on every worker after ``wait_timeout_s``."""
        staged, workers = self._watcher.staged_on(mm_hash), len(self._ports)
        fate = self._watcher.fate(mm_hash)
        if fate is None:
            if staged:
                return (
                    f"pushed to {staged} of {workers} workers within wait_timeout_s="
                    f"{self._wait_s:g} s; push it to every worker of this engine"
                )
            return (
                f"never pushed within wait_timeout_s={self._wait_s:g} s (staged on 0 of "
                f"{workers} workers)"
            )
        address, why = fate
        return {
            EXPIRED: f"expired unclaimed on {address}: no request named it within "
            f"staged_ttl_s={self._ttl_s:g} s of its push",
            EVICTED: f"evicted unclaimed from {address} to make room for later pushes under "
            f"ec_buffer_size={self._capacity} bytes; raise it or send the chat request sooner",
            RELEASED: f"dropped from {address} when the last request naming it finished; "
            "push it again for a later request",
            LOST: f"lost with the restart of worker {address}; push it again",
            UNSEEN: f"dropped from {address} (expired or evicted) while the scheduler was "
            "not reading",
        }.get(why, f"dropped from {address} ({why})")

    def _hold(self, request: Request) -> None:
        """The request names its items on every worker until it finishes."""
        if not self._watcher.holds(request.request_id):
            self._watcher.hold(request.request_id, [f.identifier for f in request.mm_features])

    def _drain(self) -> None:
        """Read the workers; a restart fails at once every waiting request that needs an
        item it took."""
        self._watcher.drain()
        while self._watcher.lost:
            index, hashes = self._watcher.lost.pop()
            address = self._watcher.addresses[index]
            for request_id in list(self._waiting_since):
                named = self._watcher.named(request_id)
                for mm_hash in sorted(set(named) & hashes - self._local):
                    self._fail(request_id, mm_hash, f"lost with the restart of worker {address}")
                    break

    def _fail(self, request_id: str, mm_hash: str, why: str) -> None:
        if request_id not in self._unavailable:
            log.warning(
                "request %s fails: features of %r %s; nothing is encoded locally, re-issue "
                "it once the encoder pushed them",
                request_id,
                mm_hash,
                why,
            )
        self._unavailable.add(request_id)
        self.failures[request_id] = f"features of {mm_hash!r} {why}"
        while len(self.failures) > RECENT_LOADS:
            del self.failures[next(iter(self.failures))]

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        for request_id in failed:
            self._waiting_since.pop(request_id, None)
        return failed

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        # vLLM allocates only what its encoder cache lacks: load it (again) from staging.
        self._hold(request)
        mm_hash = request.mm_features[index].identifier
        if self._watcher.rows(mm_hash) is not None:
            self._loads[mm_hash] = request.get_num_encoder_embeds(index)
        self._local.add(mm_hash)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self._local.discard(mm_hash)
        if self._loads:
            self._step += 1
        for mm_hash in self._loads:
            again = mm_hash in self._loaded
            self._counts["loaded_again" if again else "loaded"] += 1
            self._loaded.pop(mm_hash, None)
            self._loaded[mm_hash] = None
        while len(self._loaded) > RECENT_LOADS:
            self._loaded.popitem(last=False)
        metadata = KimiEncoderMetadata(loads=self._loads, step=self._step)
        self._loads = {}
        return metadata

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Its items may go once the workers made this step's loads (a step still on its
        way may load for it)."""
        self._waiting_since.pop(request.request_id, None)
        if self._watcher is not None:
            self._watcher.release(request.request_id, after_step=self._step)
        return False, None

    def get_ec_connector_stats(self) -> KimiEncoderStats | None:
        if self._watcher is None:
            return None
        now = {**self._watcher.counts, **self._counts}
        delta = {name: now[name] - self._reported[name] for name in STAT_NAMES}
        self._reported = {name: now[name] for name in STAT_NAMES}
        stats = KimiEncoderStats(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> KimiEncoderStats:
        return KimiEncoderStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KimiEncoderPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _worker_place() -> tuple[int, bool]:
    """This worker's TP rank and whether it is in the first pipeline stage."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().is_first_rank
    except AssertionError:  # no process groups: this worker is the whole engine
        return 0, True


def _device() -> str:
    from vllm.platforms import current_platform

    device = current_platform.device_type
    if current_platform.is_cuda_alike():
        device = f"{device}:{current_platform.current_device()}"
    return device


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
