"""Shared pieces of the benchmarks: the run header, repeats and their spread, markdown.

Every figure that compares setups is measured as repeats that alternate the
setups (A B A B ...), so a burst of load from elsewhere on the machine falls
on all of them; a ratio is the median of the per-repeat ratios, printed with
their min–max. A run records the commit (and refuses a dirty tree unless
``--allow-dirty``, which marks the output), the CPU, the core count and the
load average before and after.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "benchmarks"

T = TypeVar("T")


# --- the run header -------------------------------------------------------------------


class DirtyTreeError(RuntimeError):
    """The checkout has uncommitted changes to tracked files."""


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def fmt_load(load: Sequence[float]) -> str:
    return "/".join(f"{v:.2f}" for v in load)


@dataclass
class Run:
    """What one benchmark run was measured on; ``start`` refuses a dirty tree."""

    quick: bool
    commit: str
    dirty: bool
    cpu: str
    cores: int
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float] | None = None
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, quick: bool, allow_dirty: bool, root: Path = ROOT) -> Run:
        # The benchmarks' own outputs (this page and its plots) do not make a tree dirty.
        outputs = [":!docs/benchmarks.md", ":!docs/benchmarks"]
        changed = git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", *outputs, cwd=root
        )
        if changed and not allow_dirty:
            raise DirtyTreeError(
                "the checkout has uncommitted changes to tracked files:\n"
                f"{changed}\n"
                "figures must name the commit they were measured on: commit first, or pass "
                "--allow-dirty (the output is then marked dirty)."
            )
        return cls(
            quick=quick,
            commit=git("rev-parse", "--short", "HEAD", cwd=root),
            dirty=bool(changed),
            cpu=cpu_name(),
            cores=os.cpu_count() or 1,
            load_before=load_average(),
        )

    def finish(self) -> None:
        self.load_after = load_average()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def header(self) -> str:
        """The run's markdown header lines (call ``finish`` first)."""
        commit = f"{self.commit} **(dirty: uncommitted changes)**" if self.dirty else self.commit
        mode = "**quick** (`--quick`: short windows, noisy)" if self.quick else "full"
        after = fmt_load(self.load_after) if self.load_after else "n/a"
        return (
            f"- commit {commit}; run: {mode}; {self.seconds:.0f} s\n"
            f"- machine: {self.cpu}, {self.cores} cores; torch {torch.__version__} (CPU), "
            f"Python {platform.python_version()}\n"
            f"- load average (1/5/15 min) before {fmt_load(self.load_before)}, after {after}"
        )


# --- repeats and their spread ---------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one figure: the median and the min–max."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        """``1.83x (1.79–1.88)``: the median, then the min–max."""
        return f"{self.median:.{digits}f}{unit} ({self.lo:.{digits}f}–{self.hi:.{digits}f})"

    def overlaps(self, other: Spread) -> bool:
        """Whether the two min–max ranges share a value (the runs agree within their spreads)."""
        return self.lo <= other.hi and other.lo <= self.hi

    def holds_median_of(self, other: Spread) -> bool:
        """Whether each median lies within the other's min–max (the stricter check)."""
        return self.lo <= other.median <= self.hi and other.lo <= self.median <= other.hi


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("a spread needs at least one value, got none.")
    return Spread(tuple(float(v) for v in values))


