"""The hand-off app's CPU line: windows of a feature path (``paths``) with the CPU of every
process, and the line through small and large parts (or requests) every image cached:
CPU-ms per part whatever its size, plus CPU-ms per MB of features, fitted per repeat.
``bench_handoff --only cpu`` draws it for sglang parts and vLLM files, ``bench_push`` for
vLLM files and pushes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from . import cpu
from .common import line_through, spread, table
from .paths import HANDOFF_APP, SIDE, Sink, part_images, warm_up
from .serving import Http

# The two part sizes of the CPU line: 2 JPEGs of this side each (256 and 1024 tokens).
SIDES = {"small": 448, "large": SIDE}


@dataclasses.dataclass
class Run:
    """One window of a path: feature MB/s, parts (messages) per second, how many, and
    where the CPU went meanwhile."""

    mb_per_s: float
    per_s: float
    count: int
    usage: cpu.Usage
    app: str = HANDOFF_APP  # whose replicas are the ingress and ranks of this path

    def cpu_ms(self, label: str | None = None) -> float:
        """CPU-ms per part of one process label (``cpu.labeller``), or of all ours."""
        labels = self.usage.grouped(cpu.labeller(self.app))
        seconds = self.usage.ours_s if label is None else labels.get(label, 0.0)
        return seconds * 1e3 / max(self.count, 1)


def with_cpu(run, app: str = HANDOFF_APP) -> Run:
    """``run()`` -> (MB/s, per second, count), with the CPU of every process around it."""
    before = cpu.snapshot()
    mb, rate, count = run()
    return Run(mb, rate, count, cpu.usage(before, cpu.snapshot()), app)


def warmed_parts(client: Http, prefix: str, sink: Sink) -> dict[str, list[list[bytes]]]:
    """The line's parts of each size in ``SIDES``, every one sent once on both of
    ``paths.warm_up``'s paths: the ranks' caches hold all their images afterwards."""
    parts = {size: part_images(side) for size, side in SIDES.items()}
    for images in parts.values():
        warm_up(client, prefix, sink, images)
    return parts


def line_table(
    measured: dict[tuple[str, str], list[Run]], paths: Sequence[str], unit: str, digits: int
) -> str:
    """Per path and process: MB per ``unit`` (part, request) of each size, CPU-ms per
    ``unit`` of each size, and the line through them (each repeat's two cells): at 0 MB,
    and per MB. CPU-ms with ``digits`` decimals, CPU-ms per MB with one more."""
    rows = []
    for path in paths:
        small, large = measured[(path, "small")], measured[(path, "large")]
        mb = [[r.mb_per_s / r.per_s for r in runs] for runs in (small, large)]
        for label in (cpu.INGRESS, None):
            ms = [[r.cpu_ms(label) for r in runs] for runs in (small, large)]
            fits = [
                line_through([mb_s, mb_l], [ms_s, ms_l])
                for mb_s, mb_l, ms_s, ms_l in zip(*mb, *ms, strict=True)
            ]
            rows.append(
                [
                    path,
                    label or "all of ours",
                    *(spread(m).fmt(1) for m in mb),
                    *(spread(m).fmt(digits) for m in ms),
                    spread([at_zero for at_zero, _ in fits]).fmt(digits),
                    f"**{spread([per_mb for _, per_mb in fits]).fmt(digits + 1)}**",
                ]
            )
    header = ["path", "CPU of", f"MB per {unit}: small", "large", f"CPU-ms per {unit}: small"]
    header += ["large", f"fitted: CPU-ms per {unit}", "+ CPU-ms per MB"]
    return table(header, rows)
