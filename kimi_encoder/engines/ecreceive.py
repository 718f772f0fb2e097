"""The consumer's side of ``ecpush``: what a vLLM worker receives and what its scheduler
learns of it. Plain threads and ZMQ sockets; no vLLM here (``vllm_connector`` adapts
these to vLLM's connector interface) and no Ray. What a worker holds is
``ecstaging.Staging``.

- ``Receiver``: a thread with a ROUTER socket bound at the worker's address. A push is
  copied once into a tensor of its own, staged, and only then answered ``ok``; a push
  that does not fit even after evicting every unreferenced item is answered ``busy`` at
  once, never staged half. Each change (staged, gone and why, a request's hold
  applied) is an event with a sequence number, and a scheduler's ``watch`` request is
  answered with the events after the one it last saw (held until there is one, or
  ``WATCH_HOLD_S``), or, if it fell behind the ``MAX_EVENTS`` remembered or names
  another epoch, with the whole current state: no count of pushes hides an item.
- ``Watcher``: the scheduler's view, one DEALER socket per worker of its engine and one
  ``watch`` outstanding on each; ``drain()`` reads whatever answers have come without
  waiting, so the scheduler never blocks on it. An item is present once every worker
  staged it; a request is safe to schedule once every worker also confirmed its hold
  (from then on nothing it names is dropped until it is released).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import torch
import zmq

from ..features import FEATURE_DTYPES, torch_dtype
from .ecpush import BUSY_RETRY_AFTER_S, MAGIC, check_put, reply
from .ecstaging import COUNTS, EVICTED, EXPIRED, LOST, RELEASED, UNSEEN, Staging

__all__ = ["EVICTED", "EXPIRED", "LOST", "RELEASED", "UNSEEN", "Receiver", "Staging", "Watcher"]

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: torch_dtype(name) for name in FEATURE_DTYPES}
WATCH_HOLD_S = 0.5  # a watch with nothing new is answered after this (liveness)
POLL_MS = 50
REASK_S = 4 * WATCH_HOLD_S  # a watch unanswered this long went to a worker now gone
MAX_EVENTS = 4096  # events a worker remembers; a watcher further behind gets the state
MAX_FATES = 4 * MAX_EVENTS  # why recent items left, per worker, for the failure message


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
        # (seq, kind, key, detail): ("staged", mm_hash, rows), ("gone", mm_hash, why),
        # ("held", request_id, 0)
        self._events: deque[tuple[int, str, str, int | str]] = deque(maxlen=MAX_EVENTS)
        self._seq = 0
        self._watches: list[tuple[bytes, int, str | None, float]] = []  # peer, after, epoch
        self._releases: list[tuple[str, int]] = []  # (request, after_step) not yet applied
        self._loaded_step = 0  # the last step whose loads this worker made (its own thread)
        self._stop = threading.Event()
        self.received = 0
        self.refused = 0
        self.busy = 0
        self._thread = threading.Thread(target=self._run, name="kimi-ec-receiver", daemon=True)
        self._thread.start()

    def loaded_through(self, step: int) -> None:
        """The worker made every load of the scheduler's steps up to ``step``: releases
        sent after them may drop what they loaded."""
        self._loaded_step = max(self._loaded_step, step)

    def stats(self) -> dict[str, int | str]:
        """What this worker holds and has done in its epoch."""
        return {
            "epoch": self.epoch,
            "items": len(self.staging),
            "held_bytes": self.staging.held_bytes,
            **self.staging.counts,
        }

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
            self._apply_releases(now)
            for mm_hash in self.staging.expire(now):
                log.warning("staged features of %s were never asked for; dropped", mm_hash)
                self._event("gone", mm_hash, EXPIRED)
            self._answer_watches(now)

    def _handle(self, frames: Sequence[zmq.Frame]) -> None:
        peer = frames[0].bytes
        if len(frames) < 3 or frames[1].bytes != MAGIC:
            return  # not our protocol: nothing to answer in
        try:
            header = json.loads(frames[2].bytes)
        except ValueError:
            header = None
        op = header.get("op") if isinstance(header, dict) else None
        if op in ("watch", "hold", "release") and len(frames) == 3:
            self._scheduler_op(peer, header)
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
        evicted = self.staging.make_room(payload.nbytes, mm_hash)
        if evicted is None:
            self.busy += 1
            message = (
                f"staging holds {self.staging.held_bytes} of {self.staging.capacity_bytes} "
                f"bytes, {self.staging.referenced_bytes()} of them named by unfinished "
                f"requests; this item needs {payload.nbytes}"
            )
            retry = BUSY_RETRY_AFTER_S
            answer = reply(push_id, mm_hash, "busy", message, retry, worker=self.stats())
            self._socket.send_multipart([peer, *answer])
            return
        for key in evicted:
            log.warning(
                "staged features of %s dropped unclaimed to make room under ec_buffer_size=%d",
                key,
                self.staging.capacity_bytes,
            )
            self._event("gone", key, EVICTED)
        tensor = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
        tensor.view(torch.uint8).numpy().reshape(-1)[:] = memoryview(payload).cast("B")
        self.staging.put(mm_hash, tensor, time.monotonic())
        self.received += 1
        self._event("staged", mm_hash, shape[0])
        self._socket.send_multipart([peer, *reply(push_id, mm_hash, "ok", worker=self.stats())])

    def _scheduler_op(self, peer: bytes, header: dict) -> None:
        op = header["op"]
        if op == "watch":
            # One watch per scheduler: a later one (asked again) replaces it.
            self._watches = [w for w in self._watches if w[0] != peer]
            after, epoch = int(header.get("after", 0)), header.get("epoch")
            self._watches.append((peer, after, epoch, time.monotonic()))
            return
        request = str(header.get("request", ""))
        if op == "hold":
            self.staging.hold(request, [str(h) for h in header.get("mm_hashes", [])])
            self._event("held", request, 0)
        elif header.get("epoch") != self.epoch:
            # Held in an earlier epoch: this worker made none of that scheduler's loads.
            self._releases.append((request, 0))
        else:
            self._releases.append((request, int(header.get("after_step", 0))))

    def _apply_releases(self, now: float) -> None:
        """Releases whose loads this worker has made (a request finished while a step
        that loads for it was still on its way must not lose the item before it)."""
        if not self._releases:
            return
        waiting = []
        for request, after_step in self._releases:
            if after_step > self._loaded_step:
                waiting.append((request, after_step))
                continue
            for mm_hash in self.staging.release(request, now):
                self._event("gone", mm_hash, RELEASED)
        self._releases = waiting

    def _event(self, kind: str, key: str, detail: int | str) -> None:
        self._seq += 1
        self._events.append((self._seq, kind, key, detail))
        self._answer_watches(time.monotonic())

    def _answer_watches(self, now: float) -> None:
        kept = []
        first = self._events[0][0] if self._events else self._seq + 1
        for peer, after, epoch, since in self._watches:
            if epoch != self.epoch or after + 1 < first or after > self._seq:
                # A new watcher, one of another epoch, or one further behind than the
                # events remembered: the whole state, then events from there.
                body = {
                    "op": "state",
                    "epoch": self.epoch,
                    "last": self._seq,
                    "staged": self.staging.snapshot(),
                    "held": self.staging.requests(),
                }
            elif after < self._seq or now - since >= WATCH_HOLD_S:
                events = [e for e in self._events if e[0] > after] if after < self._seq else []
                body = {"op": "events", "epoch": self.epoch, "last": self._seq, "events": events}
            else:
                kept.append((peer, after, epoch, since))
                continue
            self._socket.send_multipart([peer, MAGIC, json.dumps(body).encode()])
        self._watches = kept


class Watcher:
    """A scheduler's view of what its engine's workers (``addresses``) have staged, and its
    holds on them: ``hold(request, hashes)`` when a request first names items,
    ``release(request, after_step)`` when it finishes."""

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
        n = len(self.addresses)
        self._after = [0] * n
        self._epoch: list[str | None] = [None] * n
        self._asked_at: list[float | None] = [None] * n
        self._staged: list[dict[str, int]] = [{} for _ in range(n)]  # mm_hash -> rows
        self._held: list[set[str]] = [set() for _ in range(n)]  # holds the worker applied
        self._sent: list[set[str]] = [set() for _ in range(n)]  # holds sent this epoch
        self._fates: list[OrderedDict[str, str]] = [OrderedDict() for _ in range(n)]
        self._unsent: list[list[bytes]] = [[] for _ in range(n)]  # releases to send
        self._holds: dict[str, list[str]] = {}  # request -> the hashes it names
        self.lost: list[tuple[int, set[str]]] = []  # (worker, hashes) a restart took
        self.counts = dict.fromkeys((*COUNTS[:1], *COUNTS[3:], LOST), 0)
        for index in range(n):
            self._ask(index)

    # The scheduler's holds

    def hold(self, request_id: str, mm_hashes: Iterable[str]) -> None:
        """``request_id`` names these items until it is released (sent at the next drain)."""
        self._holds[request_id] = sorted(set(mm_hashes))

    def holds(self, request_id: str) -> bool:
        return request_id in self._holds

    def named(self, request_id: str) -> list[str]:
        """The hashes a held request names."""
        return self._holds.get(request_id, [])

    def release(self, request_id: str, after_step: int) -> None:
        """``request_id`` finished; the workers drop what it alone named once they made
        the loads of every step up to ``after_step``."""
        if self._holds.pop(request_id, None) is None:
            return
        for index in range(len(self.addresses)):
            self._held[index].discard(request_id)
            if request_id in self._sent[index]:
                self._sent[index].discard(request_id)
                body = {"op": "release", "request": request_id, "after_step": after_step}
                body["epoch"] = self._epoch[index]
                self._unsent[index].append(json.dumps(body).encode())
        self._send_pending()

    def held(self, request_id: str) -> bool:
        """Whether every worker confirmed ``request_id``'s hold."""
        return all(request_id in held for held in self._held)

    # Reading the workers

    def _ask(self, index: int) -> None:
        body = {"op": "watch", "after": self._after[index], "epoch": self._epoch[index]}
        if self._send(index, json.dumps(body).encode()):
            self._asked_at[index] = time.monotonic()
        else:  # not connected (yet): asked at the next drain, never blocking
            self._asked_at[index] = None

    def _send(self, index: int, body: bytes) -> bool:
        try:
            self._sockets[index].send_multipart([MAGIC, body], zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _send_pending(self) -> None:
        for index in range(len(self.addresses)):
            while self._unsent[index] and self._send(index, self._unsent[index][0]):
                self._unsent[index].pop(0)
            if self._epoch[index] is None:
                continue  # holds go once the worker's state is known (its epoch)
            for request_id, hashes in self._holds.items():
                if request_id in self._sent[index]:
                    continue
                body = {"op": "hold", "request": request_id, "mm_hashes": hashes}
                if not self._send(index, json.dumps(body).encode()):
                    break
                self._sent[index].add(request_id)

    def drain(self) -> None:
        """Read every answer that has come, without waiting, watch again, and send the
        holds and releases not sent yet."""
        for index, sock in enumerate(self._sockets):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2 and frames[0] == MAGIC:
                    self._apply(index, json.loads(frames[1]))
                    self._ask(index)
            # Not asked yet (no connection then), or a watch lost to a restarted worker
            # (a live one answers within WATCH_HOLD_S; asking twice keeps one watch).
            asked_at = self._asked_at[index]
            if asked_at is None or time.monotonic() - asked_at > REASK_S:
                self._ask(index)
        self._send_pending()

    def _apply(self, index: int, body: dict) -> None:
        if body.get("op") == "state":
            self._apply_state(index, body)
        elif body.get("epoch") == self._epoch[index]:
            self._apply_events(index, body.get("events", []))
        else:
            return  # an answer from before a restart: the state comes next
        self._after[index] = int(body.get("last", self._after[index]))

    def _apply_state(self, index: int, body: dict) -> None:
        staged = self._staged[index]
        now_staged = {str(k): int(v) for k, v in body.get("staged", {}).items()}
        gone = set(staged) - set(now_staged)
        if body.get("epoch") == self._epoch[index]:
            self._fate(index, gone, UNSEEN)  # left while this scheduler was behind
        else:
            if self._epoch[index] is not None:
                address = self.addresses[index]
                log.warning("worker %s restarted: %d staged items lost", address, len(gone))
                self._fate(index, gone, LOST)
                self.counts[LOST] += len(gone)
                if gone:
                    self.lost.append((index, gone))
            self._epoch[index] = body.get("epoch")
            self._sent[index] = set()  # the holds go to this worker again
            self._unsent[index] = []
        self.counts["staged"] += len(set(now_staged) - set(staged))  # new to this view
        staged.clear()
        staged.update(now_staged)
        self._held[index] = set(body.get("held", [])) & set(self._holds)

    def _apply_events(self, index: int, events: list) -> None:
        staged, fates = self._staged[index], self._fates[index]
        for _, kind, key, detail in events:
            if kind == "staged":
                staged[key] = int(detail)
                fates.pop(key, None)
                self.counts["staged"] += 1
            elif kind == "gone":
                staged.pop(key, None)
                self._fate(index, [key], str(detail))
                if detail in self.counts:
                    self.counts[detail] += 1
            elif kind == "held" and key in self._holds:
                self._held[index].add(key)

    def _fate(self, index: int, keys: Iterable[str], why: str) -> None:
        fates = self._fates[index]
        for key in keys:
            fates.pop(key, None)
            fates[key] = why
        while len(fates) > MAX_FATES:
            fates.popitem(last=False)

    def rows(self, mm_hash: str) -> int | None:
        """The item's rows once every worker staged it (all the same), else None."""
        found = {staged.get(mm_hash) for staged in self._staged}
        if len(found) != 1 or None in found:
            return None
        return found.pop()

    def staged_on(self, mm_hash: str) -> int:
        return sum(mm_hash in staged for staged in self._staged)

    def fate(self, mm_hash: str) -> tuple[str, str] | None:
        """(worker address, why it left) for an item a worker no longer holds; None if
        no worker that lacks it is known to have had it."""
        for index, staged in enumerate(self._staged):
            if mm_hash not in staged and mm_hash in self._fates[index]:
                return self.addresses[index], self._fates[index][mm_hash]
        return None

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
