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
misses are two phases, each with only its own apps deployed. A third phase runs
the hit cells of one ingress replica and the Serve ceilings again in a cluster
behind Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``, README "High-throughput
ingress"), where answers reach the socket with no Python proxy.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import http.server
import itertools
import json
import multiprocessing as mp
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import bench_ingress, bench_serve, cpu
from .common import (
    Section,
    Spread,
    alternate,
    image,
    line_through,
    ratio,
    spread,
    standalone,
    table,
)
from .serving import (
    Cluster,
    Http,
    HttpError,
    Window,
    app_args,
    closed_loop,
    free_port,
    server_failed,
)

DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2)}
FORMATS = ("json", "safetensors")
CACHE = ("hit", "miss")
INGRESS = (1, 2)
CEILINGS = ("plain HTTP", "Serve", "Serve + 1 hop", "Serve + 2 hops")
# The Serve app each ceiling runs in (``ceiling_apps``): whose replicas its CPU is.
CEILING_APPS = {CEILINGS[1]: "echo", CEILINGS[2]: "hop", CEILINGS[3]: "hop"}
OURS = "ours (hits, 1 ingress)"
COMMAND = "python -m benchmarks.bench_bytes"
# The ratios of images/s: (label, (dtype, format) over (dtype, format)).
RATIOS = (
    ("bf16 / f32 images/s, JSON", ("bfloat16", "json"), ("float32", "json")),
    ("bf16 / f32, safetensors", ("bfloat16", "safetensors"), ("float32", "safetensors")),
    ("JSON / safetensors, f32", ("float32", "json"), ("float32", "safetensors")),
    ("JSON / safetensors, bf16", ("bfloat16", "json"), ("bfloat16", "safetensors")),
)


@dataclass(frozen=True)
class Settings:
    width: int = 7168
    side: int = 448  # px: 1024 patches, 256 tokens with the tiny preset's limits
    images_per_request: int = 4
    clients: int = 4
    dp: int = 2
    # 5 repeats: two runs' ranges then overlap by chance alone 99% of the time, 3 give 90%
    # (python -m benchmarks.compare --chance 5).
    repeats: int = 5
    window_s: float = 3.0
    app_overrides: dict = field(default_factory=dict)

    @classmethod
    def of(cls, quick: bool) -> Settings:
        return cls(repeats=3, window_s=1.5) if quick else cls()


# --- our server -----------------------------------------------------------------------


def checkpoint(root: Path, width: int) -> Path:
    """The tiny tower with a ``width``-wide projector output, seeded weights."""
    from kimi_encoder.config import get_preset
    from kimi_encoder.weights import write_checkpoint

    tiny = get_preset("tiny")
    vision = dataclasses.replace(tiny.vision, text_hidden_size=width)
    return write_checkpoint(root / f"tiny-{width}", vision, tiny.preprocess, seed=0)


def request_body(images: list[bytes], fmt: str, dtype: str) -> bytes:
    """A JSON encode request; float32 is left to the server's default (the model's dtype)."""
    body: dict = {
        "items": [{"type": "image", "image": base64.b64encode(b).decode()} for b in images],
        "response_format": fmt,
    }
    if dtype != "float32":
        body["feature_dtype"] = dtype
    return json.dumps(body).encode()


class NotSupported(Exception):
    """The server does not offer what a cell asks for."""


def check_answer(data: bytes, fmt: str, dtype: str, count: int) -> None:
    """Raise ``NotSupported`` unless the answer has ``count`` items of ``dtype``."""
    code, _ = DTYPES[dtype]
    if fmt == "safetensors":
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        got = [header[f"features.{i}"]["dtype"] for i in range(count)]
        want = [code] * count
    else:
        items = json.loads(data)["items"]
        got = [item.get("dtype", "float32") for item in items]
        want = [dtype] * count
    if got != want:
        raise NotSupported(f"asked for {dtype}, answered {sorted(set(got))}")


