"""Feature arrays on the wire: the three dtypes, their numpy storage and safetensors names.

The one place that names the dtypes: the model computes in one of them, features
travel in one, and ``auto_dtype`` says which one 'auto' means on a device.

numpy has no bfloat16, so bfloat16 features travel as their raw 16-bit words in
a ``uint16`` array next to the dtype's name; float32 and float16 are stored as
themselves. Every array is little-endian and C-contiguous, so its bytes are the
wire format: raw little-endian values, rows one after another.

    >>> import torch
    >>> x = torch.tensor([[1.0, -2.5]], dtype=torch.bfloat16)
    >>> raw = to_numpy(x)
    >>> raw.dtype, raw.tolist()
    (dtype('uint16'), [[16256, 49184]])
    >>> to_float32(raw, "bfloat16").tolist()
    [[1.0, -2.5]]
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

if TYPE_CHECKING:  # torch only where tensors are: the HTTP client reads files without it
    import torch

FeatureDtype = Literal["float32", "bfloat16", "float16"]
FEATURE_DTYPES: tuple[str, ...] = get_args(FeatureDtype)
# What dtype 'auto' means, by device type: float32 on a GPU is many times slower.
AUTO_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}
AUTO_RULE = f"{AUTO_DTYPE['cuda']} on CUDA, {AUTO_DTYPE['cpu']} on CPU"
# The element type of preprocessed pixel values in a request.
PixelDtype = Literal["float32"]
(PIXEL_DTYPE,) = get_args(PixelDtype)
STORAGE = {"float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2")}
SAFETENSORS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def check_dtype(name: str) -> str:
    if name not in FEATURE_DTYPES:
        raise ValueError(
            f"feature dtype {name!r} is not supported; allowed: {', '.join(FEATURE_DTYPES)}."
        )
    return name


def auto_dtype(device_type: str) -> str:
    """The dtype 'auto' means on a device of ``device_type`` ('cuda', 'cpu', ...)."""
    return AUTO_DTYPE["cuda" if device_type == "cuda" else "cpu"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, check_dtype(name))


def to_numpy(features: torch.Tensor) -> np.ndarray:
    """A CPU tensor of a feature dtype as its storage array, sharing its memory."""
    import torch

    name = check_dtype(dtype_name(features.dtype))
    data = features.contiguous()
    if name == "bfloat16":
        return data.view(torch.int16).numpy().view(STORAGE[name])
    return data.numpy()


def storage_dtype(array: np.ndarray) -> str:
    """The feature dtype whose storage array ``array`` is (``STORAGE``'s inverse)."""
    for name, storage in STORAGE.items():
        if array.dtype == storage:
            return name
    raise ValueError(f"{array.dtype} is no feature dtype's storage; allowed: {STORAGE}.")


def from_numpy(array: np.ndarray, name: str) -> torch.Tensor:
    """The tensor a storage array holds (shares its memory; read-only arrays are copied)."""
    check_dtype(name)
    if array.dtype != STORAGE[name]:
        raise ValueError(f"{name} features are stored as {STORAGE[name]}, got {array.dtype}.")
    import torch

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


# --- safetensors files of storage arrays (bfloat16 included, which numpy's reader lacks) ---

_ITEMSIZE = {"I64": 8, **{SAFETENSORS[n]: STORAGE[n].itemsize for n in SAFETENSORS}}
_FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS.items()}


def safetensors_body(
    tensors: Mapping[str, tuple[np.ndarray, str]], metadata: Mapping[str, str] | None = None
) -> bytes:
    """A safetensors file of ``{name: (array, safetensors dtype)}`` (the layout
    ``safetensors`` writes), the payload copied once: each array's buffer is joined
    straight into the output."""
    return b"".join(safetensors_parts(tensors, metadata))


def safetensors_parts(
    tensors: Mapping[str, tuple[np.ndarray, str]], metadata: Mapping[str, str] | None = None
) -> list[bytes | memoryview]:
    """``safetensors_body``'s pieces in order, uncopied: the length and header, then a
    view of each (contiguous) array's buffer, for writing to a file as they are."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    buffers, offset = [], 0
    for name, (array, dtype) in tensors.items():  # written in this order; readers use offsets
        array = np.ascontiguousarray(array)
        if array.dtype.byteorder == ">" or array.dtype.itemsize != _ITEMSIZE[dtype]:
            raise ValueError(f"{name}: a {array.dtype} array cannot be stored as {dtype}.")
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        buffers.append(memoryview(array.reshape(-1).view(np.uint8)))
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    return [struct.pack("<Q", len(raw)) + raw, *buffers]


def read_safetensors(blob: bytes | memoryview) -> tuple[dict[str, tuple[np.ndarray, str]], dict]:
    """``({name: (array, dtype name)}, metadata)`` of a safetensors file, arrays viewing
    ``blob``: feature dtypes by their names (``float32``, ``bfloat16`` as uint16 words,
    ``float16``), ``I64`` as ``int64``.

    >>> import torch
    >>> data = safetensors_body({"x": (to_numpy(torch.ones(2, dtype=torch.bfloat16)), "BF16")})
    >>> tensors, _ = read_safetensors(data)
    >>> tensors["x"][1], to_float32(*tensors["x"]).tolist()
    ('bfloat16', [1.0, 1.0])
    """
    size = int.from_bytes(bytes(blob[:8]), "little")
    header = json.loads(bytes(blob[8 : 8 + size]))
    metadata = header.pop("__metadata__", {})
    data = memoryview(blob)[8 + size :]
    out = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        if entry["dtype"] == "I64":
            array, dtype = np.frombuffer(data[start:end], dtype="<i8"), "int64"
        elif entry["dtype"] in _FROM_SAFETENSORS:
            dtype = _FROM_SAFETENSORS[entry["dtype"]]
            array = np.frombuffer(data[start:end], dtype=STORAGE[dtype])
        else:
            raise ValueError(f"{name}: safetensors dtype {entry['dtype']} is not a feature dtype.")
        out[name] = (array.reshape(entry["shape"]), dtype)
    return out, metadata
