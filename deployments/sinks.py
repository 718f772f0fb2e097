"""Where a rank puts the features of an encode call when they do not go back to the
ingress: the rank that made them delivers them itself, and answers with what it did.

- ``EcFiles``: vLLM encoder-cache entries (``kimi_encoder.engines.vllm``), one file per
  uuid, written atomically by the rank from the features it just copied to the host or
  from its cache; it answers ``Written`` records, the ingress only the metadata.
- ``Kept``: the rank keeps each image's features in Ray's object store (its cache's
  copy, or one put there now) and answers their refs (``stored.StoredFeatures``); the
  ingress passes the refs on unread, to the one rank that then pushes an sglang part
  (``rank.EncoderRank.push``).

A request's ``Destination`` says where its items go; the fan-out cuts it into one
sink per rank call (``for_call``), since a call carries one copy of each duplicate
image and a copy may stand for several request items.

Ray-free: ranks, the fan-out and tests share these records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kimi_encoder.engines.sglang import EncodeRequest
from kimi_encoder.engines.sglang_frames import stored_embedding_frames
from kimi_encoder.engines.transport import Frame


class Destination(Protocol):
    """Where each item of one request goes (not back to the ingress)."""

    def for_call(self, copies: Sequence[Sequence[int]]) -> object:
        """The sink of one rank call: ``copies[k]`` are the request indices of the items
        that the call's k-th image stands for (it and its duplicates)."""
        ...


@dataclass(frozen=True)
class EcFiles:
    """The encoder-cache entries a rank writes: ``uuids[k]`` for its call's k-th image
    (one entry per request item it stands for), under ``root``."""

    root: str
    uuids: tuple[tuple[str, ...], ...]

    def only(self, positions: Sequence[int]) -> EcFiles:
        """The entries of the call's images at ``positions`` (a call sent again)."""
        return EcFiles(self.root, tuple(self.uuids[k] for k in positions))


@dataclass(frozen=True)
class EcDestination:
    """A ``vllm_ec`` request: item ``i`` becomes the entry ``uuids[i]`` under ``root``."""

    root: str
    uuids: Sequence[str]

    def for_call(self, copies: Sequence[Sequence[int]]) -> EcFiles:
        return EcFiles(self.root, tuple(tuple(self.uuids[i] for i in c) for c in copies))


@dataclass(frozen=True)
class Written:
    """One image's features as a rank wrote them (in place of the features): their
    ``shape`` (tokens, hidden) and ``dtype``, and each entry's file size by uuid."""

    shape: tuple[int, int]
    dtype: str
    sizes: dict[str, int]


@dataclass(frozen=True)
class Kept:
    """The rank answers each image's features as a ref into Ray's object store."""

    def only(self, positions: Sequence[int]) -> Kept:
        return self


@dataclass(frozen=True)
class KeptDestination:
    """Every item's features stay in the ranks' object stores, answered as refs."""

    def for_call(self, copies: Sequence[Sequence[int]]) -> Kept:
        return Kept()


KEPT = KeptDestination()


@dataclass(frozen=True)
class PartPush:
    """An sglang part for one rank to push: its request (frame 0's fields), its images'
    grids and original sizes in item order, the features' dtype, and the endpoints
    (``tcp://ip:port``, checked by the ingress) that receive it; ``one_off`` for a
    zmq_to_tokenizer port opened for this part alone."""

    req: EncodeRequest
    dtype: str
    grids: tuple[tuple[int, int, int], ...]
    sizes: tuple[tuple[int, int], ...]
    endpoints: tuple[str, ...]
    one_off: bool
    send_timeout_s: float


def part_frames(part: PartPush, arrays: Sequence[np.ndarray]) -> list[Frame]:
    """``part``'s two frames from its images' arrays (storage arrays of ``part.dtype``, in
    item order). Frame 1 is the array itself for a part of one image (as it lies in the
    object store: no copy), else one buffer of the arrays joined in item order."""
    # (tokens, hidden); ascontiguousarray returns a contiguous array itself
    rows = np.ascontiguousarray(arrays[0]) if len(arrays) == 1 else np.concatenate(arrays)
    grids = torch.tensor(part.grids, dtype=torch.int64)
    return stored_embedding_frames(part.req, rows, part.dtype, grids, part.sizes)
