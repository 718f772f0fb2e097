"""vLLM's encoder cache on shared storage, as its 0.33.0 ``ECExampleConnector`` reads it.

A consumer engine looks for ``{root}/{identifier}/encoder_cache.safetensors``
holding one tensor ``ec_cache`` of shape ``(num_embeds, hidden)``. The
identifier is the client's ``uuid`` on the image's content part (when the
request carries no processor or media-IO kwargs). The consumer only checks that
the path exists, and runs the tower itself when it does not: a file must never
be visible half-written, so it is written under a temporary name in the same
directory, flushed to disk and renamed into place.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..features import SAFETENSORS, dtype_name, safetensors_parts, to_numpy

VLLM_VERSION = "0.33.0"
EC_FILENAME = "encoder_cache.safetensors"
EC_KEY = "ec_cache"


@dataclass(frozen=True)
class EcCacheEntry:
    """What ``write_ec_cache`` wrote."""

    uuid: str
    path: Path
    num_tokens: int
    hidden: int
    dtype: str
    nbytes: int


def ec_cache_path(root: str | os.PathLike, uuid: str) -> Path:
    """``{root}/{uuid}/encoder_cache.safetensors``, after checking ``uuid``."""
    check_uuid(uuid)
    return Path(root) / uuid / EC_FILENAME


def check_uuid(uuid: str) -> None:
    """``uuid`` must name one directory inside the root: no separators, no dots only."""
    bad = (
        not isinstance(uuid, str)
        or uuid in ("", ".", "..")
        or any(c in uuid for c in "/\\\0")
        or any(ord(c) < 32 for c in uuid)
        or len(uuid.encode()) > 255
    )
    if bad:
        raise ValueError(
            f"uuid {uuid!r} cannot name a cache directory: it must be a non-empty name of at "
            "most 255 bytes without '/', '\\', control characters, and not '.' or '..'. "
            "Send the same uuid the client puts on the image's content part."
        )


def write_ec_cache(root: str | os.PathLike, uuid: str, features: torch.Tensor) -> EcCacheEntry:
    """Write ``features`` ``(num_embeds, hidden)`` as ``uuid``'s cache entry, atomically.

    Kept in their dtype (bfloat16 is stored as safetensors BF16). ``root`` must
    exist (it is the engine's ``shared_storage_path``); ``uuid``'s directory is
    created. An existing entry is replaced whole.
    """
    tensor = features.detach().cpu()
    return write_ec_array(root, uuid, to_numpy(tensor), dtype_name(tensor.dtype))


def write_ec_array(
    root: str | os.PathLike, uuid: str, array: np.ndarray, dtype: str
) -> EcCacheEntry:
    """``write_ec_cache`` of features held as their storage array (``kimi_encoder.features``:
    bfloat16 as 16-bit words), written from the array's buffer without a copy (a
    read-only array from Ray's object store, say)."""
    path = ec_cache_path(root, uuid)
    if not Path(root).is_dir():
        raise FileNotFoundError(
            f"encoder-cache root {str(root)!r} is not a directory; create it, or point the "
            "server at the consumer's shared_storage_path (on every node that runs a rank)."
        )
    if array.ndim != 2 or array.shape[0] < 1:
        raise ValueError(
            f"features must be a non-empty (num_embeds, hidden) tensor, got shape "
            f"{tuple(array.shape)}."
        )
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{EC_FILENAME}.{secrets.token_hex(8)}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.writelines(safetensors_parts({EC_KEY: (array, SAFETENSORS[dtype])}))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    num_tokens, hidden = array.shape
    return EcCacheEntry(
        uuid=uuid,
        path=path,
        num_tokens=num_tokens,
        hidden=hidden,
        dtype=dtype,
        nbytes=path.stat().st_size,
    )


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
