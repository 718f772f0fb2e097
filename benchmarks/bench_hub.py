"""Weights from the hub: the vision ranges against downloading the shards that hold them.

    python -m benchmarks.bench_hub [--quick] [--presets tiny small]

A checkpoint of each preset's tower (seeded weights, float32) in Kimi-K3's layout (six
shards, the vision tensors in two of them between language-model tensors, the language
part 20x the vision part) on the hub on loopback (``benchmarks.loopback_hub``). From an
empty cache to a rank that serves, per repeat and method, in a fresh process:

- range fetch: ``kimi_encoder.hub.fetch`` (each vision shard's header and its vision
  tensors' byte ranges into one vision-only file);
- shards: huggingface_hub's ``snapshot_download`` of the config files, the index and the
  shards the index names for the vision keys (what an index-aware loader downloads);

then the encoder built from that directory and one image encoded. Bytes are what the
hub's two servers sent, counted by them; seconds are the download and the whole way to
the first features. The same arithmetic for the real Kimi-K3 repository follows, derived
from public figures, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .checkout import ROOT
from .common import Section, spread, table
from .page import arguments, standalone

REPO = "moonshotai/Kimi-K3"
METHODS = ("range fetch", "shards")

# Public figures of the real repository (the derived table): the vision tower and projector
# hold 447 M parameters, stored in bfloat16; the repository is 96 shards, about 1.5 TB.
K3_VISION_PARAMS = 447e6
K3_SHARDS = 96
K3_REPO_BYTES = 1.5e12
LINK_BYTES_PER_S = (100e6, 1e9)  # a modest and a fast link to the hub, for the derivation


def child(method: str, endpoint: str, home: str) -> None:
    """From an empty HF_HOME to one image's features; prints its timings."""
    started = time.perf_counter()
    from huggingface_hub import snapshot_download

    from kimi_encoder.encoder import VisionEncoder
    from kimi_encoder.hub import Hub, HubRef, fetch
    from kimi_encoder.weights import INDEX_FILE, index_vision_shards

    from .inputs import image

    imported = time.perf_counter()
    if method == "range fetch":
        path = fetch(HubRef.parse(f"hf://{REPO}"), Hub(endpoint=endpoint)).path
    else:
        index = snapshot_download(REPO, allow_patterns=[INDEX_FILE], endpoint=endpoint)
        shards = index_vision_shards(json.loads(Path(index, INDEX_FILE).read_text()), INDEX_FILE)
        patterns = ["config.json", "preprocessor_config.json", INDEX_FILE, *shards]
        path = snapshot_download(REPO, allow_patterns=patterns, endpoint=endpoint)
    fetched = time.perf_counter()
    encoder = VisionEncoder.from_pretrained(
        path, device="cpu", dtype="float32", backend="cpu", execution="eager"
    )
    encoder.encode([encoder.plan(image(64, 48, seed=0))])
    done = time.perf_counter()
    print(
        json.dumps(
            {
                "download_s": fetched - imported,
                "serving_s": done - imported,
                "imports_s": imported - started,
                "home": home,
            }
        )
    )


def one(method: str, endpoint: str, server) -> dict:
    """One cold start by ``method`` in a fresh process with an empty HF_HOME."""
    with tempfile.TemporaryDirectory() as home:
        before_requests, before_bytes = server.requests(), server.body_bytes()
        env = {
            **os.environ,
            "HF_HOME": home,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "PYTHONPATH": str(ROOT),
        }
        command = [sys.executable, "-m", "benchmarks.bench_hub", "--child", method, endpoint, home]
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{method} failed ({run.returncode}): {run.stderr[-2000:]}")
        out = json.loads(run.stdout.strip().splitlines()[-1])
    out["requests"] = server.requests() - before_requests
    out["bytes"] = server.body_bytes() - before_bytes
    return out


