"""The page ``make bench`` writes, and the command line of every benchmark.

A run records the commit (and refuses a dirty tree unless ``--allow-dirty``,
which marks the output), the CPU, the core count and the load average before and
after; each section carries the load average around it. ``standalone`` is what
``python -m benchmarks.bench_X`` runs: that module's sections, printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkout import ROOT
from .common import RERUNS, Section, fmt_load

FIGURES = ROOT / "docs" / "benchmarks"


# --- the run header --------------------------------------------------------------------


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


# --- the page -------------------------------------------------------------------------


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


# --- plots ----------------------------------------------------------------------------


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