def refuses_feature_dtype(status: int, body: bytes) -> bool:
    """Whether an error answer is a server without the ``feature_dtype`` field refusing it."""
    return status == 422 and b"feature_dtype" in body


def probe(client: Http, path: str, body: bytes, fmt: str, dtype: str, count: int) -> int:
    """One request of a cell: its answer's size, or ``NotSupported`` (a 422 naming
    ``feature_dtype``, or an answer in another dtype)."""
    try:
        data, _ = client.post(path, body, "application/json")
    except HttpError as exc:
        if refuses_feature_dtype(exc.status, exc.body):
            raise NotSupported("not supported by this server (422 for feature_dtype)") from None
        raise
    check_answer(data, fmt, dtype, count)
    return len(data)


# --- ceilings -------------------------------------------------------------------------


def _plain_server(port: int, ready) -> None:
    """Stdlib HTTP/1.1 server: reads the request body, answers ``n`` bytes for ``POST /n``."""
    bodies: dict[int, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            n = int(self.path.strip("/"))
            body = bodies.setdefault(n, np.random.default_rng(n).bytes(n))
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(n))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ready.set()
    server.serve_forever()


class PlainServer:
    """``_plain_server`` in a process of its own (a context manager)."""

    def __enter__(self) -> PlainServer:
        context = mp.get_context("spawn")
        self.port = free_port()
        ready = context.Event()
        self.proc = context.Process(target=_plain_server, args=(self.port, ready), daemon=True)
        self.proc.start()
        while not ready.wait(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"the plain HTTP server exited ({self.proc.exitcode})")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.join()


