"""One-copy response bodies: the same documents as the straightforward path."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from deployments.wire import b64, json_body, safetensors_body


def arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = [rng.standard_normal((n, 80)).astype(np.float32) for n in (1, 12, 0, 300)]
    out.append(rng.standard_normal((600, 80)).astype(np.float32)[::2])  # not contiguous
    return out


def test_b64_reads_the_array_buffer():
    for a in arrays():
        assert b64(a) == base64.b64encode(np.ascontiguousarray(a, "<f4").tobytes())


def test_json_body_equals_plain_json():
    items = [{"index": i, "shape": list(a.shape), "data": a} for i, a in enumerate(arrays())]
    payload = {"model": "preset:tiny @@data-", "items": items, "usage": {"images": len(items)}}
    plain = {
        **payload,
        "items": [{**it, "data": b64(it["data"]).decode()} for it in items],
    }
    assert json.loads(json_body(payload)) == plain
    assert json.loads(json_body({"items": [], "x": 1})) == {"items": [], "x": 1}


def test_safetensors_body_loads_like_the_library():
    tensors = {f"features.{i}": np.ascontiguousarray(a) for i, a in enumerate(arrays())}
    tensors["grid_thw.0"] = np.asarray([[1, 4, 6]], dtype=np.int64)
    meta = {"model": "preset:tiny", "owner_ranks": "[0, 1]"}
    ours = safetensors_body(tensors, metadata=meta)
    assert int.from_bytes(ours[:8], "little") % 8 == 0  # data aligned like the library's
    theirs = load_safetensors(save_safetensors(tensors, metadata=meta))
    loaded = load_safetensors(ours)
    assert loaded.keys() == theirs.keys() == tensors.keys()
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded[name], array)
    header = json.loads(ours[8 : 8 + int.from_bytes(ours[:8], "little")])
    assert header["__metadata__"] == meta


def test_safetensors_refuses_other_dtypes():
    with pytest.raises(ValueError, match="not a little-endian F32/F16/I64"):
        safetensors_body({"x": np.zeros(3, dtype=">f4")})
