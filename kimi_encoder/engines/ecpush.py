"""Pushing image features into a vLLM consumer's encoder cache over the network.

The consumer runs our encoder-cache connector (``kimi_encoder.engines.vllm_connector``,
loaded by vLLM through ``ec_connector_module_path``): each of its workers listens on a
ZMQ ROUTER socket and stages what it receives by mm_hash; its scheduler waits for a
request's items before it schedules the request. This module is the wire between the
two and the producer's side of it; ``ecreceive`` is the consumer's side.

One push is one item for one worker, a three-frame message from a DEALER socket:

- ``MAGIC`` (the protocol and its version; anything else is refused);
- a JSON header ``{"op": "put", "id", "mm_hash", "dtype", "shape": [rows, hidden]}``;
- the features' raw little-endian bytes (bfloat16 as its 16-bit words).

The worker answers ``[MAGIC, {"id", "mm_hash", "status", "message", "retry_after_s"}]``
only once the item is staged (``status`` ``"ok"``), or at once with ``"busy"`` (its
staging is full: try again after ``retry_after_s``) or ``"refused"`` (a malformed
push). A producer that has its answer knows vLLM's side holds the bytes.

``EcPusher`` sends pushes and waits for their answers, every wait bounded: at most
``max_in_flight`` pushes unanswered at once, ``max_per_destination`` of them to one
worker, and ``timeout_s`` for a slot and an answer together. A push that fails raises
``EcPushError`` (its ``retry_after_s`` is the Retry-After the caller answers with).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from ..features import FEATURE_DTYPES, STORAGE

MAGIC = b"kimi-ec-push/1"
ITEMSIZE = {name: STORAGE[name].itemsize for name in FEATURE_DTYPES}  # bytes per element
BUSY_RETRY_AFTER_S = 1
MAX_SOCKETS = 64  # destinations a pusher keeps sockets to (idle ones beyond it are closed)
MAX_STATS = 256  # destinations whose counts it keeps


class EcPushError(ConnectionError):
    """A push that vLLM's side did not acknowledge (HTTP 503 with ``Retry-After``): its
    message names the item, the destination and the reason."""

    def __init__(self, message: str, retry_after_s: int = BUSY_RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses process boundaries (a rank's error to the ingress)
        return type(self), (str(self), self.retry_after_s)


class EcPushBusy(EcPushError):
    """The destination (or this producer's push slots) is full: nothing was lost, try
    again after ``retry_after_s``."""


def put_header(push_id: int, mm_hash: str, dtype: str, shape: Sequence[int]) -> bytes:
    return json.dumps(
        {"op": "put", "id": push_id, "mm_hash": mm_hash, "dtype": dtype, "shape": list(shape)}
    ).encode()


def check_put(header: Any, payload_bytes: int) -> tuple[str, str, tuple[int, int]]:
    """``(mm_hash, dtype, (rows, hidden))`` of a decoded put header whose payload has
    ``payload_bytes``; raises ``ValueError`` saying what is wrong."""
    if not isinstance(header, dict) or header.get("op") != "put":
        raise ValueError(f"expected a put header, got {str(header)[:200]!r}")
    mm_hash, dtype, shape = header.get("mm_hash"), header.get("dtype"), header.get("shape")
    if not isinstance(mm_hash, str) or not mm_hash:
        raise ValueError(f"mm_hash must be a non-empty string, got {mm_hash!r}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(ITEMSIZE)}")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(n, int) and n > 0 for n in shape)
    ):
        raise ValueError(f"shape must be [rows, hidden] of positive ints, got {shape!r}")
    want = math.prod(shape) * ITEMSIZE[dtype]
    if payload_bytes != want:
        raise ValueError(f"payload has {payload_bytes} bytes, {shape} {dtype} needs {want}")
    return mm_hash, dtype, (shape[0], shape[1])


def reply(
    push_id: Any, mm_hash: Any, status: str, message: str = "", retry_after_s=None, worker=None
):
    """A worker's answer to one push, as frames; ``worker``: its counts in its epoch."""
    body = {"id": push_id, "mm_hash": mm_hash, "status": status, "message": message}
    if retry_after_s is not None:
        body["retry_after_s"] = retry_after_s
    if worker is not None:
        body["worker"] = worker
    return [MAGIC, json.dumps(body).encode()]


@dataclass
class DestinationStats:
    """What one producer pushed to one destination: items sent, their bytes, how many
    were acknowledged, found the destination busy, or failed."""

    pushes: int = 0
    bytes: int = 0
    acks: int = 0
    busy: int = 0
    failures: int = 0
    # What the worker said with its last answer: its epoch, items and bytes staged now,
    # and since it started staged, loaded, loaded_again, released, expired, evicted.
    worker: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0  # answers that came from a new epoch
    lost: int = 0  # items a worker held when last heard from before it restarted

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "worker": dict(self.worker)}

    def heard(self, worker: Any) -> None:
        if not isinstance(worker, dict):
            return
        if self.worker and worker.get("epoch") != self.worker.get("epoch"):
            self.restarts += 1
            self.lost += int(self.worker.get("items", 0))
        self.worker = worker


