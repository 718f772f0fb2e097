"""Where a rank puts the features of an encode call when they do not go back to the
ingress: the rank that made them delivers them itself, and answers with what it did.

- ``EcFiles``: vLLM encoder-cache entries (``kimi_encoder.engines.vllm``), one file per
  uuid, written atomically by the rank from the features it just copied to the host or
  from its cache; it answers ``Written`` records, the ingress only the metadata.

A request's ``Destination`` says where its items go; the fan-out cuts it into one
sink per rank call (``for_call``), since a call carries one copy of each duplicate
image and a copy may stand for several request items.

Ray-free: ranks, the fan-out and tests share these records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


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
