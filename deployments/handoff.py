"""The engine hand-off at the ingress: sglang's encode/prefill split and vLLM's encoder cache.

sglang 0.5.23 (``kimi_encoder.engines.sglang``, docs/epd.md), three routes:

- ``POST /encode``: one part of a prefill request's images. They go through the
  same admission, owner assignment and rank encode as ``/v1/encode``, in the
  model's dtype, each rank keeping its images' features in Ray's object store
  (``sinks.Kept``); one rank then gathers them and pushes the part's two frames
  over ZMQ to every checked address the part names (``EncoderRank.push``), and the
  part is answered once they are sent. No feature byte passes through the ingress.
- ``POST /scheduler_receive_url``: a scheduler rank's address for one part
  (zmq_to_scheduler). A part's registrations and its ``/encode`` may reach
  different ingress replicas, so the addresses are kept by one
  ``HandoffRegistry`` replica that every ingress replica calls. The part asks it
  for them as soon as it arrives, so that wait runs alongside the encode.
- ``GET /health``: 200 while a rank answers.

A part is answered within ``ingress.request_timeout_s``. A failure (an input refused, a
rank error, no receive address in time, a receiver gone) is pushed as the
part's error frame, best effort in the time kept for it, and answered with its
status and sglang's ``{"status": "error", "message", "req_id"}`` body.

vLLM 0.33.0 (``kimi_encoder.engines.vllm``): a ``/v1/encode`` request with
output kind ``vllm_ec`` has each item's features written as an encoder-cache
file under ``handoff.ec_root`` (atomically) before it is answered with their
metadata. The rank that encodes an image writes its files (``sinks.EcFiles``),
from the buffer its features were copied to from the device, or for a cache hit
from the object store in place: no feature byte reaches the ingress.

docs/epd.md ("Where the copies are") follows each byte.

Ray-free, like fanout.py: the registry is a ``RegistryClient``
(``handles.RegistryHandle`` in the service).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Awaitable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse

from kimi_encoder.engines.sglang import (
    SGLANG_VERSION,
    EncodeRequest,
    ReceiverRegistry,
    ReceiveUrlRequest,
    error_target,
    load_images,
    push_frames,
    receive_endpoints,
)
from kimi_encoder.engines.sglang_frames import error_frames
from kimi_encoder.engines.transport import Frame, ReceiveAddressRefused, ReceivePolicy, ZmqPusher
from kimi_encoder.engines.vllm import EC_FILENAME, VLLM_VERSION
from kimi_encoder.items import EncoderInputError

from . import errors, vllm_push
from .admission import Admission, Admitted, declared_length, read_body
from .args import HandoffArgs
from .engine_gate import EngineGate
from .fanout import (
    Call,
    FanOut,
    Gathered,
    NoRankAvailableError,
    RankUnavailableError,
    RequestTimeoutError,
)
from .heap import start_trimming
from .ranks import tasks
from .ranks.lifecycle import PUSH
from .schemas import EcEntry, EcWriteResponse, Usage
from .security import ApiKey
from .sinks import KEPT, EcDestination, PartPush, Written
from .timing import HEALTH_TIMEOUT_S

if TYPE_CHECKING:  # the request's trace is made by the ingress (metrics.py: Ray's metrics)
    from .metrics import RequestTrace

log = logging.getLogger("ray.serve")

# Kept out of the request timeout for pushing a failed part's error frame (at most 1/10).
ERROR_GRACE_S = 1.0
INFO_TIMEOUT_S = 10.0
REGISTRATION_BYTES = 64 << 10  # a /scheduler_receive_url body is a few short fields


class RegistryClient(Protocol):
    """What the hand-off needs of the ``HandoffRegistry``."""

    def register(self, req: ReceiveUrlRequest) -> Call: ...

    def wait_for(self, req_id: str, timeout_s: float) -> Call: ...

    def info(self) -> Call: ...


class HandoffRegistry:
    """The receive addresses of zmq_to_scheduler parts, for every ingress replica.

    One replica (``build_app``); every method runs on its event loop, as
    ``ReceiverRegistry`` requires.
    """

    def __init__(self, handoff: HandoffArgs):
        start_trimming()
        self.registry = ReceiverRegistry(
            ttl_s=handoff.address_ttl_s, max_entries=handoff.max_pending
        )

    async def register(self, req: ReceiveUrlRequest) -> None:
        self.registry.register(req)

    async def wait_for(self, req_id: str, timeout_s: float) -> list[str]:
        return await self.registry.wait_for(req_id, timeout_s)

    async def info(self) -> dict[str, int]:
        return {"parts_pending": len(self.registry)}


class Handoff:
    """The hand-off routes of one ingress replica (one ZMQ pusher, on its event loop)."""

    def __init__(
        self,
        config: HandoffArgs,
        model_dtype: str,
        admission: Admission,
        fanout: FanOut,
        registry: RegistryClient,
        api_key: ApiKey | EngineGate,
    ):
        """Parts are admitted by ``admission`` (its body limit), encoded in ``model_dtype``
        through ``fanout`` and answered within its ``timeout_s``."""
        self.config = config
        self.dtype = model_dtype
        self.admission = admission
        self.fanout = fanout
        self.registry = registry
        self.api_key = api_key
        self.policy = config.image_urls.policy()
        self.receive_policy = config.receive_policy()
        self.ec_root = check_ec_root(config.ec_root)
        push = config.vllm_push
        self.push_limits = vllm_push.PushLimits(
            push.ack_timeout_s, push.max_in_flight, push.max_in_flight_per_destination
        )
        self._pusher: ZmqPusher | None = None

    @property
    def pusher(self) -> ZmqPusher:
        # Made at first use: a pusher belongs to the event loop it first sends from.
        if self._pusher is None:
            self._pusher = ZmqPusher(send_timeout_s=self.config.send_timeout_s)
        return self._pusher

    async def info(self) -> dict[str, Any]:
        """Pinned protocol versions, what is configured, and the registry's parts pending
        (entries waiting for or holding receive addresses, over all ingress replicas)."""
        call = self.registry.info()
        try:
            registry = await asyncio.wait_for(_await(call), INFO_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a sick registry is reported, not raised
            call.cancel()
            registry = {"state": "unavailable", "error": f"{type(exc).__name__}: {exc}"}
        return {
            "sglang": SGLANG_VERSION,
            "vllm": VLLM_VERSION,
            "dtype": self.dtype,
            "vllm_ec": self.ec_root is not None,
            "vllm_push": {"ack_timeout_s": self.push_limits.timeout_s},
            "image_urls": self.policy.allow_http,
            "registry": registry,
        }

    async def encode(self, request: Request, trace: RequestTrace) -> None:
        """``POST /encode``: encode one part and push its frames; returns once they are sent.

        Raises ``errors.PartFailedError`` (after pushing the error frame) on any failure.
        """
        timeout_s = self.fanout.timeout_s
        deadline = time.monotonic() + timeout_s
        work_until = deadline - min(ERROR_GRACE_S, timeout_s / 10)
        try:
            self.api_key.check(request)
            limit = self.admission.limits.max_request_bytes
            body = await read_body(request.stream(), limit, declared=declared_length(request))
            body = _json(body, "/encode")
        except Exception as exc:  # answered as the part's failure
            raise errors.PartFailedError(None, exc) from exc
        try:
            req = EncodeRequest.from_json(body)
        except EncoderInputError as exc:
            raise await self._failed(error_target(body), exc, deadline) from exc
        receivers = self._receivers(req, work_until)
        try:
            if req.receive_address is not None:  # checked before anything is encoded
                await _within(receivers.endpoints(), work_until, timeout_s)
            await _within(self._encode_and_push(req, trace, receivers), work_until, timeout_s)
        except ReceiveAddressRefused as exc:  # nothing, not even an error frame, goes there
            raise errors.PartFailedError(req.req_id, exc) from exc
        except Exception as exc:  # answered as the part's failure
            raise await self._failed(req, exc, deadline, receivers) from exc
        finally:
            receivers.close()

    async def register(self, request: Request) -> None:
        """``POST /scheduler_receive_url``: one scheduler rank's address for one part,
        registered as the IP it resolved to once it is checked (refused: 400)."""
        self.api_key.check(request)
        body = await read_body(
            request.stream(), REGISTRATION_BYTES, declared=declared_length(request)
        )
        req = ReceiveUrlRequest.from_json(_json(body, "/scheduler_receive_url"))
        checked = await self.receive_policy.check_async(req.receive_url)
        await self.registry.register(dataclasses.replace(req, receive_url=checked.host_port))

    async def check_health(self) -> None:
        """``GET /health``: returns while a rank answers its load report within
        ``HEALTH_TIMEOUT_S``; raises ``NoRankAvailableError`` (503) otherwise."""
        roster = self.fanout.roster
        if not await tasks.any_answers(roster, HEALTH_TIMEOUT_S):  # answers and misses booked
            raise NoRankAvailableError(roster.retry_after_s())

    async def destination(self, admitted: Admitted) -> Any:
        """Where a request's output goes: ``ec_destination``, or for output kind
        ``vllm_push`` the vLLM workers it names, each checked against
        ``handoff.receive_networks`` before anything is encoded (``vllm_push.py``)."""
        output = admitted.output
        if output is not None and output.kind == "vllm_push":
            return await vllm_push.destination(output, self.receive_policy, self.push_limits)
        return self.ec_destination(admitted)

    def ec_destination(self, admitted: Admitted) -> EcDestination:
        """Output kind ``vllm_ec``: where each item's encoder-cache entry goes. The rank
        that encodes an image writes its entries (renamed into place and synced) before
        it answers, from its own host buffer or cache; no feature byte reaches the
        ingress."""
        assert admitted.output is not None, "a vllm_ec destination for a request without one"
        assert self.ec_root is not None, admitted.output
        return EcDestination(str(self.ec_root), admitted.output.uuids)

    def ec_answer(self, model: str, admitted: Admitted, gathered: Gathered) -> JSONResponse:
        """The metadata of every entry the ranks wrote for ``admitted`` (``ec_destination``)."""
        assert admitted.output is not None, "a vllm_ec answer for a request without an output"
        if admitted.output.kind == "vllm_push":
            return vllm_push.push_answer(model, admitted, gathered)
        items = []
        uuids, owners = admitted.output.uuids, gathered.owners
        for i, (item, written) in enumerate(zip(admitted.items, gathered.features, strict=True)):
            uuid, owner = uuids[i], owners[i]
            assert isinstance(written, Written), (i, type(written))
            tokens, hidden = written.shape
            items.append(
                EcEntry(
                    index=i,
                    uuid=uuid,
                    path=f"{uuid}/{EC_FILENAME}",
                    grid_thw=list(item.grid),
                    num_tokens=tokens,
                    owner_rank=owner,
                    shape=[tokens, hidden],
                    dtype=written.dtype,
                    bytes=written.sizes[uuid],
                )
            )
        tokens = sum(entry.num_tokens for entry in items)
        usage = Usage(images=len(items), patches=admitted.patches, tokens=tokens)
        return JSONResponse(EcWriteResponse(model=model, items=items, usage=usage).model_dump())

    async def _encode_and_push(
        self, req: EncodeRequest, trace: RequestTrace, receivers: _PartReceivers
    ) -> None:
        """Encode the part, its features kept by the ranks, and have one rank push it. A
        push that fails for a rank (the pusher died, or a rank whose features it reads
        did) is tried once more from the start: the fan-out then sends the lost images to
        the ranks still up."""
        for attempt in (1, 2):
            admitted, gathered = await self._kept(req, trace)
            try:
                await self._push_from_rank(req, admitted, gathered, receivers)
                return
            except RankUnavailableError as exc:
                if attempt == 2:
                    raise
                log.warning("part %s: %s while pushing; encoding it again", req.req_id, exc)

    async def _kept(self, req: EncodeRequest, trace: RequestTrace) -> tuple[Admitted, Gathered]:
        """The part's images admitted and encoded, their features kept in the ranks' object
        stores (``gathered.features``: the ranks' refs, unread here)."""
        images = await asyncio.to_thread(load_images, req, self.policy)
        admitted = self.admission.admit_files(
            [image.data for image in images],
            None,
            self.dtype,
            digests=[image.sha256 for image in images],  # checked content_hash: hashed once
        )
        trace.admitted(admitted.items)
        gathered = await self.fanout.run(admitted.items, admitted.feature_dtype, KEPT)
        trace.gathered(gathered)
        return admitted, gathered

    async def _push_from_rank(
        self,
        req: EncodeRequest,
        admitted: Admitted,
        gathered: Gathered,
        receivers: _PartReceivers,
    ) -> None:
        """One rank pushes the part: the rank that encoded most of its rows (while it is
        up), reading the other ranks' rows from their object stores. The ingress sends
        the refs and the checked endpoints, no feature byte."""
        endpoints = await receivers.endpoints()
        sizes = [item.original_size for item in admitted.items]
        assert all(size is not None for size in sizes), "encoded files have an original size"
        part = PartPush(
            req=req,
            dtype=gathered.dtype,
            grids=tuple(tuple(item.grid) for item in admitted.items),
            sizes=tuple(tuple(size) for size in sizes),
            endpoints=tuple(endpoints),
            one_off=req.receive_address is not None,
            send_timeout_s=self.config.send_timeout_s,
        )
        roster = self.fanout.roster
        rank = pusher_rank(gathered, roster.down())
        await roster.ask(rank, PUSH, None, part, gathered.features)

    def _receivers(self, req: EncodeRequest, until: float) -> _PartReceivers:
        if req.receive_address is not None:  # zmq_to_tokenizer: the part names its address
            return _PartReceivers(req, self.receive_policy, None)
        wait_s = min(self.config.wait_s, until - time.monotonic())
        call = self.registry.wait_for(req.req_id, max(wait_s, 0.0))
        return _PartReceivers(req, self.receive_policy, call)

    async def _push(
        self, req: EncodeRequest, frames: Sequence[Frame], receivers: _PartReceivers
    ) -> None:
        endpoints = await receivers.endpoints()
        await push_frames(frames, endpoints, self.pusher, reuse=req.receive_address is None)

    async def _failed(
        self,
        req: EncodeRequest | None,
        exc: BaseException,
        deadline: float,
        receivers: _PartReceivers | None = None,
    ) -> errors.PartFailedError:
        """Push ``exc`` as ``req``'s error frame (best effort, until ``deadline``, and only
        to checked addresses); the exception that answers the request."""
        if req is None:
            return errors.PartFailedError(None, exc)
        status, _ = errors.classify(exc)
        frames = error_frames(req, errors.message_of(exc), status)
        own = receivers is None
        receivers = self._receivers(req, deadline) if own else receivers
        try:
            await _within(self._push(req, frames, receivers), deadline, self.fanout.timeout_s)
        except Exception as push_error:  # noqa: BLE001 - the HTTP answer still reports it
            log.warning(
                "part %s failed (%s) and its error frame was not delivered: %s",
                req.req_id,
                type(exc).__name__,
                push_error,
            )
        finally:
            if own:
                receivers.close()
        return errors.PartFailedError(req.req_id, exc)


def pusher_rank(gathered: Gathered, down: Collection[int]) -> int:
    """The rank that pushes a part: of the ranks up, the one that encoded most of its rows
    (ties: the lowest); with none of them up, the first owner (its call fails, and the
    part with it)."""
    rows: dict[int, int] = {}
    for owner, features in zip(gathered.owners, gathered.features, strict=True):
        rows[owner] = rows.get(owner, 0) + features.shape[0]
    up = {r: n for r, n in rows.items() if r not in down} or rows
    return min(up, key=lambda r: (-up[r], r))


class _PartReceivers:
    """Where one part's frames may go, looked up once as the part arrives: its own
    address resolved and checked (zmq_to_tokenizer), or the addresses its scheduler
    ranks registered, checked then (zmq_to_scheduler: ``call`` is the registry wait)."""

    def __init__(self, req: EncodeRequest, policy: ReceivePolicy, call: Call | None):
        self.call = call
        self.wait = None if call is None else asyncio.ensure_future(_await(call))
        self.task = asyncio.ensure_future(receive_endpoints(req, policy, self, wait_s=0.0))

    async def endpoints(self) -> list[str]:
        """The part's checked ``tcp://ip:port`` endpoints. Shielded, so that a send that
        gives up does not cancel the lookup an error frame may still need."""
        return await asyncio.shield(self.task)

    async def wait_for(self, req_id: str, timeout_s: float) -> list[str]:
        # ``receive_endpoints``'s registry; the registry applies the wait's timeout.
        assert self.wait is not None, f"{req_id}: a zmq_to_tokenizer part has no registry wait"
        return await self.wait

    def close(self) -> None:
        if self.task.done() and not self.task.cancelled():
            self.task.exception()  # retrieved: a failed lookup nobody awaited is not logged
        self.task.cancel()
        if self.wait is not None and not self.wait.done():
            self.wait.cancel()
            self.call.cancel()


async def _await(call: Awaitable[Any]) -> Any:
    return await call


async def _within(awaitable: Awaitable[Any], until: float, timeout_s: float) -> Any:
    """``awaitable``'s result, or ``RequestTimeoutError`` at ``until`` (``time.monotonic()``);
    its own exceptions (a ``TimeoutError`` too) pass through unchanged."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, until - time.monotonic()))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise RequestTimeoutError(timeout_s)
    return task.result()


def _json(body: bytes, where: str) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise EncoderInputError(
            f"{where} body is not JSON ({exc}); send the JSON object sglang {SGLANG_VERSION} sends."
        ) from None


def check_ec_root(value: str | None) -> Path | None:
    """``ec_root`` as a directory this process can write, checked at start-up."""
    if value is None:
        return None
    root = Path(value)
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(
            f"handoff.ec_root {value!r} is not a writable directory on this ingress's node; "
            "create it (the vLLM consumer's shared_storage_path, on storage both can reach) or "
            "unset handoff.ec_root."
        )
    return root
