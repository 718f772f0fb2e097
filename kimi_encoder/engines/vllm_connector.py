"""kimi-encoder's encoder-cache connector for vLLM 0.33.0: features pushed over the network.

Loaded by vLLM from its config, in vLLM's own processes (install kimi-encoder in vLLM's
environment; this module needs torch, pyzmq and vLLM, never Ray)::

    vllm serve <Kimi-K3 checkpoint> --ec-transfer-config '{"ec_connector":
      "KimiEncoderConnector", "ec_connector_module_path":
      "kimi_encoder.engines.vllm_connector", "ec_role": "ec_consumer",
      "ec_ip": "10.0.0.5", "ec_port": 14579}'

- Worker side (each TP worker of the first pipeline stage): a ``Receiver`` listens at
  ``ec_ip:ec_port + dp_index * tp_size + tp_rank`` and stages each pushed item by its
  mm_hash (at most ``ec_buffer_size`` bytes; a push that does not fit is answered busy);
  ``start_load_caches`` moves the items the scheduler planned into vLLM's encoder cache
  on the worker's device.
- Scheduler side: a ``Watcher`` of its engine's workers. A request is scheduled only once
  every image it still needs is staged on every worker (``ensure_cache_available``); an
  image that has not arrived within ``wait_timeout_s`` fails the request (vLLM reports
  it as a retryable error). Nothing is encoded locally: this consumer takes every
  image's features from the encoder.

``ec_connector_extra_config``: ``wait_timeout_s`` (60), ``staged_ttl_s`` (300: a staged
item nobody asks for is dropped after it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from .ecreceive import Receiver, Staging, Watcher, worker_ports

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 60.0
STAGED_TTL_S = 300.0


@dataclass
class KimiEncoderMetadata(ECConnectorMetadata):
    """One step's loads: the mm_hashes to move from staging into the encoder cache, with
    the rows the scheduler planned for each."""

    loads: dict[str, int] = field(default_factory=dict)


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
        self._waiting_since: dict[str, float] = {}
        self._unavailable: set[str] = set()

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
            tensor = self._receiver.staging.take(mm_hash)
            if mm_hash in encoder_cache:
                continue
            if tensor is None or tensor.shape[0] != rows:
                got = "nothing" if tensor is None else f"{tensor.shape[0]} rows"
                raise RuntimeError(
                    f"KimiEncoderConnector: the scheduler planned {rows} rows of {mm_hash!r} "
                    f"but this worker holds {got}; it was dropped after staged_ttl_s or pushed "
                    "with other content under the same uuid."
                )
            encoder_cache[mm_hash] = tensor.to(device, non_blocking=False)

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
        self._watcher.drain()
        return self._watcher.rows(identifier) is not None

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether every image ``request`` still needs is staged on every worker; an
        image that waited ``wait_timeout_s`` fails the request instead."""
        assert self._watcher is not None, "ensure_cache_available is a scheduler-side call"
        self._watcher.drain()
        now = time.monotonic()
        ready = True
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue
            mm_hash = feature.identifier
            if mm_hash in self._local:
                continue
            rows = self._watcher.rows(mm_hash)
            if rows is not None and rows == request.get_num_encoder_embeds(index):
                continue
            ready = False
            if rows is not None:
                self._fail(
                    request,
                    mm_hash,
                    f"it holds {rows} rows, the prompt needs "
                    f"{request.get_num_encoder_embeds(index)} (a reused uuid?)",
                )
                continue
            since = self._waiting_since.setdefault(request.request_id, now)
            if now - since > self._wait_s:
                staged = self._watcher.staged_on(mm_hash)
                self._fail(
                    request,
                    mm_hash,
                    f"not pushed within wait_timeout_s={self._wait_s:g} s (staged on {staged} "
                    f"of {len(self._ports)} workers)",
                )
        if ready:
            self._waiting_since.pop(request.request_id, None)
        return ready

    def _fail(self, request: Request, mm_hash: str, why: str) -> None:
        if request.request_id not in self._unavailable:
            log.warning(
                "request %s fails: features of %r %s; nothing is encoded locally, re-issue "
                "it once the encoder pushed them",
                request.request_id,
                mm_hash,
                why,
            )
        self._unavailable.add(request.request_id)

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        for request_id in failed:
            self._waiting_since.pop(request_id, None)
        return failed

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if mm_hash not in self._local and self._watcher.rows(mm_hash) is not None:
            self._loads[mm_hash] = request.get_num_encoder_embeds(index)
        self._local.add(mm_hash)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self._local.discard(mm_hash)
        metadata = KimiEncoderMetadata(loads=self._loads)
        for mm_hash in self._loads:
            self._watcher.taken(mm_hash)
        self._loads = {}
        return metadata

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._waiting_since.pop(request.request_id, None)
        return False, None


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
