"""Feature bytes behind Serve's HAProxy ingress: ours and Serve's ceilings, side by side.

    python -m benchmarks.bench_bytes_haproxy [--quick]

The hit cells of ``bench_bytes`` with one ingress replica (every wire dtype and
format) and its three Serve ceilings, in a cluster of their own started with
``RAY_SERVE_ENABLE_HA_PROXY=1`` (README, "High-throughput ingress"): HAProxy
forwards each request to an HTTP server inside the ingress replica, which writes
its answer to the socket; no Python proxy, no pickled answer. The same settings
and request bodies as ``bench_bytes``; the ceilings answer bodies of the sizes
ours answered. Every cell alternated over the repeats.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path

from . import cpu
from . import feature_bytes as fb
from .common import Section, alternate, table
from .page import standalone
from .serving import INGRESSES, Server, server_failed

COMMAND = "python -m benchmarks.bench_bytes_haproxy"


# The hit cells of one ingress replica, behind HAProxy.
BEHIND_HAPROXY = [
    fb.Cell("hit", dtype, fmt, 1, haproxy=True)
    for dtype, fmt in itertools.product(fb.DTYPES, fb.FORMATS)
]


def measure(s: fb.Settings, root: Path) -> fb.Measured:
    """Ours (hits, one ingress replica, every dtype and format) and the Serve ceilings in a
    cluster behind HAProxy, every cell alternated over ``s.repeats`` repeats."""
    ckpt, images = fb.inputs(s, root)
    out = fb.Measured()
    haproxy = INGRESSES[fb.HAPROXY]
    with Server(haproxy, fb.deploy, (ckpt, s, BEHIND_HAPROXY), logical_cpus=16) as ha:
        setups = fb.our_setups(ha.client, images, s, out, BEHIND_HAPROXY)
        setups |= fb.serve_ceiling_setups(ha.client, images, s, out, front=(fb.HAPROXY,))
        out.windows |= alternate(setups, s.repeats, rerun_if=server_failed)
    return out


def sections(quick: bool, s: fb.Settings | None = None) -> list[Section]:
    s = s or fb.Settings.of(quick)
    with tempfile.TemporaryDirectory() as tmp:
        m = measure(s, Path(tmp))
    return [haproxy_section(m, s)]


def haproxy_section(m: fb.Measured, s: fb.Settings) -> Section:
    hops = fb.CEILINGS[2:]
    rows = []
    for dtype, fmt in itertools.product(fb.DTYPES, fb.FORMATS):
        ours = fb.Cell("hit", dtype, fmt, 1, haproxy=True)
        rows.append(
            [
                f"{dtype} {fmt}",
                fb.size_text(m, dtype, fmt),
                fb.cell_text(m, ours, "MB"),
                fb.cell_text(m, ours, "images"),
                *(m.mb_per_s((fb.HAPROXY, c, dtype, fmt)).fmt(0) for c in fb.CEILINGS[1:]),
                *(fb.ratio_text(m, ours, (fb.HAPROXY, hop, dtype, fmt)) for hop in hops),
            ]
        )
    header = [
        "answer body",
        "MB",
        "ours: MB/s",
        "images/s",
        *(f"{c}: MB/s" for c in fb.CEILINGS[1:]),
        *(f"ours / {hop}" for hop in hops),
    ]
    return Section(
        "Feature bytes behind HAProxy",
        COMMAND,
        [
            "The hit cells of one ingress replica and the three Serve ceilings again, in a "
            "cluster of their own started with `RAY_SERVE_ENABLE_HA_PROXY=1` (README, "
            '"High-throughput ingress"): HAProxy forwards each request to an HTTP server '
            "inside the replica, which writes its answer to the socket; no Python proxy, no "
            "pickled answer. Same settings, request bodies and answer sizes as the two "
            f"sections above; a run of its own after them, {s.repeats} repeats "
            "alternating its cells. The plain HTTP server has no Serve ingress: its figures "
            "are in the section above.",
            table(header, rows),
            "The issue's ratios of images/s behind HAProxy, ours next to the ceilings':",
            fb.ceiling_ratio_table(m, haproxy=True),
            "Cores busy by process in ours' safetensors cells (CPU seconds / wall seconds, "
            "median of the repeats):",
            haproxy_cpu_table(m, s),
            fb.PER_REQUEST.format(proxy="HAProxy"),
            fb.per_request_table(m, haproxy=True),
        ],
    )


def haproxy_cpu_table(m: fb.Measured, s: fb.Settings) -> str:
    cells = [c for c in BEHIND_HAPROXY if c.fmt == "safetensors"]
    names = [cpu.INGRESS, *(f"rank {r}" for r in range(s.dp)), cpu.HAPROXY, cpu.CLIENT]
    return fb.cores_table(m, cells, names, lambda c: f"{c.dtype}, {c.fmt}")


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