def line_through(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(value at x = 0, slope) of the line through the two points (x[0], y[0]), (x[1], y[1])."""
    slope = (y[0] - y[1]) / (x[0] - x[1])
    return y[1] - slope * x[1], slope


def ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """Per-repeat ratios of two setups measured in the same repeats."""
    return spread([a / b for a, b in zip(numerator, denominator, strict=True)])


# Windows measured again after a failure ``alternate`` was told to survive, as
# "setup, repeat k: error"; ``with_load`` moves them onto the page, under their section.
RERUNS: list[str] = []


def alternate(
    setups: Mapping[str, Callable[[], T]],
    repeats: int,
    rerun_if: Callable[[BaseException], bool] = lambda exc: False,
) -> dict[str, list[T]]:
    """Run every setup once per repeat, in the same order each time (A B C A B C ...).

    A window that fails with an error ``rerun_if`` accepts (a served window whose
    replica died under it, say) is measured once more and noted in ``RERUNS``; a
    second failure of the same window is raised.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    out: dict[str, list[T]] = {name: [] for name in setups}
    for repeat in range(repeats):
        for name, measure in setups.items():
            try:
                value = measure()
            except Exception as exc:
                if not rerun_if(exc):
                    raise
                RERUNS.append(f"{name}, repeat {repeat + 1}: {type(exc).__name__}: {exc}")
                value = measure()
            out[name].append(value)
    return out


# --- markdown -------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Section:
    """One section of docs/benchmarks.md: its title, the command that re-runs it alone,
    and its paragraphs and tables in order."""

    title: str
    command: str
    parts: list[str]
    load: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # before, after

    def markdown(self, number: int | None = None) -> str:
        title = f"{number}. {self.title}" if number is not None else self.title
        lines = [f"## {title}", "", f"Re-run alone: `{self.command}`"]
        if self.load:
            before, after = self.load
            lines[-1] += f" (load average before {fmt_load(before)}, after {fmt_load(after)})"
        lines.append("")
        for part in self.parts:
            lines += [part, ""]
        return "\n".join(lines)


def with_load(make: Callable[[], list[Section]]) -> list[Section]:
    """``make()``'s sections, each carrying the load average before and after it."""
    before = load_average()
    del RERUNS[:]
    sections = make()
    after = load_average()
    for section in sections:
        section.load = (before, after)
    if RERUNS and sections:
        reruns = "; ".join(RERUNS)
        sections[0].parts.append(
            f"Windows measured again after the server failed under them (once each; their "
            f"first try is not counted): {reruns}."
        )
    del RERUNS[:]
    return sections


def document(run: Run, sections: Sequence[Section], intro: str) -> str:
    parts = ["# Benchmarks", "", intro, "", run.header(), ""]
    parts += [s.markdown(i) for i, s in enumerate(sections, 1)]
    return "\n".join(parts)


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark takes."""
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short runs, noisy")
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run on a checkout with uncommitted changes (the output says so)",
    )
    return parser


def standalone(
    doc: str,
    make: Callable[[argparse.Namespace], list[Section]],
    argv: list[str] | None = None,
    parser: argparse.ArgumentParser | None = None,
) -> int:
    """``python -m benchmarks.bench_X [--quick]``: run its sections and print their markdown."""
    args = (parser or arguments(doc)).parse_args(argv)
    try:
        run = Run.start(args.quick, args.allow_dirty)
    except DirtyTreeError as exc:
        print(exc, file=sys.stderr)
        return 2
    sections = with_load(lambda: make(args))
    run.finish()
    print(run.header() + "\n")
    for section in sections:
        print(section.markdown())
    return 0


# --- inputs and plots -----------------------------------------------------------------


def image(width: int, height: int, seed: int) -> bytes:
    """A seeded PNG photo-like image (gradients plus noise)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // max(width, 1), yy * 255 // max(height, 1), (xx + yy) % 256], -1)
    noisy = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(noisy, "RGB").save(out, "PNG")
    return out.getvalue()


def jpeg(side: int, seed: int) -> bytes:
    """A seeded square photo-like image as a JPEG (quality 90), as clients send photos."""
    out = io.BytesIO()
    Image.open(io.BytesIO(image(side, side, seed))).save(out, "JPEG", quality=90)
    return out.getvalue()


# A fixed mix for the tower: photo-like RGB of several sizes, one RGBA, one palette image.
MODE_MIX = [
    ("RGB", (640, 480)),
    ("RGB", (1024, 768)),
    ("RGB", (320, 240)),
    ("RGBA", (500, 500)),
    ("P", (400, 300)),
    ("RGB", (1920, 1080)),
    ("L", (256, 256)),
    ("RGB", (800, 200)),
]


def mode_mix(seed: int = 0) -> list[bytes]:
    """``MODE_MIX`` as seeded PNGs."""
    rng = np.random.default_rng(seed)
    out = []
    for mode, (w, h) in MODE_MIX:
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) % 256, 255 - xx * 255 // w], -1)
        noisy = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
        img = Image.fromarray(noisy, "RGBA")
        img = img if mode == "RGBA" else img.convert("RGB")
        if mode == "P":
            img = img.quantize(64)
        elif mode == "L":
            img = img.convert("L")
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


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
