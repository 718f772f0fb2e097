"""Do two runs agree? Every ratio of one benchmarks page against the same one of another.

    python -m benchmarks.compare first.md second.md [--all]
    python -m benchmarks.compare --chance REPEATS [--figures N]

A ratio is a table cell printed as ``median (min–max)`` with an ``x``, or in a
column or row named ``a / b`` (``dp 2 / dp 1``, ``makespan / bound``). Two runs
agree on a figure when their min–max ranges share a value: neither run's spread
rules out the other's. ``--all`` compares every ``median (min–max)`` cell, rates
included. Exit status 1 when any disagree.

The stricter check, each median inside the other run's range, is printed too but
does not decide: it fails by chance alone. With every repeat drawn from one and
the same distribution, a median of 3 repeats lies in another run's 3-repeat
range with probability about 0.6, both ways about 0.4, so 69 figures would all
pass in fewer than one pair of runs in 10^27 on a perfectly steady machine; ranges
overlap with probability 0.90 at 3 repeats, 0.992 at 5 and 0.9994 at 7.
``--chance`` prints these probabilities (simulated) for a number of repeats.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from .common import Spread

CELL = re.compile(r"^\**([-\d.]+)(x?) \(([-\d.]+)–([-\d.]+)\)\**$")
RATIO = re.compile(r" / |speed-up", re.IGNORECASE)


def figures(markdown: str, every: bool = False) -> dict[str, Spread]:
    """``section | row | column`` -> the cell's median and min–max (as a three-value spread)."""
    out: dict[str, Spread] = {}
    section, header = "", []
    for line in markdown.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            continue
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = cells
            continue
        if set(line) <= set("|-"):
            continue
        row = " · ".join(c for c in cells[:3] if not CELL.match(c))
        for i, (column, cell) in enumerate(zip(header, cells, strict=False)):
            match = CELL.match(cell)
            if not match:
                continue
            is_ratio = match.group(2) == "x" or RATIO.search(column) or RATIO.search(cells[0])
            if every or is_ratio:
                median, lo, hi = (float(match.group(k)) for k in (1, 3, 4))
                out[f"{section} | {row} | {i}: {column}"] = Spread((lo, median, hi))
    return out


def compare(first: str, second: str, every: bool = False) -> list[tuple[str, Spread, Spread]]:
    """The figures both pages have, each with its two spreads."""
    a, b = figures(first, every), figures(second, every)
    return [(key, a[key], b[key]) for key in a if key in b]


def chance(repeats: int, trials: int = 200_000, seed: int = 0) -> tuple[float, float]:
    """(ranges overlap, each median in the other's range): how often two runs of
    ``repeats`` draws from one distribution pass each check, simulated."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((2, trials, repeats))
    (alo, ahi, amed), (blo, bhi, bmed) = ((x.min(1), x.max(1), np.median(x, 1)) for x in (a, b))
    overlap = (alo <= bhi) & (blo <= ahi)
    medians = (alo <= bmed) & (bmed <= ahi) & (blo <= amed) & (amed <= bhi)
    return float(overlap.mean()), float(medians.mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path, nargs="?")
    parser.add_argument("second", type=Path, nargs="?")
    parser.add_argument("--all", action="store_true", help="every median (min–max) cell")
    parser.add_argument("--chance", type=int, metavar="REPEATS", help="simulate the checks")
    parser.add_argument("--figures", type=int, default=69, help="figures per page (--chance)")
    args = parser.parse_args(argv)
    if args.chance:
        overlap, medians = chance(args.chance)
        n = args.figures
        print(
            f"{args.chance} repeats, same distribution: ranges overlap {overlap:.4f} per "
            f"figure ({overlap**n:.2g} for all {n}); medians inside {medians:.4f} "
            f"({medians**n:.2g} for all {n})"
        )
        return 0
    if args.first is None or args.second is None:
        parser.error("give two pages to compare, or --chance REPEATS.")
    pairs = compare(args.first.read_text(), args.second.read_text(), args.all)
    bad = strict = 0
    for key, a, b in pairs:
        ok = a.overlaps(b)
        bad += not ok
        inside = a.holds_median_of(b)
        strict += inside
        mark = "agree   " if ok else "DISAGREE"
        note = "" if inside else "  (a median outside the other's range)"
        print(
            f"{mark} {key}: {a.median:g} ({a.lo:g}–{a.hi:g}) vs {b.median:g} "
            f"({b.lo:g}–{b.hi:g}){note}"
        )
    print(
        f"{len(pairs) - bad} of {len(pairs)} figures agree (ranges overlap); "
        f"{strict} of {len(pairs)} also have each median inside the other's range"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
