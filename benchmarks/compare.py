"""Do two runs agree? Every ratio of one benchmarks page against the same one of another.

    python -m benchmarks.compare first.md second.md [--all]

A ratio is a table cell printed as ``median (min–max)`` with an ``x``, or in a
column or row named ``a / b`` (``dp 2 / dp 1``, ``makespan / bound``); two runs
agree on it when each median lies within the other run's min–max. ``--all`` compares every
``median (min–max)`` cell, rates included. Exit status 1 when any disagree.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--all", action="store_true", help="every median (min–max) cell")
    args = parser.parse_args(argv)
    pairs = compare(args.first.read_text(), args.second.read_text(), args.all)
    bad = 0
    for key, a, b in pairs:
        ok = a.overlaps(b)
        bad += not ok
        mark = "agree   " if ok else "DISAGREE"
        print(f"{mark} {key}: {a.median:g} ({a.lo:g}–{a.hi:g}) vs {b.median:g} ({b.lo:g}–{b.hi:g})")
    print(f"{len(pairs) - bad} of {len(pairs)} figures agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
