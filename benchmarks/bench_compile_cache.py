"""Compiled start of two ranks on one node: the second against the first.

    python -m benchmarks.bench_compile_cache [--quick] [--presets tiny small]

For each preset, two processes are started at the same time, each building the tower
'compiled' on CPU (seeded weights, float32), as two ranks of a node starting together:

- shared: one empty inductor cache folder for both (what ranks of a node share): the
  first takes the node's compile lock and compiles, the second waits, then loads what
  the first compiled (``kimi_encoder.compiled``, "One compile per node");
- apart: an empty folder each (no shared cache: both compile, at the same time).

Per process: its build (compile or load, the lock's wait excluded), its wait for the
lock, when it was ready after both were launched (imports, weights, wait and build), and
its FX graph cache hits and misses. The figure is the second's build over the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .checkout import ROOT
from .common import Section, spread, table
from .page import arguments, standalone


def child(preset: str) -> None:
    """One process's compiled start; prints its execution info and when it was ready."""
    import torch

    from kimi_encoder.config import get_preset
    from kimi_encoder.execution import prepare
    from kimi_encoder.weights import random_model

    model = random_model(get_preset(preset).vision, 0, "cpu", torch.float32)
    info = prepare(model, "compiled").info()
    print(json.dumps({**info, "ready_at": time.time()}))


def pair(preset: str, shared: bool) -> list[dict]:
    """Two processes launched together: their infos, the lock's first holder first."""
    with tempfile.TemporaryDirectory() as folder:
        caches = [folder] * 2 if shared else [os.path.join(folder, str(k)) for k in range(2)]
        launched = time.time()
        procs = []
        for cache in caches:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            command = [sys.executable, "-m", "benchmarks.bench_compile_cache", "--child", preset]
            procs.append(
                subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
            )
        infos = []
        for proc in procs:
            out, _ = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"a compiling process failed ({proc.returncode}): {out}")
            info = json.loads(out.strip().splitlines()[-1])
            infos.append({**info, "ready_s": info["ready_at"] - launched})
    return sorted(infos, key=lambda info: info["compile_wait_s"])


def cache_cell(info: dict) -> str:
    cache = info["compile_cache"]
    return f"{cache['hit']} / {cache['miss']}"


def sections(quick: bool, presets: tuple[str, ...] = ("tiny", "small")) -> list[Section]:
    repeats = 1 if quick else 3
    rows = []
    for preset in presets:
        shared, apart = [], []
        for _ in range(repeats):  # alternated: a change in the machine's load hits both
            shared.append(pair(preset, shared=True))
            apart.append(pair(preset, shared=False))
        first = spread([run[0]["compile_s"] for run in shared])
        second = spread([run[1]["compile_s"] for run in shared])
        ratio = spread([run[0]["compile_s"] / run[1]["compile_s"] for run in shared])
        rows.append(
            [
                preset,
                first.fmt(1),
                cache_cell(shared[-1][0]),
                spread([run[1]["compile_wait_s"] for run in shared]).fmt(1),
                second.fmt(1),
                cache_cell(shared[-1][1]),
                f"**{ratio.fmt(1, 'x')}**",
                spread([run[1]["ready_s"] for run in shared]).fmt(1),
                spread([max(p["compile_s"] for p in run) for run in apart]).fmt(1),
                spread([max(p["ready_s"] for p in run) for run in apart]).fmt(1),
            ]
        )
    header = [
        "preset",
        "first: compile, s",
        "first: hits / misses",
        "second: wait, s",
        "second: load, s",
        "second: hits / misses",
        "first / second",
        "second ready, s",
        "apart: slower compile, s",
        "apart: second ready, s",
    ]
    conditions = (
        f"Two processes launched together per run, {repeats} run(s) per preset and cache "
        "layout, the layouts alternated, each building the preset's tower 'compiled' "
        "(seeded weights, float32; compile workers: the library's default bound). Shared: "
        "one empty cache folder for both; apart: one each. Build seconds exclude the wait "
        "for the node's lock; ready: seconds from the launch until the process had its "
        "compiled tower (imports and weights included); median (min–max) over the runs; "
        "hits / misses: the FX graph cache's, of the last run. first / second is the "
        "figure: how much faster the second rank's compiled start is than the first's."
    )
    return [
        Section(
            "Compiled start: the second rank against the first",
            "python -m benchmarks.bench_compile_cache",
            [conditions, table(header, rows)],
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one compiling process
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    return standalone(
        __doc__, lambda a: sections(a.quick, tuple(args.presets)), argv, parser=parser
    )


if __name__ == "__main__":
    sys.exit(main())
