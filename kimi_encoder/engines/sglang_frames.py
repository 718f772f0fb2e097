"""The two frames of an sglang 0.5.23 part (``sglang.py`` has the protocol's facts).

Frame 0 is written without importing sglang: stand-in classes are pickled and
the two class references in the bytes are renamed to sglang's, so the
receiver's allow-list unpickler resolves them to its own ``EmbeddingData`` and
``Modality``. Every other global in the frame is checked against that
allow-list's entries we rely on. Frame 1 is the embedding's raw bytes.
"""

from __future__ import annotations

import copyreg
import itertools
import pickle
import pickletools
from collections.abc import Sequence
from enum import Enum

import numpy as np
import torch

from ..features import STORAGE, check_dtype, dtype_name, to_numpy, torch_dtype
from .sglang import (
    EMBEDDING_DATA,
    FRAME0_GLOBALS,
    MODALITY,
    MODALITY_IMAGE,
    TORCH_DTYPES,
    EncodeRequest,
)
from .transport import Frame


def embedding_frames(
    req: EncodeRequest,
    features: torch.Tensor,
    grids: torch.Tensor,
    original_sizes: Sequence[tuple[int, int]],
) -> list[Frame]:
    """The two frames of one part: metadata, then ``features``' bytes (not copied).

    ``features`` is ``(tokens, hidden)``, every image's rows in item order;
    ``grids`` is ``(n, 3)`` t/h/w in patches before the merge; ``original_sizes``
    is each image's uploaded ``(width, height)``, which K3's prefill writes into
    the prompt. Frame 1 shares ``features``' memory: leave them unchanged.
    """
    if features.ndim != 2 or features.shape[0] < 1 or features.dtype not in TORCH_DTYPES:
        raise ValueError(
            f"features must be a non-empty (tokens, hidden) tensor of "
            f"{[str(d) for d in TORCH_DTYPES]}, got {tuple(features.shape)} {features.dtype}."
        )
    rows = to_numpy(features.detach().cpu())
    return stored_embedding_frames(req, rows, dtype_name(features.dtype), grids, original_sizes)


def stored_embedding_frames(
    req: EncodeRequest,
    rows: np.ndarray,
    dtype: str,
    grids: torch.Tensor,
    original_sizes: Sequence[tuple[int, int]],
) -> list[Frame]:
    """``embedding_frames`` of features held as a storage array (``kimi_encoder.features``:
    bfloat16 as its 16-bit words), C-contiguous. A read-only array (a rank's answer,
    read in place from the object store) is sent as it is: frame 1 is its memory."""
    if (
        rows.ndim != 2
        or rows.shape[0] < 1
        or rows.dtype != STORAGE[check_dtype(dtype)]
        or not rows.flags.c_contiguous
    ):
        raise ValueError(
            f"features must be a non-empty C-contiguous (tokens, hidden) array of "
            f"{dtype}'s storage {STORAGE[dtype]}, got {rows.shape} {rows.dtype} "
            f"(C-contiguous: {rows.flags.c_contiguous})."
        )
    n = len(req.mm_items)
    if tuple(grids.shape) != (n, 3) or len(original_sizes) != n:
        raise ValueError(
            f"part has {n} images but grids of shape {tuple(grids.shape)} and "
            f"{len(original_sizes)} original sizes; pass one (t, h, w) and one "
            "(width, height) per image."
        )
    meta = _part_state(req) | {
        "grid_dim": _Int64Rows(grids.to(torch.int64).tolist()),
        "dtype": torch_dtype(dtype),
        "shape": list(rows.shape),
        "original_image_sizes": [[int(w), int(h)] for w, h in original_sizes],
    }
    return [_dumps(meta), memoryview(rows.reshape(-1).view(np.uint8))]


def error_frames(req: EncodeRequest, message: str, code: int) -> list[Frame]:
    """The single frame that fails the part's prefill request with ``message``."""
    return [_dumps(_part_state(req) | {"error_msg": message, "error_code": int(code)})]


class _EmbeddingData:
    """Pickled in place of sglang's class; its name is rewritten in the bytes."""

    def __init__(self, state: dict):
        self.__dict__.update(state)

    def __reduce_ex__(self, protocol):
        return copyreg.__newobj__, (type(self),), dict(vars(self))


class _Int64Rows:
    """Pickled as ``torch.LongTensor(rows)``: the receiver gets an int64 ``(n, 3)``
    tensor equal to the one torch's own pickling would give, built from a list
    instead of a ``torch.save`` archive (``_load_from_bytes``: a nested
    ``torch.load``) on both ends."""

    def __init__(self, rows: list[list[int]]):
        self.rows = rows

    def __reduce_ex__(self, protocol):
        return torch.LongTensor, (self.rows,)


class _Modality(Enum):
    IMAGE = MODALITY_IMAGE

    def __reduce_ex__(self, protocol):
        return type(self), (self.value,)


_STAND_INS = {
    (__name__, _EmbeddingData.__name__): EMBEDDING_DATA,
    (__name__, _Modality.__name__): MODALITY,
}


def _part_state(req: EncodeRequest) -> dict:
    # The attributes sglang's EmbeddingData constructor sets, in its order.
    return {
        "req_id": req.req_id,
        "num_parts": req.num_parts,
        "part_idx": req.part_idx,
        "grid_dim": None,
        "modality": _Modality.IMAGE,
        "embedding": None,
        "send_time": None,
        "dtype": None,
        "shape": None,
        "_mr_ptr": None,
        "error_msg": None,
        "error_code": None,
    }


def _dumps(state: dict) -> bytes:
    # Protocol 3 names each global in one GLOBAL opcode ("module\nname\n") and
    # has no frames, so a reference can be renamed without touching the rest.
    data = pickle.dumps(_EmbeddingData(state), protocol=3)
    ops = list(pickletools.genops(data))
    out, last = bytearray(), 0
    for (op, arg, pos), (_, _, end) in itertools.pairwise(ops):
        if op.name != "GLOBAL":
            continue
        module, name = _STAND_INS.get(tuple(arg.split(" ")), tuple(arg.split(" ")))
        if (module, name) not in FRAME0_GLOBALS:
            raise RuntimeError(f"frame 0 would name {module}.{name}, which sglang refuses.")
        out += data[last:pos] + f"c{module}\n{name}\n".encode()
        last = end
    return bytes(out + data[last:])
