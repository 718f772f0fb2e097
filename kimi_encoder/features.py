"""Feature arrays on the wire: the three dtypes, their numpy storage and safetensors names.

numpy has no bfloat16, so bfloat16 features travel as their raw 16-bit words in
a ``uint16`` array next to the dtype's name; float32 and float16 are stored as
themselves. Every array is little-endian and C-contiguous, so its bytes are the
wire format: raw little-endian values, rows one after another.

    >>> x = torch.tensor([[1.0, -2.5]], dtype=torch.bfloat16)
    >>> raw = to_numpy(x)
    >>> raw.dtype, raw.tolist()
    (dtype('uint16'), [[16256, 49184]])
    >>> to_float32(raw, "bfloat16").tolist()
    [[1.0, -2.5]]
"""

from __future__ import annotations

import numpy as np
import torch

FEATURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORAGE = {"float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2")}
SAFETENSORS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def check_dtype(name: str) -> str:
    if name not in FEATURE_DTYPES:
        raise ValueError(
            f"feature dtype {name!r} is not supported; allowed: {', '.join(FEATURE_DTYPES)}."
        )
    return name


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_numpy(features: torch.Tensor) -> np.ndarray:
    """A CPU tensor of a feature dtype as its storage array, sharing its memory."""
    name = check_dtype(dtype_name(features.dtype))
    data = features.contiguous()
    if name == "bfloat16":
        return data.view(torch.int16).numpy().view(STORAGE[name])
    return data.numpy()


def from_numpy(array: np.ndarray, name: str) -> torch.Tensor:
    """The tensor a storage array holds (shares its memory; read-only arrays are copied)."""
    check_dtype(name)
    if array.dtype != STORAGE[name]:
        raise ValueError(f"{name} features are stored as {STORAGE[name]}, got {array.dtype}.")
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.view(torch.bfloat16) if name == "bfloat16" else tensor


def to_float32(array: np.ndarray, name: str) -> np.ndarray:
    """float32 values of a storage array (bfloat16 words widened exactly)."""
    check_dtype(name)
    if name == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def from_bytes(data: bytes | memoryview, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The storage array of raw little-endian ``data`` (no copy)."""
    return np.frombuffer(data, dtype=STORAGE[check_dtype(name)]).reshape(shape)
