"""Peak resident memory of one rank's encoder.

    python -m benchmarks.bench_memory [--quick]

Each case runs in a fresh process (what a rank holds: torch, the model, one
forward): peak RSS after building the preset with seeded
random weights and, except for the full ``k3`` preset (load only), one forward
over a 32x32-patch image. The baseline row is the same process without a model.
"""

from __future__ import annotations

import json
import subprocess
import sys

from .common import Section, table
from .page import standalone

CASES = [
    ("baseline (python + torch + kimi_encoder)", None, "float32", False),
    ("tiny", "tiny", "float32", True),
    ("small", "small", "float32", True),
    ("k3 (load only)", "k3", "bfloat16", False),
]

CHILD = """
import json, sys, time, torch
torch.set_num_threads(1)
from kimi_encoder.encoder import VisionEncoder
preset, dtype, forward = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
started = time.perf_counter()
params = 0
if preset != "none":
    enc = VisionEncoder.from_pretrained(preset, device="cpu", dtype=dtype, backend="cpu")
    params = sum(p.numel() for p in enc.model.parameters())
    if forward:
        enc.time_forward(32)
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a big parent would show.
status = open("/proc/self/status").read().split("VmHWM:")[1]
rss = int(status.split()[0]) * 1024
print(json.dumps({"rss": rss, "params": params, "s": time.perf_counter() - started}))
"""


def measure(preset: str | None, dtype: str, forward: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, preset or "none", dtype, "1" if forward else "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def sections(quick: bool) -> list[Section]:
    rows = []
    for name, preset, dtype, forward in CASES:
        m = measure(preset, dtype, forward)
        rows.append(
            [
                name,
                dtype,
                "yes (32x32 patches)" if forward else "no",
                f"{m['params'] / 1e6:.1f} M",
                f"{m['rss'] / 2**20:.0f}",
                f"{m['s']:.1f}",
            ]
        )
    note = (
        "One fresh process per row, one torch thread: peak RSS (VmHWM) after building the "
        "preset with seeded random weights and one forward over a 32x32-patch image (the "
        "full k3 preset: load only). One measurement per row (memory is not noisy)."
    )
    return [
        Section(
            "Peak resident memory per rank",
            "python -m benchmarks.bench_memory",
            [note, table(HEADER, rows)],
        )
    ]


HEADER = ["case", "dtype", "forward", "parameters", "peak RSS MiB", "build s"]


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
