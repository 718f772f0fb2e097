"""One-copy response bodies: the same documents as the straightforward path."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors
from safetensors.torch import load as load_torch

from deployments.wire import array_base64, json_body
from kimi_encoder.features import (
    SAFETENSORS,
    STORAGE,
    read_safetensors,
    safetensors_body,
    to_float32,
    to_numpy,
)


def arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = [rng.standard_normal((n, 80)).astype(np.float32) for n in (1, 12, 0, 300)]
    out.append(rng.standard_normal((600, 80)).astype(np.float32)[::2])  # not contiguous
    return out


def test_array_base64_reads_the_array_buffer():
    for a in arrays():
        assert array_base64(a) == base64.b64encode(np.ascontiguousarray(a, "<f4").tobytes())


def test_json_body_equals_plain_json():
    items = [{"index": i, "shape": list(a.shape), "data": a} for i, a in enumerate(arrays())]
    payload = {"model": "preset:tiny @@data-", "items": items, "usage": {"images": len(items)}}
    plain = {
        **payload,
        "items": [{**it, "data": array_base64(it["data"]).decode()} for it in items],
    }
    assert json.loads(json_body(payload)) == plain
    assert json.loads(json_body({"items": [], "x": 1})) == {"items": [], "x": 1}


def test_safetensors_body_loads_like_the_library():
    tensors = {f"features.{i}": np.ascontiguousarray(a) for i, a in enumerate(arrays())}
    tensors["grid_thw.0"] = np.asarray([[1, 4, 6]], dtype=np.int64)
    names = {np.dtype("<f4"): "F32", np.dtype("<i8"): "I64"}
    meta = {"model": "preset:tiny", "owner_ranks": "[0, 1]"}
    ours = safetensors_body({k: (v, names[v.dtype]) for k, v in tensors.items()}, meta)
    assert int.from_bytes(ours[:8], "little") % 8 == 0  # data aligned like the library's
    theirs = load_safetensors(save_safetensors(tensors, metadata=meta))
    loaded = load_safetensors(ours)
    assert loaded.keys() == theirs.keys() == tensors.keys()
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded[name], array)
    header = json.loads(ours[8 : 8 + int.from_bytes(ours[:8], "little")])
    assert header["__metadata__"] == meta


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_each_feature_dtype_reads_back_with_safetensors_and_numpy(dtype):
    """The body's BF16/F16/F32 tensors, read by the safetensors library (torch, which has
    bfloat16) and by numpy from the JSON base64, equal the float32 features rounded."""
    full = torch.from_numpy(np.random.default_rng(1).standard_normal((7, 80)).astype("<f4"))
    rounded = full.to(getattr(torch, dtype))
    stored = to_numpy(rounded)
    body = safetensors_body({"features.0": (stored, SAFETENSORS[dtype])})
    assert torch.equal(load_torch(body)["features.0"], rounded)
    ours, name = read_safetensors(body)[0]["features.0"]
    assert name == dtype
    assert np.array_equal(to_float32(ours, name), rounded.float().numpy())
    raw = base64.b64decode(array_base64(stored))
    values = to_float32(np.frombuffer(raw, dtype=STORAGE[dtype]).reshape(7, 80), dtype)
    np.testing.assert_array_equal(values, rounded.float().numpy())


def test_safetensors_refuses_mismatched_dtypes():
    with pytest.raises(ValueError, match="cannot be stored as F32"):
        safetensors_body({"x": (np.zeros(3, dtype=">f4"), "F32")})
    with pytest.raises(ValueError, match="a float32 array cannot be stored as BF16"):
        safetensors_body({"x": (np.zeros(3, dtype="<f4"), "BF16")})
