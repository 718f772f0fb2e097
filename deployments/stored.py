"""``StoredFeatures``: one image's features written once into Ray's object store by the
rank that made them. The rank's feature cache keeps them, its answers carry them (the
ref, not the bytes; ``ranks.records``), and a hand-off the rank pushes itself reads them.
Below both the rank deployment and the ranks wing, so neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

from kimi_encoder.features import dtype_name, to_numpy


@dataclass(frozen=True)
class StoredFeatures:
    """One image's features, written once into Ray's object store by this rank: what
    its feature cache keeps and its answers carry (the ref, not the bytes)."""

    ref: ray.ObjectRef
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @classmethod
    def put(cls, features: torch.Tensor) -> StoredFeatures:
        array = to_numpy(features)
        return cls(ray.put(array), tuple(features.shape), dtype_name(features.dtype), array.nbytes)
