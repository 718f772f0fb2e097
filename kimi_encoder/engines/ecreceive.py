"""The consumer's side of ``ecpush``: what a vLLM worker receives and what its scheduler
learns of it. Plain threads and ZMQ sockets; no vLLM here (``vllm_connector`` adapts
these to vLLM's connector interface) and no Ray.

- ``Staging``: tensors by mm_hash, bounded in bytes, each kept ``ttl_s`` unless taken.
- ``Receiver``: a thread with a ROUTER socket bound at the worker's address. A push is
  copied once into a tensor of its own, staged, and only then answered ``ok``; a push
  that does not fit is answered ``busy`` at once, never staged half. Each staged or
  expired item is an event with a sequence number, and a scheduler's ``watch`` request
  is answered with the events after the one it last saw (held until there is one, or
  ``WATCH_HOLD_S``).
- ``Watcher``: the scheduler's view, one DEALER socket per worker of its engine and one
  ``watch`` outstanding on each; ``drain()`` reads whatever answers have come without
  waiting, so the scheduler never blocks on it. An item is present once every worker
  staged it.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import zmq

from ..features import FEATURE_DTYPES, torch_dtype
from .ecpush import BUSY_RETRY_AFTER_S, MAGIC, check_put, reply

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: torch_dtype(name) for name in FEATURE_DTYPES}
WATCH_HOLD_S = 0.5  # a watch with nothing new is answered after this (liveness)
POLL_MS = 50
MAX_EVENTS = 4096  # events a worker remembers for watchers behind it


@dataclass
class Staged:
    tensor: torch.Tensor
    staged_at: float


class Staging:
    """Received tensors by mm_hash: at most ``capacity_bytes`` held, each ``ttl_s``."""

    def __init__(self, capacity_bytes: int, ttl_s: float):
        if capacity_bytes < 1 or not ttl_s > 0:
            raise ValueError(
                f"staging needs a positive capacity and TTL, got {capacity_bytes} bytes and "
                f"{ttl_s} s; set ec_buffer_size and staged_ttl_s above 0."
            )
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, Staged] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return self._held

    def fits(self, nbytes: int, mm_hash: str) -> bool:
        with self._lock:
            old = self._items.get(mm_hash)
            return self._held - (old.tensor.nbytes if old else 0) + nbytes <= self.capacity_bytes

    def put(self, mm_hash: str, tensor: torch.Tensor, now: float) -> None:
        """Stage ``tensor`` (replacing an earlier one of the same hash)."""
        with self._lock:
            old = self._items.pop(mm_hash, None)
            self._held += tensor.nbytes - (old.tensor.nbytes if old else 0)
            self._items[mm_hash] = Staged(tensor, now)

    def take(self, mm_hash: str) -> torch.Tensor | None:
        """The staged tensor, no longer staged; None if it is not (or no longer) here."""
        with self._lock:
            staged = self._items.pop(mm_hash, None)
            if staged is None:
                return None
            self._held -= staged.tensor.nbytes
            return staged.tensor

    def expire(self, now: float) -> list[str]:
        """Drop what has been staged longer than ``ttl_s``; their hashes."""
        gone = []
        with self._lock:
            while self._items:
                mm_hash, staged = next(iter(self._items.items()))
                if now - staged.staged_at < self.ttl_s:
                    break
                del self._items[mm_hash]
                self._held -= staged.tensor.nbytes
                gone.append(mm_hash)
        return gone


class Receiver:
    """A worker's receive thread: binds ``tcp://host:port``, stages pushes in ``staging``."""

    def __init__(self, host: str, port: int, staging: Staging):
        self.staging = staging
        self.epoch = secrets.token_hex(8)  # a restarted worker is a new epoch to watchers
        self.address = f"tcp://{_bracketed(host)}:{port}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.IPV6, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A frame larger than all the staging could hold is cut off by ZMQ, unread.
        self._socket.setsockopt(zmq.MAXMSGSIZE, staging.capacity_bytes + (1 << 16))
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise OSError(
                f"cannot listen for pushed features at {self.address} ({exc}); free the "
                "port, or give the consumer another ec_ip/ec_port."
            ) from None
        self._events: list[tuple[int, str, str, int]] = []  # (seq, kind, mm_hash, rows)
        self._seq = 0
        self._watches: list[tuple[bytes, int, float]] = []  # (peer, after, since)
        self._stop = threading.Event()
        self.received = 0
        self.refused = 0
        self.busy = 0
        self._thread = threading.Thread(target=self._run, name="kimi-ec-receiver", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(POLL_MS):
                frames = self._socket.recv_multipart(copy=False)
                self._handle(frames)
            now = time.monotonic()
            for mm_hash in self.staging.expire(now):
                log.warning("staged features of %s were never asked for; dropped", mm_hash)
                self._event("gone", mm_hash, 0)
            self._answer_watches(now)

    def _handle(self, frames: Sequence[zmq.Frame]) -> None:
        peer = frames[0].bytes
        if len(frames) < 3 or frames[1].bytes != MAGIC:
            return  # not our protocol: nothing to answer in
        try:
            header = json.loads(frames[2].bytes)
        except ValueError:
            header = None
        if isinstance(header, dict) and header.get("op") == "watch" and len(frames) == 3:
            # One watch per scheduler: a later one (asked again) replaces it.
            self._watches = [w for w in self._watches if w[0] != peer]
            self._watches.append((peer, int(header.get("after", 0)), time.monotonic()))
            return
        payload = frames[3].buffer if len(frames) == 4 else None
        push_id = header.get("id") if isinstance(header, dict) else None
        mm_hash = header.get("mm_hash") if isinstance(header, dict) else None
        try:
            if payload is None:
                raise ValueError("a put is three frames: magic, header, payload")
            mm_hash, dtype, shape = check_put(header, payload.nbytes)
        except ValueError as exc:
            self.refused += 1
            self._socket.send_multipart([peer, *reply(push_id, mm_hash, "refused", str(exc))])
            return
        if not self.staging.fits(payload.nbytes, mm_hash):
            self.busy += 1
            message = (
                f"staging holds {self.staging.held_bytes} of {self.staging.capacity_bytes} "
                f"bytes; this item needs {payload.nbytes}"
            )
            retry = BUSY_RETRY_AFTER_S
            self._socket.send_multipart([peer, *reply(push_id, mm_hash, "busy", message, retry)])
            return
        tensor = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
        tensor.view(torch.uint8).numpy().reshape(-1)[:] = memoryview(payload).cast("B")
        self.staging.put(mm_hash, tensor, time.monotonic())
        self.received += 1
        self._event("staged", mm_hash, shape[0])
        self._socket.send_multipart([peer, *reply(push_id, mm_hash, "ok")])

    def _event(self, kind: str, mm_hash: str, rows: int) -> None:
        self._seq += 1
        self._events.append((self._seq, kind, mm_hash, rows))
        if len(self._events) > MAX_EVENTS:
            del self._events[: len(self._events) - MAX_EVENTS]
        self._answer_watches(time.monotonic())

    def _answer_watches(self, now: float) -> None:
        kept = []
        for peer, after, since in self._watches:
            events = [e for e in self._events if e[0] > after]
            if not events and now - since < WATCH_HOLD_S:
                kept.append((peer, after, since))
                continue
            first = self._events[0][0] if self._events else self._seq + 1
            body = {
                "op": "events",
                "epoch": self.epoch,
                "last": self._seq,
                "lost": after + 1 < first and after < self._seq,  # fell behind MAX_EVENTS
                "events": events,
            }
            self._socket.send_multipart([peer, MAGIC, json.dumps(body).encode()])
        self._watches = kept


class Watcher:
    """A scheduler's view of what its engine's workers (``addresses``) have staged."""

    def __init__(self, addresses: Sequence[str]):
        self.addresses = list(addresses)
        self._context = zmq.Context()
        self._sockets = []
        for address in self.addresses:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no watches queued for a worker not there
            sock.connect(address)
            self._sockets.append(sock)
        self._after = [0] * len(self.addresses)
        self._epoch: list[str | None] = [None] * len(self.addresses)
        self._asked_at: list[float | None] = [None] * len(self.addresses)
        # mm_hash -> rows, per worker
        self._staged: list[dict[str, int]] = [{} for _ in self.addresses]
        for index in range(len(self.addresses)):
            self._ask(index)

    def _ask(self, index: int) -> None:
        body = json.dumps({"op": "watch", "after": self._after[index]}).encode()
        try:
            self._sockets[index].send_multipart([MAGIC, body], zmq.NOBLOCK)
        except zmq.Again:  # not connected (yet): asked at the next drain, never blocking
            self._asked_at[index] = None
            return
        self._asked_at[index] = time.monotonic()

    def drain(self) -> None:
        """Read every answer that has come, without waiting, and watch again."""
        for index, sock in enumerate(self._sockets):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2 and frames[0] == MAGIC:
                    self._apply(index, json.loads(frames[1]))
                    self._ask(index)
            # Not asked yet (no connection then), or a watch lost to a restarted worker.
            asked_at = self._asked_at[index]
            if asked_at is None or time.monotonic() - asked_at > 10 * WATCH_HOLD_S + 5:
                self._ask(index)

    def _apply(self, index: int, body: dict) -> None:
        staged = self._staged[index]
        if body.get("epoch") != self._epoch[index] or body.get("lost"):
            # A new worker (or one we fell behind): what it held before is gone.
            if self._epoch[index] is not None:
                log.warning("worker %s restarted or was lost track of", self.addresses[index])
            staged.clear()
            self._epoch[index] = body.get("epoch")
        for _, kind, mm_hash, rows in body.get("events", []):
            if kind == "staged":
                staged[mm_hash] = rows
            else:
                staged.pop(mm_hash, None)
        self._after[index] = int(body.get("last", self._after[index]))

    def rows(self, mm_hash: str) -> int | None:
        """The item's rows once every worker staged it (all the same), else None."""
        found = {staged.get(mm_hash) for staged in self._staged}
        if len(found) != 1 or None in found:
            return None
        return found.pop()

    def staged_on(self, mm_hash: str) -> int:
        return sum(mm_hash in staged for staged in self._staged)

    def taken(self, mm_hash: str) -> None:
        """The workers take the item into the encoder cache: no longer staged."""
        for staged in self._staged:
            staged.pop(mm_hash, None)

    def close(self) -> None:
        self._context.destroy(linger=0)


def worker_ports(base_port: int, dp_index: int, tp_size: int) -> list[int]:
    """The receive ports of one engine's workers (one per TP rank), from vLLM's
    ``ec_port``: ``ec_port + dp_index * tp_size + tp_rank``.

    >>> worker_ports(14579, dp_index=1, tp_size=2)
    [14581, 14582]
    """
    first = base_port + dp_index * tp_size
    ports = list(range(first, first + tp_size))
    if not 0 < ports[0] <= ports[-1] < 65536:
        raise ValueError(
            f"ec_port {base_port} with data-parallel index {dp_index} and TP {tp_size} gives "
            f"receive ports {ports[0]}-{ports[-1]}, outside 1-65535; lower ec_port."
        )
    return ports


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
