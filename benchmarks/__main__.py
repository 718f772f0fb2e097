"""Run every benchmark and write docs/benchmarks.md (tables) and docs/benchmarks/*.png.

    python -m benchmarks [--quick]      # `make bench` runs the full suite

Each benchmark module also runs alone (``python -m benchmarks.bench_serve --quick``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import bench_assign, bench_encoder, bench_handoff, bench_memory, bench_serve, bench_wire
from .common import ROOT, conditions, table

TARGETS = {
    "overhead": "served / in-process >= 0.9",
    "scaling": "dp 2 / dp 1 >= 1.7x",
    "assign": "ours <= 1.1",
    "cache": "hit >= 10x faster",
    "tower": ">= 1.0x",
    "handoff": "hand-off >= 0.5x plain ZMQ and >= 2x the HTTP body, in MB/s",
}


def tower_section(quick: bool) -> str:
    torch.set_num_threads(1)
    count = 4 if quick else len(bench_encoder.MIX)  # quick: without the 1920x1080 image
    images = bench_encoder.make_mix()[:count]
    rows = bench_encoder.bench_transformers(images, 1.0 if quick else 5.0)
    mix = ", ".join(f"{m} {w}x{h}" for m, (w, h) in bench_encoder.MIX[:count])
    note = conditions("k25-mid (K2.5 layout, 6 layers, width 384)", mix, "1 (in-process)", quick)
    header = "| preset | stage | images/s | patches/s | latency |\n|---|---|---|---|---|"
    return f"{note}\n\n{header}\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (minutes), noisy")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    quick = args.quick
    parts = ["# Benchmarks", ""]
    if quick:
        parts += [
            "> **Quick run** (`python -m benchmarks --quick`): short windows, the tiny preset "
            "where the full run uses `small`, on a shared machine. Treat these numbers as a "
            "smoke test; `make bench` (full run) regenerates this page.",
            "",
        ]
    parts += [
        "Regenerate with `make bench` (`python -m benchmarks`; `--quick` for a short run). "
        "Each section states its conditions; comparisons in a section were measured side by "
        "side in the same run.",
        "",
    ]

    print("serving benchmarks (items 1, 2, 4, 5)...", flush=True)
    served = bench_serve.run(quick)
    note, rows = served["overhead"]
    parts += [f"## 1. Serving overhead (target: {TARGETS['overhead']})", "", note, ""]
    parts += [table(["setup", "images/s", "ratio"], rows), ""]
    note, rows = served["scaling"]
    parts += [f"## 2. DP scaling (target: {TARGETS['scaling']})", "", note, ""]
    parts += [table(["setup", "images/s", "ratio"], rows), ""]

    print("assignment quality (item 3)...", flush=True)
    note, rows = bench_assign.run(quick)
    parts += [f"## 3. Assignment quality (target: {TARGETS['assign']})", "", note, ""]
    parts += [table(bench_assign.HEADER, rows), ""]

    note, rows = served["cache"]
    parts += [f"## 4. Feature cache (target: {TARGETS['cache']})", "", note, ""]
    parts += [table(["measure", "value"], rows), ""]

    note, curves = served["latency"]
    png = bench_serve.latency_plot(curves, note)
    parts += ["## 5. Latency vs offered load", "", note, "", f"![latency vs load]({png})", ""]
    header = ["dp", "offered images/s", "p50 ms", "p95 ms", "p99 ms"]
    parts += [table(header, bench_serve.latency_rows(curves)), ""]

    print("tower vs transformers (item 6)...", flush=True)
    parts += [f"## 6. Tower vs transformers (target: {TARGETS['tower']})", ""]
    parts += [tower_section(quick), ""]

    print("peak memory (item 7)...", flush=True)
    note, rows = bench_memory.run(quick)
    parts += ["## 7. Peak resident memory per rank", "", note, ""]
    parts += [table(bench_memory.HEADER, rows), ""]

    print("engine hand-off (item 8)...", flush=True)
    note, rows = bench_handoff.run(quick)
    parts += [f"## 8. Engine hand-off (target: {TARGETS['handoff']})", "", note, ""]
    parts += [table(bench_handoff.HEADER, rows), ""]

    print("response assembly (zero-copy)...", flush=True)
    note, rows = bench_wire.run(quick)
    parts += ["## Zero-copy response assembly", "", note, ""]
    parts += [table(bench_wire.HEADER, rows), ""]

    parts += [f"_Total benchmark time: {time.perf_counter() - started:.0f} s._", ""]
    with open(args.out, "w") as f:
        f.write("\n".join(parts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
