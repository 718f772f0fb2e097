"""Feature bytes at Kimi-K3's width: how fast 7.3 MB-per-image answers leave the server.

    python -m benchmarks.bench_bytes [--quick]

Kimi-K3's projector writes 7168 features per token: a 448x448 image is 256
tokens, 7.3 MB of float32. The compute is kept cheap: a checkpoint with the
tiny tower and ``text_hidden_size`` 7168, written here with the library. dp 2,
4 images per request (JSON requests), 4 closed-loop clients, one torch thread
per rank. Cells:

- cache hits (the same 4 images in every request: no compute; the ingress answers
  them from the features it kept, ``ingress_cache_bytes``) and misses (caches off:
  the tiny tower runs), each with
- the wire dtype float32 (the default) or bfloat16 (request field
  ``feature_dtype``), JSON or safetensors answers, 1 or 2 ingress replicas.

A server without ``feature_dtype`` answers 422 to it; such a cell is reported as
not supported. Next to the hit cells, in the same repeats and with the same request
and response body sizes, three ceilings: a plain loopback HTTP server (stdlib, one
process), a trivial Serve deployment returning the body, that deployment
behind one deployment-handle hop (the inner returns the body as a numpy array),
and behind two hops at once (each returns half the body, as dp 2 asks two ranks);
ours with ``glibc_tunables: ''`` (glibc's malloc defaults, as the ceilings
run), and ours with the ingress cache off (every hit asks its rank). Hits and
misses are two phases, each with only its own apps deployed. ``bench_bytes_haproxy``
runs the hit cells of one ingress replica and the Serve ceilings again behind
Serve's HAProxy ingress.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path

from . import cpu
from .common import Section, alternate, spread, table
from .feature_bytes import (
    CACHE,
    CEILINGS,
    DTYPES,
    FORMATS,
    INGRESS,
    PER_REQUEST,
    RATIOS,
    Cell,
    Measured,
    Settings,
    ceiling_ratio_table,
    cell_text,
    cores_table,
    deploy,
    expected_size,
    inputs,
    loop_of,
    our_setups,
    per_request_table,
    ratio_text,
    request_body,
    sender,
    serve_ceiling_setups,
    size_text,
)
from .page import standalone
from .paths import PlainServer
from .serving import Cluster, Http, server_failed

COMMAND = "python -m benchmarks.bench_bytes"


# Our default glibc_tunables against none, in the cells the ceilings' ratio targets.
UNTUNED = [Cell("hit", dtype, "safetensors", 1, tuned=False) for dtype in DTYPES]


# Hits answered by the ingress from the features it held against hits that ask their rank.
RANKS_ONLY = [Cell("hit", dtype, "safetensors", 1, kept=False) for dtype in DTYPES]


def measure(s: Settings, root: Path) -> Measured:
    """Two phases, each with only its apps deployed: cache hits (ours and the ceilings,
    which are compared with them), then misses; in each, every cell alternated over
    ``s.repeats`` repeats."""
    ckpt, images = inputs(s, root)
    out = Measured()
    with Cluster() as cluster, PlainServer() as plain:
        client = Http(cluster.port)
        for cache in CACHE:
            cells = cells_of(cache)
            apps = deploy(cluster, ckpt, s, cells)
            setups = our_setups(client, images, s, out, cells)
            if cache == "hit":
                setups |= ceiling_setups(client, Http(plain.port), images, s, out)
            out.windows |= alternate(setups, s.repeats, rerun_if=server_failed)
            for app in apps:
                cluster.delete(app)
    return out


def cells_of(cache: str) -> list[Cell]:
    """The cells of the hits or the misses phase (behind Serve's proxy)."""
    cells = [Cell(cache, *c) for c in itertools.product(DTYPES, FORMATS, INGRESS)]
    return cells + (UNTUNED + RANKS_ONLY if cache == "hit" else [])


def ceiling_setups(
    client: Http, plain: Http, images: list[bytes], s: Settings, out: Measured
) -> dict:
    """A closed loop per ceiling and answer size (sizes our server did not answer with
    are computed from its float32 answers)."""
    from kimi_encoder.config import get_preset

    tiny = get_preset("tiny").vision
    tokens = (s.side // tiny.patch_size) ** 2 // tiny.merge_area
    item_bytes = tokens * s.width * 4  # float32 features of one image
    setups = {}
    for dtype, fmt in itertools.product(DTYPES, FORMATS):
        if (dtype, fmt) not in out.body_bytes:
            f32 = out.body_bytes[("float32", fmt)]
            out.body_bytes[(dtype, fmt)] = expected_size(f32, fmt, item_bytes, len(images), dtype)
            out.expected.add((dtype, fmt))
        size = out.body_bytes[(dtype, fmt)]
        send = sender(plain, f"/{size}", request_body(images, fmt, dtype), len(images))
        setups[(CEILINGS[0], dtype, fmt)] = loop_of(send, s)
    return setups | serve_ceiling_setups(client, images, s, out)


# --- sections -------------------------------------------------------------------------


def sections(quick: bool, s: Settings | None = None) -> list[Section]:
    s = s or Settings.of(quick)
    with tempfile.TemporaryDirectory() as tmp:
        m = measure(s, Path(tmp))
    return [throughput_section(m, s), ceilings_section(m, s)]


def throughput_section(m: Measured, s: Settings) -> Section:
    rows = []
    for cache in CACHE:
        for dtype in DTYPES:
            for fmt in FORMATS:
                one, two = Cell(cache, dtype, fmt, 1), Cell(cache, dtype, fmt, 2)
                rows.append(
                    [
                        cache,
                        dtype,
                        fmt,
                        size_text(m, dtype, fmt),
                        cell_text(m, one, "MB"),
                        cell_text(m, one, "images"),
                        cell_text(m, two, "MB"),
                        cell_text(m, two, "images"),
                        ratio_text(m, two, one),
                    ]
                )
    header = [
        "cache",
        "wire dtype",
        "answer",
        "MB per answer",
        "1 ingress: MB/s",
        "images/s",
        "2 ingress: MB/s",
        "images/s",
        "2 ingress / 1",
    ]
    ratios = [
        [
            cache,
            ingress,
            *(
                ratio_text(m, Cell(cache, *a, ingress), Cell(cache, *b, ingress))
                for _, a, b in RATIOS
            ),
        ]
        for cache in CACHE
        for ingress in INGRESS
    ]
    ratio_header = ["cache", "ingress", *(label for label, _, _ in RATIOS)]
    return Section(
        f"Feature bytes at K3 width {s.width}",
        COMMAND,
        [
            conditions(m, s),
            table(header, rows),
            table(ratio_header, ratios),
            CPU_NOTE,
            cpu_table(m, s),
        ],
    )


CPU_NOTE = (
    "Where the CPU went in the safetensors cells on cache hits, 1 and 2 ingress replicas: "
    "cores busy on average over each window (CPU seconds / wall seconds, median of the "
    "repeats), by process. When the machine is busy on every core with one ingress "
    "replica, a second one has no core to run on and can only share them; it adds "
    "throughput where the single replica's own core is the limit, as on a GPU node whose "
    "ranks' work is on the GPUs."
)


def cpu_table(m: Measured, s: Settings) -> str:
    """Cores busy by process (``cpu.labeller``) in the safetensors hit cells."""
    cells = [Cell("hit", dtype, "safetensors", ingress) for dtype in DTYPES for ingress in INGRESS]
    ranks = [f"rank {r}" for r in range(s.dp)]
    names = [cpu.INGRESS, *ranks, *cpu.AROUND[1:]]
    return cores_table(m, cells, names, lambda c: f"{c.dtype}, {c.ingress} ingress")


def ceilings_section(m: Measured, s: Settings) -> Section:
    one_hop, two_hops = CEILINGS[2], CEILINGS[3]
    rows = []
    for dtype in DTYPES:
        for fmt in FORMATS:
            mbs = [m.mb_per_s((c, dtype, fmt)) for c in CEILINGS]
            rows.append(
                [
                    f"{dtype} {fmt}",
                    size_text(m, dtype, fmt),
                    *[x.fmt(0) for x in mbs],
                    *(
                        ratio_text(m, Cell("hit", dtype, fmt, ingress), (hop, dtype, fmt))
                        for hop in (one_hop, two_hops)
                        for ingress in INGRESS
                    ),
                    ratio_text(m, (two_hops, dtype, fmt), (one_hop, dtype, fmt)),
                ]
            )
    header = [
        "answer body",
        "MB",
        *(f"{c}: MB/s" for c in CEILINGS),
        *(
            f"ours (hits, {ingress} ingress) / {hop}"
            for hop in (one_hop, two_hops)
            for ingress in INGRESS
        ),
        f"{two_hops} / {one_hop}",
    ]
    return Section(
        "Feature bytes: ceilings",
        COMMAND,
        [
            "The same clients, request bodies and answer sizes as the section above, "
            "measured in the same repeats. Plain HTTP: a stdlib `ThreadingHTTPServer` in a "
            "process of its own. Serve: a deployment that reads the request and answers "
            "prepared bytes. Serve + 1 hop: that deployment asks an inner deployment for "
            "the body as a numpy array (through the object store) and answers its bytes. "
            "Serve + 2 hops: it asks for each half of the body in a call of its own, both "
            "at once, and joins them, as our ingress asks its two ranks (dp 2) and joins "
            "their arrays; nothing else of ours (no request parsing, no hashing, no "
            "assignment).",
            table(header, rows),
            CEILING_RATIOS,
            ceiling_ratio_table(m),
            PER_REQUEST.format(proxy="Serve's proxy"),
            per_request_table(m),
            RANKS,
            ranks_table(m),
            TUNED,
            tuned_table(m),
            COPIES,
            table(["where", "full-size copies of the features", "code"], COPY_ROWS),
        ],
    )


CEILING_RATIOS = (
    "The ratios of the section above, ours next to the same ratios of the ceilings' "
    "images/s (each request stands for the same 4 images): what Serve itself allows "
    "when the answer's size is all that changes."
)


RANKS = (
    "Our hits are answered by the ingress from the ranks' answers it held, as it read "
    "them in place from the object store (`ingress_cache_bytes`, 256 MiB here; off by "
    "default): no rank call. "
    "Ours with it off, every hit asking the rank that holds it, in the same repeats:"
)


def ranks_table(m: Measured) -> str:
    header = ["ingress cache: MB/s", "rank calls: MB/s", "ingress cache / rank calls"]
    header += ["rank calls / Serve + 1 hop", "rank calls: CPU-ms per request"]
    return against_default(m, RANKS_ONLY, header, cpu_ms=True)


def against_default(m: Measured, cells: list[Cell], header: list[str], cpu_ms=False) -> str:
    """Each of ``cells`` (ours with one setting off) next to the same cell with every
    setting at the benchmark's default: MB/s of both, their ratio, the cell against
    Serve + 1 hop and, with ``cpu_ms``, the cell's CPU-ms per request."""
    rows = []
    for cell in cells:
        default = Cell(cell.cache, cell.dtype, cell.fmt, cell.ingress)
        hop = (CEILINGS[2], cell.dtype, cell.fmt)
        row = [f"{cell.dtype} {cell.fmt}", cell_text(m, default, "MB"), cell_text(m, cell, "MB")]
        row += [ratio_text(m, default, cell), ratio_text(m, cell, hop)]
        if cpu_ms:
            row.append(spread([cpu.request_cpu_ms(w, cell.app) for w in m.windows[cell]]).fmt(1))
        rows.append(row)
    return table(["answer body (hits, 1 ingress)", *header], rows)


TUNED = (
    "Our replicas run with `glibc_tunables` (default "
    "`glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=268435456`: malloc keeps large "
    "blocks in its heaps, so an answer body reuses pages already mapped) in their "
    "environment; the ceilings' deployments and Serve's "
    "proxy run with the cluster's (glibc's defaults). Ours with `glibc_tunables: ''`, in "
    "the same repeats:"
)


def tuned_table(m: Measured) -> str:
    header = ["default tunables: MB/s", "none: MB/s", "default / none", "none / Serve + 1 hop"]
    return against_default(m, UNTUNED, header)


COPIES = (
    "Full-size copies of an answer's features from the rank's forward to the socket, "
    "counted from the code (the ceilings above pay the Ray and proxy rows too; the plain "
    "HTTP server pays only the last):"
)


COPY_ROWS = [
    [
        "rank: leave the device",
        "1 per image, cast to the wire dtype on the device first (no host upcast)",
        "`deployments/batcher.py` `_copy_stage`",
    ],
    [
        "rank: into Ray's object store",
        "cache on: 1 per image when it is encoded (the cache keeps the object-store ref; a "
        "hit copies nothing); cache off: 1 (Ray writes the call's answer into one object)",
        "`deployments/stored.py` `StoredFeatures`",
    ],
    [
        "rank → ingress",
        "0: the ingress reads each array in place (a hit it kept: read in place, no call)",
        "`deployments/handles.py` `_read_stored`",
    ],
    [
        "ingress: the body",
        "safetensors 1 (header and slices joined once); JSON 1 base64 (4/3 the size) and 1 join",
        "`deployments/wire.py`",
    ],
    [
        "ingress → proxy → socket",
        "2 or more: the replica pickles each ASGI message (`pickle.dumps`) for the proxy, "
        "Ray carries it, the proxy unpickles it and writes the socket",
        "Ray Serve (`ray/serve/_private/replica.py`)",
    ],
]


def conditions(m: Measured, s: Settings) -> str:
    return (
        f"Tiny tower, projector width {s.width}; {s.side}x{s.side} images; dp {s.dp}, one "
        f"torch thread per rank; {s.images_per_request} images per request (JSON request "
        f"of {m.request_bytes / 1e6:.1f} MB), {s.clients} closed-loop clients; hits: the "
        "same images in every request, answered by the ingress from the features it kept "
        "(`ingress_cache_bytes` 256 MiB), misses: caches off. "
        "Two phases, each with only its own apps deployed (idle apps cost CPU): hits, "
        "with the ceilings of the next section, then misses; the hits behind HAProxy are "
        "a run of their own (`bench_bytes_haproxy`). "
        f"{s.repeats} repeats alternating every cell of a phase, {s.window_s:g} s windows; "
        "median (min–max); a ratio is the median of the per-repeat ratios."
    )


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
