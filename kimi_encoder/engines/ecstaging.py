"""What a vLLM worker holds of the pushes it received (``ecreceive.Receiver`` fills it):

``Staging``: tensors by mm_hash, bounded in bytes, and the unfinished requests that
name each one. An item stays while a request names it (it can be loaded again, after
a preemption or once vLLM's encoder cache dropped it); it goes when the last of them
finishes, after ``ttl_s`` with no request naming it, or, when a push needs the room,
oldest unreferenced first.
Plain Python and torch; no sockets, vLLM or Ray.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

# Why an item left a worker (the ``gone`` event's reason).
RELEASED, EXPIRED, EVICTED, LOST, UNSEEN = "released", "expired", "evicted", "lost", "unseen"
COUNTS = ("staged", "loaded", "loaded_again", RELEASED, EXPIRED, EVICTED)


@dataclass
class Staged:
    tensor: torch.Tensor
    staged_at: float
    idle_since: float | None  # unreferenced since (None while a request names it)
    claimed: bool = False  # a request named it after this push
    loads: int = 0


@dataclass
class Staging:
    """Received tensors by mm_hash (at most ``capacity_bytes``) and the requests that name
    them. Thread-safe: the receive thread stages and drops, the worker loads."""

    capacity_bytes: int
    ttl_s: float
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    _items: OrderedDict[str, Staged] = field(default_factory=OrderedDict, repr=False)
    _refs: dict[str, set[str]] = field(default_factory=dict, repr=False)  # hash -> requests
    _named: dict[str, set[str]] = field(default_factory=dict, repr=False)  # request -> hashes
    _held: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.capacity_bytes < 1 or not self.ttl_s > 0:
            raise ValueError(
                f"staging needs a positive capacity and TTL, got {self.capacity_bytes} bytes "
                f"and {self.ttl_s} s; set ec_buffer_size and staged_ttl_s above 0."
            )

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._items)

    def referenced_bytes(self) -> int:
        with self._lock:
            return sum(s.tensor.nbytes for h, s in self._items.items() if self._refs.get(h))

    def make_room(self, nbytes: int, mm_hash: str) -> list[str] | None:
        """Evict unreferenced items, oldest first, until ``nbytes`` more fit (an item of
        the same hash is replaced, so its bytes count as free); their hashes, or None (and
        nothing evicted) if it cannot fit even then."""
        with self._lock:
            old = self._items.get(mm_hash)
            need = self._held - (old.tensor.nbytes if old else 0) + nbytes - self.capacity_bytes
            victims = []
            for key, staged in self._items.items():
                if need <= 0:
                    break
                if key == mm_hash or self._refs.get(key):
                    continue
                victims.append(key)
                need -= staged.tensor.nbytes
            if need > 0:
                return None
            for key in victims:
                self._drop(key, EVICTED)
            return victims

    def put(self, mm_hash: str, tensor: torch.Tensor, now: float) -> None:
        """Stage ``tensor``. The requests already waiting for it claim it; one that
        replaces an item still here (the same uuid pushed again for a later request)
        waits for a request named after it, so an earlier holder finishing keeps it."""
        with self._lock:
            old = self._items.pop(mm_hash, None)
            self._held += tensor.nbytes - (old.tensor.nbytes if old else 0)
            named = bool(self._refs.get(mm_hash))
            staged = Staged(tensor, now, None if named else now, claimed=named and old is None)
            staged.loads = old.loads if old else 0
            self._items[mm_hash] = staged
            self.counts["staged"] += 1

    def hold(self, request_id: str, mm_hashes: Iterable[str]) -> None:
        """``request_id`` names these items: they stay until it is released."""
        with self._lock:
            named = self._named.setdefault(request_id, set())
            for mm_hash in mm_hashes:
                named.add(mm_hash)
                self._refs.setdefault(mm_hash, set()).add(request_id)
                staged = self._items.get(mm_hash)
                if staged is not None:
                    staged.claimed, staged.idle_since = True, None

    def release(self, request_id: str, now: float) -> list[str]:
        """``request_id`` finished; the hashes dropped because no request names them now."""
        dropped = []
        with self._lock:
            for mm_hash in self._named.pop(request_id, ()):
                refs = self._refs.get(mm_hash)
                refs.discard(request_id)
                if refs:
                    continue
                del self._refs[mm_hash]
                staged = self._items.get(mm_hash)
                if staged is None:
                    continue
                if staged.claimed:
                    self._drop(mm_hash, RELEASED)
                    dropped.append(mm_hash)
                else:  # pushed again since its request named it: wait for the next one
                    staged.idle_since = now
        return dropped

    def requests(self) -> list[str]:
        with self._lock:
            return list(self._named)

    def get(self, mm_hash: str) -> torch.Tensor | None:
        """The staged tensor, left staged (loaded again if vLLM asks again); None if it
        is not (or no longer) here."""
        with self._lock:
            staged = self._items.get(mm_hash)
            if staged is None:
                return None
            self.counts["loaded_again" if staged.loads else "loaded"] += 1
            staged.loads += 1
            return staged.tensor

    def expire(self, now: float) -> list[str]:
        """Drop what no request has named for ``ttl_s``; their hashes."""
        with self._lock:
            gone = [
                key
                for key, staged in self._items.items()
                if staged.idle_since is not None and now - staged.idle_since >= self.ttl_s
            ]
            for key in gone:
                self._drop(key, EXPIRED)
        return gone

    def snapshot(self) -> dict[str, int]:
        """Rows of every staged item, by hash."""
        with self._lock:
            return {key: staged.tensor.shape[0] for key, staged in self._items.items()}

    def _drop(self, mm_hash: str, why: str) -> None:
        staged = self._items.pop(mm_hash)
        self._held -= staged.tensor.nbytes
        self.counts[why] += 1
