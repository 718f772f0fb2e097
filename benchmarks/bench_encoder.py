"""Encoder throughput: preprocessing (cpu and gpu backends) and the tower.

    python -m benchmarks.bench_encoder [--presets tiny small] [--seconds 3]
    python -m benchmarks.bench_encoder --doc [--quick]

Prints images/s and patches/s for each stage on a fixed, seeded image mix.
With ``--doc``: the docs/benchmarks.md section, our K2.5 tower against
transformers' ``kimi_k25`` tower on the same weights and pixels (when
transformers is installed), alternating the two.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from kimi_encoder.config import PreprocessConfig, VisionConfig, get_preset
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.weights import write_checkpoint

from .common import Section, ratio, spread, table
from .inputs import MODE_MIX, mode_mix
from .page import arguments, standalone


def timed(fn, seconds: float) -> tuple[float, int]:
    """(seconds per call, calls) after one warm-up call, running for about ``seconds``."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls, calls


def interleaved(fa, fb, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds per call of ``fa`` and ``fb`` in each of ``rounds`` rounds, run alternately
    (after one warm-up each), so a burst of load from elsewhere on the machine hits both."""
    fa(), fb()
    times_a, times_b = [], []
    for _ in range(rounds):
        for fn, times in ((fa, times_a), (fb, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return times_a, times_b


def bench_preset(name: str, images: list[bytes], seconds: float) -> list[str]:
    rows = []
    encoders = {
        b: VisionEncoder.from_pretrained(name, device="cpu", backend=b) for b in ("cpu", "gpu")
    }
    items = [encoders["cpu"].plan(data) for data in images]
    patches = sum(item.num_patches for item in items)
    for backend, enc in encoders.items():
        its = [enc.plan(data) for data in images]
        per, _ = timed(lambda enc=enc, its=its: enc.materialize(its), seconds)
        rows.append(_row(name, f"preprocess ({backend} backend)", len(its), patches, per))
    enc = encoders["cpu"]
    pixels = enc.materialize(items)
    per, _ = timed(lambda: enc.forward(pixels, items), seconds)
    rows.append(_row(name, "tower + projector", len(items), patches, per))
    return rows


def bench_transformers(images: list[bytes], rounds: int) -> tuple[list[list], str]:
    """Our K2.5 tower vs transformers' on the same weights (a mid-size K2.5 shape): table
    rows and a note (or why it was skipped)."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from reference_k25 import load_reference, reference_features, write_transformers_config
    except ImportError as exc:
        return [], f"transformers comparison skipped: {exc}"
    vision = VisionConfig.k25(
        hidden_size=384,
        num_layers=6,
        num_heads=6,
        intermediate_size=1536,
        pos_emb_height=64,
        pos_emb_width=64,
        text_hidden_size=1024,
    )
    preprocess = PreprocessConfig(in_patch_limit=4096, patch_limit_on_one_side=128)
    with tempfile.TemporaryDirectory() as tmp:
        root = write_checkpoint(Path(tmp), vision, preprocess, seed=0)
        ours = VisionEncoder.from_pretrained(root, device="cpu", backend="cpu")
        write_transformers_config(root, vision)
        ref, _ = load_reference(root)
    items = [ours.plan(data) for data in images]
    pixels = ours.materialize(items)
    patches = sum(item.num_patches for item in items)
    cat, grids = torch.cat(pixels), torch.cat([item.grid_thws for item in items])
    t_ours, t_ref = interleaved(
        lambda: ours.forward(pixels, items), lambda: reference_features(ref, cat, grids), rounds
    )
    diff = torch.cat(ours.forward(pixels, items)) - torch.cat(reference_features(ref, cat, grids))
    rows = [
        ["tower + projector (ours)", *_rates(len(items), patches, t_ours)],
        ["tower + projector (transformers)", *_rates(len(items), patches, t_ref)],
        ["**ours / transformers throughput**", f"**{ratio(t_ref, t_ours).fmt(2, 'x')}**", "", ""],
    ]
    return rows, f"max abs diff of the features {diff.abs().max().item():.2e}"


def _rates(images: int, patches: int, times: list[float]) -> list[str]:
    return [
        spread([images / t for t in times]).fmt(2),
        spread([patches / t for t in times]).fmt(0),
        spread([t * 1e3 for t in times]).fmt(0),
    ]


def sections(quick: bool) -> list[Section]:
    torch.set_num_threads(1)
    count = 4 if quick else len(MODE_MIX)  # quick: without the 1920x1080 image
    rounds = 3 if quick else 5
    rows, note = bench_transformers(mode_mix()[:count], rounds)
    mix = ", ".join(f"{m} {w}x{h}" for m, (w, h) in MODE_MIX[:count])
    conditions = (
        "k25-mid (K2.5 layout, 6 layers, width 384, seeded weights), one torch thread, the "
        f"batch {mix} in one varlen forward; {rounds} rounds alternating ours and "
        f"transformers' on the same weights and pixels: median (min–max); {note}."
    )
    header = ["stage", "images/s", "patches/s", "ms per batch"]
    return [
        Section(
            "Tower vs transformers (target: >= 1.0x)",
            "python -m benchmarks.bench_encoder --doc",
            [conditions, table(header, rows)],
        )
    ]


def _row(preset: str, stage: str, images: int, patches: int, per_call: float) -> str:
    return (
        f"| {preset} | {stage} | {images / per_call:.1f} img/s | "
        f"{patches / per_call:.0f} patches/s | {per_call * 1e3:.1f} ms/batch |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--doc", action="store_true", help="the docs/benchmarks.md section")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    if args.doc:
        return standalone(__doc__, lambda a: sections(a.quick), argv, parser)
    torch.set_num_threads(args.threads)
    images = mode_mix()
    print(
        f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {args.threads} threads, CPU tensors"
    )
    print(
        f"# image mix ({len(MODE_MIX)} images, one batch): "
        + ", ".join(f"{m} {w}x{h}" for m, (w, h) in MODE_MIX)
    )
    print("| preset | stage | images/s | patches/s | latency |")
    print("|---|---|---|---|---|")
    for name in args.presets:
        get_preset(name)
        for row in bench_preset(name, images, args.seconds):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