@dataclass
class _Socket:
    socket: zmq.asyncio.Socket
    slots: asyncio.Semaphore
    reader: asyncio.Task | None = None
    waiting: dict[int, asyncio.Future] = field(default_factory=dict)
    users: int = 0  # pushes holding or waiting for one of its slots


@dataclass
class EcPusher:
    """DEALER sockets by destination (``tcp://ip:port``, checked by the caller), each with
    its answers read by one task; use from one event loop."""

    timeout_s: float = 10.0
    max_in_flight: int = 64
    max_per_destination: int = 16
    stats: dict[str, DestinationStats] = field(default_factory=dict, init=False)
    _context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context, init=False)
    _sockets: dict[str, _Socket] = field(default_factory=dict, init=False, repr=False)
    _slots: asyncio.Semaphore | None = field(default=None, init=False, repr=False)
    _ids: itertools.count = field(default_factory=itertools.count, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or self.max_in_flight < 1 or self.max_per_destination < 1:
            raise ValueError(
                f"timeout_s must be positive and max_in_flight, max_per_destination at least "
                f"1, got {self.timeout_s}, {self.max_in_flight}, {self.max_per_destination}."
            )

    @property
    def in_flight(self) -> int:
        return sum(len(entry.waiting) for entry in self._sockets.values())

    async def push(
        self, endpoint: str, mm_hash: str, array: np.ndarray, dtype: str, what: str
    ) -> int:
        """Push ``array`` (``(rows, hidden)``, the storage array of ``dtype``) as
        ``mm_hash`` to ``endpoint`` and wait for its acknowledgement; the bytes sent.
        ``what`` names the item in an error (``item 3 (uuid 'chat-7-image-3')``)."""
        stats = self.stats.pop(endpoint, None) or DestinationStats()
        self.stats[endpoint] = stats  # the most recent last
        while len(self.stats) > MAX_STATS:
            del self.stats[next(iter(self.stats))]
        deadline = time.monotonic() + self.timeout_s
        slots = self._global_slots()
        try:
            await self._acquire(slots, deadline, f"{self.max_in_flight} pushes of this rank")
            entry = self._entry(endpoint)
            entry.users += 1  # a socket is closed only while no push uses it
            try:
                await self._acquire(
                    entry.slots, deadline, f"{self.max_per_destination} pushes to {endpoint}"
                )
            except BaseException:
                entry.users -= 1
                slots.release()
                raise
        except EcPushBusy as exc:
            stats.busy += 1
            raise EcPushBusy(f"{what}: {exc}") from None
        try:
            return await self._send(endpoint, entry, stats, mm_hash, array, dtype, what, deadline)
        finally:
            entry.users -= 1
            entry.slots.release()
            slots.release()

    async def _send(self, endpoint, entry, stats, mm_hash, array, dtype, what, deadline) -> int:
        push_id = next(self._ids)
        array = np.ascontiguousarray(array)
        header = put_header(push_id, mm_hash, dtype, array.shape)
        answer = asyncio.get_running_loop().create_future()
        entry.waiting[push_id] = answer
        stats.pushes += 1
        try:
            try:
                await entry.socket.send_multipart([MAGIC, header, memoryview(array)], copy=False)
            except zmq.ZMQError as exc:
                raise EcPushError(
                    f"{what}: nothing accepted the push at {endpoint} within {self.timeout_s:g} "
                    f"s ({exc}); is the vLLM consumer up, with this connector, at that port?"
                ) from None
            stats.bytes += array.nbytes
            try:
                got = await asyncio.wait_for(answer, max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise EcPushError(
                    f"{what}: {endpoint} did not acknowledge the push within "
                    f"{self.timeout_s:g} s (the consumer is gone, stalled or not reading)."
                ) from None
        except EcPushError:
            stats.failures += 1
            raise
        finally:
            entry.waiting.pop(push_id, None)
        return self._answered(got, endpoint, stats, what, array.nbytes)

    @staticmethod
    def _answered(got: dict, endpoint: str, stats: DestinationStats, what: str, nbytes: int):
        status = got.get("status")
        stats.heard(got.get("worker"))
        if status == "ok":
            stats.acks += 1
            return nbytes
        message = got.get("message") or status
        if status == "busy":
            stats.busy += 1
            retry = math.ceil(float(got.get("retry_after_s") or BUSY_RETRY_AFTER_S))
            raise EcPushBusy(f"{what}: {endpoint} is full ({message}).", max(1, retry))
        stats.failures += 1
        raise EcPushError(f"{what}: {endpoint} refused the push ({message}).")

    async def _acquire(self, slots: asyncio.Semaphore, deadline: float, what: str) -> None:
        try:
            await asyncio.wait_for(slots.acquire(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise EcPushBusy(
                f"{what} were all in flight for {self.timeout_s:g} s; try again later."
            ) from None

    def _global_slots(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        return self._slots

    def _entry(self, endpoint: str) -> _Socket:
        entry = self._sockets.pop(endpoint, None)
        if entry is not None:
            self._sockets[endpoint] = entry  # the most recent last
        else:
            self._close_idle(MAX_SOCKETS - 1)
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a peer never connected
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            entry = _Socket(sock, asyncio.Semaphore(self.max_per_destination))
            entry.reader = asyncio.ensure_future(self._read(entry))
            self._sockets[endpoint] = entry
        return entry

    @staticmethod
    async def _read(entry: _Socket) -> None:
        """Hand each answer to the push waiting for it (late or unknown ones are dropped)."""
        while True:
            frames = await entry.socket.recv_multipart()
            if len(frames) != 2 or frames[0] != MAGIC:
                continue
            try:
                got = json.loads(frames[1])
                waiter = entry.waiting.get(got.get("id"))
            except (ValueError, AttributeError, TypeError):
                continue
            if waiter is not None and not waiter.done():
                waiter.set_result(got)

    def _close_idle(self, keep: int) -> None:
        """Close the least recently used sockets without a push in flight, down to ``keep``."""
        for endpoint in [e for e, entry in self._sockets.items() if not entry.users]:
            if len(self._sockets) <= keep:
                return
            entry = self._sockets.pop(endpoint)
            if entry.reader is not None:
                entry.reader.cancel()
            entry.socket.close(linger=0)

    def info(self) -> dict[str, dict[str, Any]]:
        return {endpoint: stats.as_dict() for endpoint, stats in sorted(self.stats.items())}

    def close(self) -> None:
        for entry in self._sockets.values():
            if entry.reader is not None:
                entry.reader.cancel()
        self._sockets.clear()
        self._context.destroy(linger=0)
