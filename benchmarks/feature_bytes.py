"""The cells of the feature-bytes benchmarks, how they are sent, and the tables they share.

``bench_bytes`` (cache hits and misses behind Serve's proxy, next to Serve's own
ceilings) and ``bench_bytes_haproxy`` (the hits and the Serve ceilings behind
HAProxy) measure the same thing: how fast Kimi-K3-wide feature answers leave the
server. A cell is one of our apps answering one wire dtype in one format
(``Cell``); a ceiling is a trivial Serve app answering bodies of the same size
(``paths.ceiling_apps``). Every window of both is kept in a ``Measured``.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kimi_encoder.features import SAFETENSORS, STORAGE

from . import cpu
from .common import Spread, line_through, ratio, spread, table
from .inputs import image
from .paths import ceiling_apps
from .serving import (
    Cluster,
    Http,
    HttpError,
    Window,
    bench_args,
    bind,
    closed_loop,
    json_body,
    wide_checkpoint,
)

DTYPES = ("float32", "bfloat16")  # the wire dtypes compared (float16 is bfloat16's size)
FORMATS = ("json", "safetensors")
CACHE = ("hit", "miss")
INGRESS = (1, 2)
CEILINGS = ("plain HTTP", "Serve", "Serve + 1 hop", "Serve + 2 hops")
# The Serve app each ceiling runs in (``ceiling_apps``): whose replicas its CPU is.
CEILING_APPS = {CEILINGS[1]: "echo", CEILINGS[2]: "hop", CEILINGS[3]: "hop"}
OURS = "ours (hits, 1 ingress)"
HAPROXY = "HAProxy"  # the first element of the ceiling keys behind HAProxy
# The ingress cache of the hit cells (and the ranks' feature cache): 256 MiB each.
CACHE_BYTES = 256 << 20
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


# --- requests and answers -----------------------------------------------------------


def inputs(s: Settings, root: Path) -> tuple[str, list[bytes]]:
    """The checkpoint the apps serve (the tiny tower, ``s.width`` wide, written under
    ``root``) and the images of every request."""
    ckpt = str(wide_checkpoint(root / f"tiny-{s.width}", width=s.width))
    return ckpt, [image(s.side, s.side, seed=7000 + i) for i in range(s.images_per_request)]


def request_body(images: list[bytes], fmt: str, dtype: str) -> bytes:
    """A JSON encode request; float32 is left to the server's default (the model's dtype)."""
    return json_body(
        images, response_format=fmt, **({} if dtype == "float32" else {"feature_dtype": dtype})
    )


class NotSupported(Exception):
    """The server does not offer what a cell asks for."""


def check_answer(data: bytes, fmt: str, dtype: str, count: int) -> None:
    """Raise ``NotSupported`` unless the answer has ``count`` items of ``dtype``."""
    code = SAFETENSORS[dtype]
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
    element = STORAGE[dtype].itemsize
    smaller = item_bytes * element // 4
    if fmt == "json":
        return f32_size - items * (_b64_len(item_bytes) - _b64_len(smaller))
    return f32_size - items * (item_bytes - smaller)


def _b64_len(n: int) -> int:
    return 4 * -(-n // 3)


def deploy(cluster: Cluster, ckpt: str, s: Settings, cells: list[Cell]) -> list[str]:
    """One app per app name among ``cells`` (an app serves every dtype and format), and
    the ceiling apps when the cells are hits; the names of the apps."""
    apps = []
    for cell in {c.app: c for c in cells}.values():
        hit = cell.cache == "hit"
        args = bench_args(
            ckpt,
            s.dp,
            ingress_replicas=cell.ingress,
            feature_cache_bytes=CACHE_BYTES if hit else 0,
            ingress_cache_bytes=CACHE_BYTES if hit and cell.kept else 0,
            **{**s.app_overrides, **({} if cell.tuned else {"glibc_tunables": ""})},
        )
        apps.append(cluster.deploy(cell.app, bind(args)))
    if any(c.cache == "hit" for c in cells):
        echo, hop = ceiling_apps()
        apps += [cluster.deploy("echo", echo), cluster.deploy("hop", hop)]
    return [app.strip("/") for app in apps]


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
        setups[cell] = loop_of(sender(client, path, body, len(images)), s)
    return setups


def serve_ceilings(size: int) -> list[tuple[str, str]]:
    """(name, path) of each Serve ceiling answering ``size`` bytes."""
    return [
        (CEILINGS[1], f"/echo?n={size}"),
        (CEILINGS[2], f"/hop?n={size}"),
        (CEILINGS[3], f"/hop?n={size}&hops=2"),
    ]


def serve_ceiling_setups(
    client: Http, images: list[bytes], s: Settings, out: Measured, front: tuple = ()
) -> dict:
    """A closed loop per Serve ceiling, dtype and format, answering bodies of the sizes
    ours answered (``out.body_bytes``), keyed (*``front``, name, dtype, fmt)."""
    setups = {}
    for dtype, fmt in itertools.product(DTYPES, FORMATS):
        body = request_body(images, fmt, dtype)
        for name, path in serve_ceilings(out.body_bytes[(dtype, fmt)]):
            setups[(*front, name, dtype, fmt)] = loop_of(sender(client, path, body, len(images)), s)
    return setups


def loop_of(send, s: Settings) -> Callable[[], Window]:
    return lambda: closed_loop(send, s.clients, s.window_s)


# --- tables ---------------------------------------------------------------------------


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


def cores_table(m: Measured, cells: list[Cell], names: list[str], label) -> str:
    """Cores busy by each of ``names`` (``cpu.labeller``) in each supported cell (columns
    ``label(cell)``), all of ours, the machine, and the images/s."""
    cells = [c for c in cells if c not in m.unsupported]
    rows = [[name, *(cpu.cores(m.windows[c], c.app, name).fmt(2) for c in cells)] for name in names]

    def row(label: str, figure) -> list[str]:
        return [label, *(spread([figure(w) for w in m.windows[c]]).fmt(2) for c in cells)]

    rows += [
        row("**all of ours**", lambda w: w.usage.cores(w.usage.ours_s)),
        row("machine busy", lambda w: w.usage.cores(w.usage.machine_busy_s)),
        ["images/s", *(spread(m.rates(c)).fmt(1) for c in cells)],
    ]
    return table(["cores busy", *(label(c) for c in cells)], rows)


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
            figure = spread([cpu.request_cpu_ms(w, app) for w in m.windows[key]])
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
