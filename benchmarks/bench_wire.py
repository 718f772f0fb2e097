"""Zero-copy response assembly: time per MB and bytes allocated per payload byte.

    python -m benchmarks.bench_wire [--quick]

Side by side on the same feature arrays (read-only, as the ingress receives
them from the object store): the straightforward path (``tobytes`` + base64 +
``str`` + pydantic dump + ``json.dumps`` for JSON; ``safetensors.numpy.save``)
against deployments/wire.py. "alloc / payload" is tracemalloc's peak during
assembly over the raw float32 bytes: the copies made, the body included.
"""

from __future__ import annotations

import base64
import json
import sys
import time
import tracemalloc

import numpy as np
from safetensors.numpy import save as save_safetensors

from deployments.wire import json_body
from kimi_encoder.features import safetensors_body

from .common import conditions, standalone


def features(total_mb: int, width: int = 7168) -> list[np.ndarray]:
    """Read-only float32 arrays of about ``total_mb`` MB in 8 items (K3's feature width)."""
    rows = total_mb * (1 << 20) // (4 * width) // 8
    out = []
    for i in range(8):
        a = np.random.default_rng(i).standard_normal((rows, width)).astype(np.float32)
        a.setflags(write=False)
        out.append(a)
    return out


def plain_json(arrays):
    items = []
    for i, a in enumerate(arrays):
        data = np.ascontiguousarray(a, dtype="<f4").tobytes()
        items.append({"index": i, "shape": list(a.shape), "data": base64.b64encode(data).decode()})
    return json.dumps({"model": "m", "items": items}).encode()


def ours_json(arrays):
    items = [{"index": i, "shape": list(a.shape), "data": a} for i, a in enumerate(arrays)]
    return json_body({"model": "m", "items": items})


def plain_st(arrays):
    return save_safetensors({f"features.{i}": a for i, a in enumerate(arrays)}, {"model": "m"})


def ours_st(arrays):
    tensors = {f"features.{i}": (a, "F32") for i, a in enumerate(arrays)}
    return safetensors_body(tensors, {"model": "m"})


def measure(fn, arrays, repeats: int) -> tuple[float, float]:
    """(best seconds, peak traced bytes) of building one body."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(arrays)
        best = min(best, time.perf_counter() - start)
    tracemalloc.start()
    fn(arrays)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return best, peak


def run(quick: bool) -> tuple[str, list[list]]:
    mb = 16 if quick else 64
    arrays = features(mb)
    payload = sum(a.nbytes for a in arrays)
    rows = []
    for name, fn in [
        ("JSON, straightforward", plain_json),
        ("JSON, deployments/wire.py", ours_json),
        ("safetensors.numpy.save", plain_st),
        ("safetensors, deployments/wire.py", ours_st),
    ]:
        seconds, peak = measure(fn, arrays, 3 if quick else 5)
        per_mb = seconds * 1e3 / (payload / (1 << 20))
        rows.append([name, f"{per_mb:.2f}", f"{peak / payload:.2f}"])
    assert json.loads(ours_json(arrays[:1])) == json.loads(plain_json(arrays[:1]))
    note = conditions("n/a (K3 width 7168)", f"8 arrays, {payload / 2**20:.0f} MB", "n/a", quick)
    return note, rows


HEADER = ["assembly", "ms per MB of features", "alloc / payload"]


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, run, HEADER, argv)


if __name__ == "__main__":
    sys.exit(main())
