"""Shared pieces of the benchmarks: conditions line, image mixes, tables, plots."""

from __future__ import annotations

import argparse
import io
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "benchmarks"


def commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return f"{sha}{'+dirty' if dirty else ''}" or "unknown"
    except OSError:
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} (CPU)"


def conditions(preset: str, mix: str, dp: str, quick: bool) -> str:
    """The line every figure carries."""
    mode = "QUICK run (--quick: short, noisy)" if quick else "full run"
    return (
        f"hardware: {hardware()}; preset: {preset}; image mix: {mix}; dp: {dp}; "
        f"commit {commit()}; {mode}"
    )


def image(width: int, height: int, seed: int) -> bytes:
    """A seeded PNG photo-like image (gradients plus noise)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // max(width, 1), yy * 255 // max(height, 1), (xx + yy) % 256], -1)
    noisy = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(noisy, "RGB").save(out, "PNG")
    return out.getvalue()


def side_for_patches(patches: int, patch: int = 14) -> int:
    """Pixel side of a square image whose grid has about ``patches`` patches."""
    return round(patches**0.5) * patch


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save_plot(fig, name: str) -> str:
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return f"benchmarks/{name}"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def standalone(doc: str, run, header: list[str], argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench_X [--quick]``: run one section and print its table."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    note, rows = run(args.quick)
    print(note)
    print(table(header, rows))
    return 0