def byte_arrays():
    """A Serve deployment answering ``n`` seeded random bytes as a numpy array (through the
    object store), prepared once per size: the inner side of a hop."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    class Inner:
        def __init__(self):
            self.arrays: dict[int, np.ndarray] = {}

        def __call__(self, n: int) -> np.ndarray:
            if n not in self.arrays:
                self.arrays[n] = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
            return self.arrays[n]

    return Inner


def ceiling_apps():
    """(echo app, hop app): a Serve deployment that answers ``n`` bytes for ``?n=``, and
    one that gets them from an inner deployment as a numpy array first; with
    ``&hops=2`` it asks for each half in a call of its own, both at once, and joins
    the two arrays into the body (the shape of a dp 2 answer: two rank calls, one
    join)."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    class Echo:
        def __init__(self):
            self.bodies: dict[int, bytes] = {}

        async def __call__(self, request: Request) -> Response:
            await request.body()
            n = int(request.query_params["n"])
            body = self.bodies.setdefault(n, np.random.default_rng(n).bytes(n))
            return Response(body, media_type="application/octet-stream")

    Inner = byte_arrays()

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    class Outer:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, request: Request) -> Response:
            await request.body()
            n = int(request.query_params["n"])
            if request.query_params.get("hops") == "2":
                halves = await asyncio.gather(
                    self.inner.remote(n // 2), self.inner.remote(n - n // 2)
                )
                body = b"".join(memoryview(half) for half in halves)
            else:
                body = (await self.inner.remote(n)).tobytes()
            return Response(body, media_type="application/octet-stream")

    return Echo.bind(), Outer.bind(Inner.bind())


# --- cells ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    cache: str
    dtype: str
    fmt: str
    ingress: int
    tuned: bool = True  # False: the app's replicas get glibc_tunables '' (glibc's defaults)
    kept: bool = True  # hits: False turns the ingress cache off (every hit asks its rank)
    haproxy: bool = False  # in the cluster behind HAProxy (the third phase)

    @property
    def app(self) -> str:
        name = f"bytes-{self.cache}-{self.ingress}"
        return name + ("" if self.tuned else "-untuned") + ("" if self.kept else "-ranks")


# Our default glibc_tunables against none, in the cells the ceilings' ratio targets.
UNTUNED = [Cell("hit", dtype, "safetensors", 1, tuned=False) for dtype in DTYPES]
# Hits answered by the ingress from the features it held against hits that ask their rank.
RANKS_ONLY = [Cell("hit", dtype, "safetensors", 1, kept=False) for dtype in DTYPES]
# The ingress cache of the hit cells (and the ranks' feature cache): 256 MiB each.
CACHE_BYTES = 256 << 20
# The hit cells of one ingress replica, behind HAProxy.
BEHIND_HAPROXY = [
    Cell("hit", dtype, fmt, 1, haproxy=True) for dtype, fmt in itertools.product(DTYPES, FORMATS)
]
HAPROXY = "HAProxy"  # the first element of the HAProxy phase's ceiling keys


@dataclass
class Measured:
    """Every repeat's window of each cell (ours, by ``Cell``; ceilings by (name, body))."""

    windows: dict = field(default_factory=dict)
    unsupported: dict[Cell, str] = field(default_factory=dict)
    body_bytes: dict[tuple[str, str], int] = field(default_factory=dict)  # (dtype, fmt)
    expected: set[tuple[str, str]] = field(default_factory=set)  # sizes computed, not seen
    request_bytes: int = 0

    def rates(self, key) -> list[float]:
        return [w.images_per_s for w in self.windows[key]]

    def mb_per_s(self, key) -> Spread:
        return spread([w.bytes_per_s / 1e6 for w in self.windows[key]])


def sender(client: Http, path: str, body: bytes, images: int) -> Callable[[int], tuple[int, int]]:
    def send(_: int) -> tuple[int, int]:
        data, _ = client.post(path, body, "application/json")
        return images, len(data)

    return send


def expected_size(f32_size: int, fmt: str, item_bytes: int, items: int, dtype: str) -> int:
    """Body size with ``dtype`` features, from the float32 body's (``items`` arrays of
    ``item_bytes`` float32 bytes each): the payload shrinks with the element size, in JSON
    as base64 (the envelope's dtype names are taken as the same length)."""
    _, element = DTYPES[dtype]
    smaller = item_bytes * element // 4
    if fmt == "json":
        return f32_size - items * (_b64_len(item_bytes) - _b64_len(smaller))
    return f32_size - items * (item_bytes - smaller)


def _b64_len(n: int) -> int:
    return 4 * -(-n // 3)


def measure(s: Settings, root: Path) -> Measured:
    """Three phases, each with only its apps deployed: cache hits (ours and the ceilings,
    which are compared with them), then misses, then hits and the Serve ceilings in a
    cluster behind HAProxy; in each, every cell alternated over ``s.repeats`` repeats."""
    ckpt = str(checkpoint(root, s.width))
    images = [image(s.side, s.side, seed=7000 + i) for i in range(s.images_per_request)]
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
    haproxy = bench_ingress.INGRESSES[HAPROXY]
    with bench_ingress.Server(haproxy, deploy, (ckpt, s, BEHIND_HAPROXY), logical_cpus=16) as ha:
        setups = our_setups(ha.client, images, s, out, BEHIND_HAPROXY)
        setups |= haproxy_ceiling_setups(ha.client, images, s, out)
        out.windows |= alternate(setups, s.repeats, rerun_if=server_failed)
    return out


def deploy(cluster: Cluster, ckpt: str, s: Settings, cells: list[Cell]) -> list[str]:
    """One app per app name among ``cells`` (an app serves every dtype and format), and
    the ceiling apps when the cells are hits; the names of the apps."""
    apps = []
    for cell in {c.app: c for c in cells}.values():
        hit = cell.cache == "hit"
        args = app_args(
            ckpt,
            s.dp,
            ingress_replicas=cell.ingress,
            feature_cache_bytes=CACHE_BYTES if hit else 0,
            ingress_cache_bytes=CACHE_BYTES if hit and cell.kept else 0,
            **{**s.app_overrides, **({} if cell.tuned else {"glibc_tunables": ""})},
        )
        apps.append(cluster.deploy(cell.app, _bind(args)))
    if any(c.cache == "hit" for c in cells):
        echo, hop = ceiling_apps()
        apps += [cluster.deploy("echo", echo), cluster.deploy("hop", hop)]
    return [app.strip("/") for app in apps]


def cells_of(cache: str) -> list[Cell]:
    """The cells of the hits or the misses phase (behind Serve's proxy)."""
    cells = [Cell(cache, *c) for c in itertools.product(DTYPES, FORMATS, INGRESS)]
    return cells + (UNTUNED + RANKS_ONLY if cache == "hit" else [])


def our_setups(
    client: Http, images: list[bytes], s: Settings, out: Measured, cells: list[Cell]
) -> dict:
    """A closed loop per cell the server supports (probed first: twice, so that a hit
    cell's images are cached); the others go to ``out.unsupported``."""
    setups = {}
    for cell in cells:
        dtype, fmt = cell.dtype, cell.fmt
        body = request_body(images, fmt, dtype)
        out.request_bytes = len(body)
        path = f"/{cell.app}/v1/encode"
        try:
            probe(client, path, body, fmt, dtype, len(images))
            size = probe(client, path, body, fmt, dtype, len(images))
            out.body_bytes.setdefault((dtype, fmt), size)  # HAProxy's ceilings: the same sizes
        except NotSupported as exc:
            out.unsupported[cell] = str(exc)
            continue
        setups[cell] = _loop(sender(client, path, body, len(images)), s)
    return setups


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
        body = request_body(images, fmt, dtype)
        for name, c, path in (
            (CEILINGS[0], plain, f"/{size}"),
            *((name, client, path) for name, path in serve_ceilings(size)),
        ):
            setups[(name, dtype, fmt)] = _loop(sender(c, path, body, len(images)), s)
    return setups


def serve_ceilings(size: int) -> list[tuple[str, str]]:
    """(name, path) of each Serve ceiling answering ``size`` bytes."""
    return [
        (CEILINGS[1], f"/echo?n={size}"),
        (CEILINGS[2], f"/hop?n={size}"),
        (CEILINGS[3], f"/hop?n={size}&hops=2"),
    ]


def haproxy_ceiling_setups(client: Http, images: list[bytes], s: Settings, out: Measured) -> dict:
    """The Serve ceilings behind HAProxy, keyed (``HAPROXY``, name, dtype, fmt), with the
    answer sizes of the first phase."""
    setups = {}
    for dtype, fmt in itertools.product(DTYPES, FORMATS):
        body = request_body(images, fmt, dtype)
        for name, path in serve_ceilings(out.body_bytes[(dtype, fmt)]):
            setups[(HAPROXY, name, dtype, fmt)] = _loop(sender(client, path, body, len(images)), s)
    return setups


def _bind(args):
    from deployments.app import bind_app

    return bind_app(args)


def _loop(send, s: Settings) -> Callable[[], Window]:
    return lambda: closed_loop(send, s.clients, s.window_s)


# --- sections -------------------------------------------------------------------------


def cell_text(m: Measured, cell: Cell, what: str) -> str:
    if cell in m.unsupported:
        return "not supported by this server"
    if what == "images":
        return spread(m.rates(cell)).fmt(1)
    return m.mb_per_s(cell).fmt(0)


def size_text(m: Measured, dtype: str, fmt: str) -> str:
    size = f"{m.body_bytes[(dtype, fmt)] / 1e6:.1f}"
    return f"{size} (expected)" if (dtype, fmt) in m.expected else size


def ratio_text(m: Measured, a, b, digits: int = 2) -> str:
    if a in m.unsupported or b in m.unsupported:
        return "n/a (not supported)"
    return ratio(m.rates(a), m.rates(b)).fmt(digits, "x")


def sections(quick: bool, s: Settings | None = None) -> list[Section]:
    s = s or Settings.of(quick)
    with tempfile.TemporaryDirectory() as tmp:
        m = measure(s, Path(tmp))
    return [throughput_section(m, s), ceilings_section(m, s), haproxy_section(m, s)]


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
    """Cores busy by process (``bench_serve.labeller``) in the safetensors hit cells."""
    cells = [Cell("hit", dtype, "safetensors", ingress) for dtype in DTYPES for ingress in INGRESS]
    ranks = [f"rank {r}" for r in range(s.dp)]
    names = [bench_serve.INGRESS, *ranks, *bench_serve.AROUND[1:]]
    return cores_table(m, cells, names, lambda c: f"{c.dtype}, {c.ingress} ingress")


def cores_table(m: Measured, cells: list[Cell], names: list[str], label) -> str:
    """Cores busy by each of ``names`` in each supported cell (columns ``label(cell)``),
    all of ours, the machine, and the images/s."""
    cells = [c for c in cells if c not in m.unsupported]
    rows = [
        [name, *(bench_serve.cores(m.windows[c], c.app, name).fmt(2) for c in cells)]
        for name in names
    ]

    def row(label: str, figure) -> list[str]:
        return [label, *(spread([figure(w) for w in m.windows[c]]).fmt(2) for c in cells)]

    rows += [
        row("**all of ours**", lambda w: w.usage.cores(w.usage.ours_s)),
        row("machine busy", lambda w: w.usage.cores(w.usage.machine_busy_s)),
        ["images/s", *(spread(m.rates(c)).fmt(1) for c in cells)],
    ]
    return table(["cores busy", *(label(c) for c in cells)], rows)


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


def haproxy_section(m: Measured, s: Settings) -> Section:
    hops = CEILINGS[2:]
    rows = []
    for dtype, fmt in itertools.product(DTYPES, FORMATS):
        ours = Cell("hit", dtype, fmt, 1, haproxy=True)
        rows.append(
            [
                f"{dtype} {fmt}",
                size_text(m, dtype, fmt),
                cell_text(m, ours, "MB"),
                cell_text(m, ours, "images"),
                *(m.mb_per_s((HAPROXY, c, dtype, fmt)).fmt(0) for c in CEILINGS[1:]),
                *(ratio_text(m, ours, (HAPROXY, hop, dtype, fmt)) for hop in hops),
            ]
        )
    header = [
        "answer body",
        "MB",
        "ours: MB/s",
        "images/s",
        *(f"{c}: MB/s" for c in CEILINGS[1:]),
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
            f"sections above; a phase of its own after them, {s.repeats} repeats "
            "alternating its cells. The plain HTTP server has no Serve ingress: its figures "
            "are in the section above.",
            table(header, rows),
            "The issue's ratios of images/s behind HAProxy, ours next to the ceilings':",
            ceiling_ratio_table(m, haproxy=True),
            "Cores busy by process in ours' safetensors cells (CPU seconds / wall seconds, "
            "median of the repeats):",
            haproxy_cpu_table(m, s),
            PER_REQUEST.format(proxy="HAProxy"),
            per_request_table(m, haproxy=True),
        ],
    )


def haproxy_cpu_table(m: Measured, s: Settings) -> str:
    cells = [c for c in BEHIND_HAPROXY if c.fmt == "safetensors"]
    names = [bench_serve.INGRESS, *(f"rank {r}" for r in range(s.dp)), cpu.HAPROXY, cpu.CLIENT]
    return cores_table(m, cells, names, lambda c: f"{c.dtype}, {c.fmt}")


CEILING_RATIOS = (
    "The ratios of the section above, ours next to the same ratios of the ceilings' "
    "images/s (each request stands for the same 4 images): what Serve itself allows "
    "when the answer's size is all that changes."
)


def ceiling_ratio_table(m: Measured, haproxy: bool = False) -> str:
    """``RATIOS`` of ours (hits, 1 ingress) and of each Serve ceiling, in the phase
    behind Serve's proxy or (``haproxy``) behind HAProxy."""
    front = (HAPROXY,) if haproxy else ()
    rows = [
        [
            label,
            ratio_text(m, Cell("hit", *a, 1, haproxy=haproxy), Cell("hit", *b, 1, haproxy=haproxy)),
            *(ratio_text(m, (*front, c, *a), (*front, c, *b)) for c in CEILINGS[1:]),
        ]
        for label, a, b in RATIOS
    ]
    return table(["ratio", OURS, *CEILINGS[1:]], rows)


PER_REQUEST = (
    "CPU per request in the same safetensors cells, where a request passes: the app's "
    "replicas, {proxy} and Ray's system processes (not the client, the controller or "
    "other apps' idle replicas). A bfloat16 answer carries half the float32 payload; what "
    "a path spends on a bfloat16 request beyond half its float32 figure does not shrink "
    "with the payload, and the more of that a path has, the further its bf16 / f32 "
    "images/s falls below 2x. The last two columns split each path's CPU into that part "
    "(the line through its two medians, at zero bytes) and what each MB of answer adds. "
    "Were that CPU the only limit, bf16 / f32 images/s would be the float32 figure over "
    "the bfloat16 one."
)


def request_cpu_ms(w: Window, app: str) -> float:
    """CPU-ms per request where a request of ``app`` passes: its replicas, Serve's proxy
    and Ray's system processes (not the client, the controller or other apps' replicas)."""
    grouped = w.usage.grouped(bench_serve.labeller(app))
    skip = (cpu.CLIENT, cpu.CONTROLLER, cpu.OTHER_CHILD, bench_serve.OTHER_APPS)
    spent = sum(seconds for role, seconds in grouped.items() if role not in skip)
    return spent * 1e3 / (w.requests_per_s * w.usage.wall_s)


def path_key(path: str, dtype: str, haproxy: bool = False) -> tuple:
    """(windows key, app) of ``path`` (``OURS`` or a Serve ceiling) in its safetensors
    cell, in the phase behind Serve's proxy or (``haproxy``) behind HAProxy."""
    if path == OURS:
        cell = Cell("hit", dtype, "safetensors", 1, haproxy=haproxy)
        return cell, cell.app
    front = (HAPROXY,) if haproxy else ()
    return (*front, path, dtype, "safetensors"), CEILING_APPS[path]


def per_request_table(m: Measured, haproxy: bool = False) -> str:
    """CPU-ms per request of each path and dtype, and the line through the two: CPU-ms
    per request whatever its answer's size, plus CPU-ms per MB of answer (from the
    medians and the two answers' sizes)."""
    mb = [m.body_bytes[(dtype, "safetensors")] / 1e6 for dtype in DTYPES]
    rows = []
    for path in (OURS, *CEILING_APPS):
        row, medians = [path], []
        for dtype in DTYPES:
            key, app = path_key(path, dtype, haproxy)
            if key in m.unsupported:
                row.append("n/a (not supported)")
                continue
            figure = spread([request_cpu_ms(w, app) for w in m.windows[key]])
            row.append(figure.fmt(1))
            medians.append(figure.median)
        if len(medians) == len(DTYPES) and mb[0] != mb[1]:
            at_zero, per_mb = line_through(mb, medians)
            row += [f"{at_zero:.1f}", f"{per_mb:.2f}"]
        else:
            row += ["n/a", "n/a"]
        rows.append(row)
    header = ["path (safetensors, hits)", *(f"{d}: CPU-ms per request" for d in DTYPES)]
    header += ["fitted: CPU-ms per request", "+ CPU-ms per MB"]
    return table(header, rows)


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
            row.append(spread([request_cpu_ms(w, cell.app) for w in m.windows[cell]]).fmt(1))
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
        "`deployments/rank.py` `StoredFeatures`",
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
        "Three phases, each with only its own apps deployed (idle apps cost CPU): hits, "
        "with the ceilings of the next section, then misses, then hits behind HAProxy "
        "(its own section). "
        f"{s.repeats} repeats alternating every cell of a phase, {s.window_s:g} s windows; "
        "median (min–max); a ratio is the median of the per-repeat ratios."
    )


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