def measured(quick: bool, presets: tuple[str, ...]) -> tuple[str, str]:
    from .loopback_hub import LoopbackHub, write_k3_layout

    repeats = 1 if quick else 3
    rows = []
    for preset in presets:
        with tempfile.TemporaryDirectory() as root, LoopbackHub() as server:
            layout = write_k3_layout(root, preset, seed=0, shards=6, language_ratio=20)
            server.add(REPO, root)
            runs: dict[str, list[dict]] = {m: [] for m in METHODS}
            for _ in range(repeats):  # alternated: a change in the machine's load hits both
                for method in METHODS:
                    runs[method].append(one(method, server.endpoint, server))
        repo_bytes = layout["vision_bytes"] + layout["language_bytes"]
        for method in METHODS:
            r = runs[method]
            rows.append(
                [
                    preset,
                    f"{layout['vision_bytes'] / 1e6:.2f}",
                    f"{repo_bytes / 1e6:.0f}",
                    method,
                    r[-1]["requests"],
                    f"{r[-1]['bytes'] / 1e6:.2f}",
                    spread([x["download_s"] for x in r]).fmt(2),
                    spread([x["serving_s"] for x in r]).fmt(2),
                ]
            )
        ratio_bytes = runs["shards"][-1]["bytes"] / runs["range fetch"][-1]["bytes"]
        ratio_s = spread(
            [
                s["serving_s"] / f["serving_s"]
                for s, f in zip(runs["shards"], runs["range fetch"], strict=True)
            ]
        )
        rows.append(
            [
                preset,
                "",
                "",
                "**shards / range fetch**",
                "",
                f"**{ratio_bytes:.1f}x**",
                "",
                f"**{ratio_s.fmt(2, 'x')}**",
            ]
        )
    header = [
        "preset",
        "vision MB",
        "repository MB",
        "method",
        "requests",
        "MB served",
        "download, s",
        "to first features, s",
    ]
    conditions = (
        f"{repeats} cold start(s) per preset and method, alternated, each in a fresh process "
        "with an empty HF_HOME against the hub on loopback (two local HTTP servers: the hub "
        "and the storage host it redirects large files to). Six shards, the vision tensors in "
        "two of them, the language part 20x the vision part. Requests and MB served: counted "
        "by the servers (last run; the same every run). Download: the fetch or "
        "snapshot_download; to first features: the download, the encoder built from the "
        "directory (eager, float32) and one 64x48 image encoded; imports excluded. Median "
        "(min–max) over the runs."
    )
    return conditions, table(header, rows)


def derived() -> tuple[str, str]:
    vision = K3_VISION_PARAMS * 2  # bfloat16
    shard = K3_REPO_BYTES / K3_SHARDS
    rows = []
    for name, size in (
        ("range fetch (vision tensors only)", vision),
        ("the shards holding vision tensors: one", shard),
        ("the shards holding vision tensors: two", 2 * shard),
        ("the whole repository", K3_REPO_BYTES),
    ):
        seconds = [f"{size / rate:,.0f}" for rate in LINK_BYTES_PER_S]
        rows.append([name, f"{size / 1e9:,.1f}", f"{size / vision:,.0f}x", *seconds])
    header = [
        "what a new node reads",
        "GB",
        "of the range fetch",
        *[f"s at {rate / 1e6:,.0f} MB/s" for rate in LINK_BYTES_PER_S],
    ]
    note = (
        "**Derived, not measured**: Kimi-K3 from public figures (447 M vision tower and "
        "projector parameters in bfloat16, about 0.9 GB; 96 shards, about 1.5 TB, so about "
        "16 GB a shard). The vision tensors lie in one or two shards beside language tensors, "
        "so a loader that filters shards by the index still reads 16–31 GB; the range fetch "
        "reads those tensors and the two shards' headers (a few kB). Seconds at two link "
        "rates to the hub, transfer only."
    )
    return note, table(header, rows)


def sections(quick: bool, presets: tuple[str, ...] = ("tiny", "small")) -> list[Section]:
    conditions, measured_table = measured(quick, presets)
    note, derived_table = derived()
    return [
        Section(
            "Weights from the hub: vision ranges against the vision shards",
            "python -m benchmarks.bench_hub",
            [conditions, measured_table, note, derived_table],
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # method endpoint home
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    return standalone(
        __doc__, lambda a: sections(a.quick, tuple(args.presets)), argv, parser=parser
    )


if __name__ == "__main__":
    sys.exit(main())
