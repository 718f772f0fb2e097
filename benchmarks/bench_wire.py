"""Zero-copy response assembly: time per MB and bytes allocated per payload byte.

    python -m benchmarks.bench_wire [--quick]

Side by side on the same feature arrays (read-only, as the ingress receives
them from the object store): the straightforward path (``tobytes`` + base64 +
``str`` + pydantic dump + ``json.dumps`` for JSON; ``safetensors.numpy.save``)
against deployments/wire.py. "alloc / payload" is tracemalloc's peak during
assembly over the raw float32 bytes: the copies made, the body included.

Every path writes into memory the allocator has already mapped: glibc is told to
keep freed buffers (``mallopt``) and each path runs once before the clock, as a
long-running ingress does once it has freed a body under glibc's 32 MB mmap
threshold. Otherwise each body's fresh pages arrive as 2 MB transparent huge
pages or as 4 KB page faults depending on the machine's memory state, and that
alone swung the figures between back-to-back runs; the page faults cost every
path the same per byte and are not assembly.
"""

from __future__ import annotations

import base64
import ctypes
import json
import sys
import time
import tracemalloc

import numpy as np
from safetensors.numpy import save as save_safetensors

from deployments.wire import json_body
from kimi_encoder.features import safetensors_body

from .common import Section, alternate, ratio, spread, table
from .page import standalone


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


def keep_freed_memory() -> bool:
    """Ask glibc to serve buffers under 32 MB from its heap and never give freed heap
    back to the kernel; False where the C library is not glibc (figures then include
    page faults)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


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
    mb = 8 if quick else 16  # the largest buffer (JSON's base64 text) stays under 32 MB
    arrays = features(mb)
    payload = sum(a.nbytes for a in arrays)
    assert json.loads(ours_json(arrays[:1])) == json.loads(plain_json(arrays[:1]))
    repeats = 3 if quick else 15
    mapped = keep_freed_memory()
    for fn in PATHS.values():
        fn(arrays)  # maps the pages every later repeat writes into
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
        f"in all; {repeats} repeats alternating the four paths after one untimed run of each; "
        + (
            "freed memory kept mapped (glibc mallopt), so no page faults are timed; "
            if mapped
            else "**the C library is not glibc: page faults are timed too**; "
        )
        + "time per MB of features: median (min–max); alloc / payload: tracemalloc's peak "
        "over the payload, one run."
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
