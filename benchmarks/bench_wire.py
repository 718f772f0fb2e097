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

from .common import Section, alternate, ratio, spread, standalone, table


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


PATHS = {
    "JSON, straightforward": plain_json,
    "JSON, deployments/wire.py": ours_json,
    "safetensors.numpy.save": plain_st,
    "safetensors, deployments/wire.py": ours_st,
}


def seconds(fn, arrays) -> float:
    start = time.perf_counter()
    fn(arrays)
    return time.perf_counter() - start


def peak_bytes(fn, arrays) -> int:
    tracemalloc.start()
    fn(arrays)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def sections(quick: bool) -> list[Section]:
    mb = 16 if quick else 64
    arrays = features(mb)
    payload = sum(a.nbytes for a in arrays)
    assert json.loads(ours_json(arrays[:1])) == json.loads(plain_json(arrays[:1]))
    repeats = 3 if quick else 7
    times = alternate(
        {name: lambda fn=fn: seconds(fn, arrays) for name, fn in PATHS.items()}, repeats
    )
    per_mb = {name: [t * 1e3 / (payload / (1 << 20)) for t in ts] for name, ts in times.items()}
    rows = [
        [name, spread(per_mb[name]).fmt(2), f"{peak_bytes(fn, arrays) / payload:.2f}"]
        for name, fn in PATHS.items()
    ]
    names = list(PATHS)
    speedups = table(
        ["answer", "wire.py speed-up over the straightforward path"],
        [
            ["JSON", f"**{ratio(per_mb[names[0]], per_mb[names[1]]).fmt(2, 'x')}**"],
            ["safetensors", f"**{ratio(per_mb[names[2]], per_mb[names[3]]).fmt(2, 'x')}**"],
        ],
    )
    note = (
        f"{len(arrays)} read-only float32 arrays of K3's width 7168, {payload / 2**20:.0f} MB "
        f"in all; {repeats} repeats alternating the four paths; time per MB of features: "
        "median (min–max); alloc / payload: tracemalloc's peak over the payload, one run."
    )
    return [
        Section(
            "Zero-copy response assembly",
            "python -m benchmarks.bench_wire",
            [note, table(HEADER, rows), speedups],
        )
    ]


HEADER = ["assembly", "ms per MB of features", "alloc / payload"]


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
