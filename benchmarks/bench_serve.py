"""The served path: real Ray Serve over HTTP on this machine.

    python -m benchmarks.bench_serve [--quick] [--only throughput cache latency]

One Ray cluster; for each preset (full run: tiny and small; quick: tiny) an app
with dp 1 and one with dp 2 (cache off, each rank one logical CPU and one
torch thread) side by side, and two plain encoder processes (benchmarks/direct.py).
Repeats alternate the setups: one encoder process, served dp 1, served dp 2,
two encoder processes at once (tiny: also served dp 1 with 8 images per
request); each served window records the CPU time of every process
(benchmarks/cpu.py).

- Serving overhead: served dp 1 over the one encoder process.
- DP scaling: served dp 2 over served dp 1, next to the machine's own ceiling
  (two encoder processes over one) and the figure with the client's CPU given back.
- Where the CPU goes: CPU-ms per image of each process; for tiny, split into a
  cost per request and a cost per image.
- Cache: a first request for an image against the same image again; hit rate of
  a Zipf(1.1) stream over a catalog.
- Latency vs offered load: open-loop Poisson arrivals at fractions of dp 1's
  saturated throughput; the knee is the first load whose p95 is over twice the
  lightest load's.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import http.client
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import cpu
from .common import (
    Section,
    Spread,
    alternate,
    arguments,
    image,
    line_through,
    ratio,
    spread,
    standalone,
    table,
)
from .direct import DirectWorkers
from .serving import Cluster, Http, Window, app_args, closed_loop, server_failed

MIX = [(320, 240), (448, 336), (224, 224), (640, 480), (256, 192), (512, 384)]
PER_REQUEST = 2
CLIENTS = 4
PARTS = ("throughput", "cache", "latency")
COMMAND = "python -m benchmarks.bench_serve --only {part}"


@dataclass(frozen=True)
class Settings:
    presets: tuple[str, ...]
    repeats: int
    window_s: dict[str, float]  # per preset: long enough for a dozen requests at dp 1
    cache_preset: str
    cache_images: int
    zipf_draws: int
    latency_fractions: tuple[float, ...]
    latency_window_s: float
    split_presets: tuple[str, ...] = ("tiny",)  # also run dp 1 with LARGE images per request

    @classmethod
    def of(cls, quick: bool) -> Settings:
        if quick:
            return cls(
                presets=("tiny",),
                repeats=3,
                window_s={"tiny": 3.0},
                cache_preset="tiny",
                cache_images=4,
                zipf_draws=60,
                latency_fractions=(0.2, 0.5, 0.8, 1.0, 1.3),
                latency_window_s=4.0,
            )
        return cls(
            presets=("tiny", "small"),
            repeats=5,
            window_s={"tiny": 6.0, "small": 10.0},
            cache_preset="small",
            cache_images=8,
            zipf_draws=200,
            latency_fractions=(0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.4),
            latency_window_s=8.0,
        )

    @property
    def latency_preset(self) -> str:
        return self.presets[-1]


def request_stream(count: int, per_request: int = PER_REQUEST) -> list[list[bytes]]:
    """``count`` requests of ``per_request`` distinct images cycling through MIX (the same
    images, in the same order, whatever ``per_request``)."""
    return [
        [
            image(*MIX[(r * per_request + i) % len(MIX)], seed=r * per_request + i)
            for i in range(per_request)
        ]
        for r in range(count)
    ]


def json_body(images: list[bytes]) -> bytes:
    items = [{"type": "image", "image": base64.b64encode(b).decode()} for b in images]
    return json.dumps({"items": items}).encode()


class Encode:
    """``/v1/encode`` of one app: JSON bodies built once, sent by a lean client."""

    def __init__(self, client: Http, prefix: str, stream: list[list[bytes]]):
        self.client, self.prefix = client, prefix
        self.path = f"{prefix}/v1/encode"
        self.bodies = [(json_body(images), len(images)) for images in stream]

    def send(self, k: int) -> tuple[int, int]:
        body, images = self.bodies[k % len(self.bodies)]
        data, _ = self.client.post(self.path, body, "application/json")
        return images, len(data)

    def info(self) -> dict:
        conn = http.client.HTTPConnection(self.client.host, self.client.port, timeout=60)
        try:
            conn.request("GET", f"{self.prefix}/v1/info")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()


# --- the throughput experiment --------------------------------------------------------

SETUPS = ("direct 1", "served dp 1", "served dp 2", "direct 2")
# Served dp 1 with more images per request, to split CPU into per request and per image.
LARGE = 8
BATCHED = f"served dp 1, {LARGE} per request"


@dataclass
class PresetRun:
    """Every repeat's window of each setup, for one preset."""

    preset: str
    apps: dict[int, str]  # dp -> app name
    windows: dict[str, list[Window]] = field(default_factory=dict)

    def rates(self, setup: str) -> list[float]:
        return [w.images_per_s for w in self.windows[setup]]

    def ratio(self, numerator: str, denominator: str) -> Spread:
        return ratio(self.rates(numerator), self.rates(denominator))


def measure_preset(cluster: Cluster, client: Http, preset: str, s: Settings) -> PresetRun:
    stream = request_stream(24)
    apps = {dp: f"{preset}-dp{dp}" for dp in (1, 2)}
    senders = {}
    for dp, name in apps.items():
        prefix = cluster.deploy(name, bind(app_args(preset, dp, feature_cache_bytes=0)))
        senders[dp] = Encode(client, prefix, stream)
        senders[dp].send(0)  # warm-up
    window = s.window_s[preset]
    with DirectWorkers(preset, stream, 2) as direct:

        def served(dp: int):
            return lambda: closed_loop(senders[dp].send, CLIENTS, window, direct.labels)

        setups = {
            SETUPS[0]: lambda: direct.run(1, window),
            SETUPS[1]: served(1),
            SETUPS[2]: served(2),
            SETUPS[3]: lambda: direct.run(2, window),
        }
        if preset in s.split_presets:
            large = Encode(client, f"/{apps[1]}", request_stream(24 * PER_REQUEST // LARGE, LARGE))
            setups[BATCHED] = lambda: closed_loop(large.send, CLIENTS, window, direct.labels)
        windows = alternate(setups, s.repeats, rerun_if=server_failed)
    return PresetRun(preset, apps, windows)


def bind(args):
    from deployments.app import bind_app

    return bind_app(args)


# --- CPU accounting -------------------------------------------------------------------

INGRESS = "ingress"
OTHER_APPS = "other apps' replicas (idle)"
OUTSIDE = "outside (other users, kernel)"
AROUND = (INGRESS, cpu.PROXY, cpu.CONTROLLER, cpu.CLIENT, cpu.RAY_SYSTEM, OTHER_APPS)


def labeller(app: str):
    """Table label of a role during a window of ``app``."""

    def label(role: str) -> str:
        if not role.startswith("replica "):
            return role
        owner, _, deployment = role.removeprefix("replica ").partition(":")
        if owner != app:
            return OTHER_APPS
        if deployment.startswith("EncoderRank_"):
            return "rank " + deployment.removeprefix("EncoderRank_")
        return INGRESS

    return label


def cpu_ms(windows: list[Window], app: str) -> dict[str, Spread]:
    """CPU-ms per image answered, by label (and 'outside'), over the repeats; labels that
    spent nothing are left out."""
    per: dict[str, list[float]] = {}
    for w in windows:
        grouped = w.usage.grouped(labeller(app)) | {OUTSIDE: w.usage.outside_s}
        for name, seconds in grouped.items():
            per.setdefault(name, []).append(w.cpu_ms_per_image(seconds))
    return {
        name: spread(v + [0.0] * (len(windows) - len(v)))
        for name, v in per.items()
        if max(v) >= 0.05
    }


def cores(windows: list[Window], app: str, name: str) -> Spread:
    """Cores ``name`` kept busy on average in each window."""
    return spread([w.usage.cores(w.usage.grouped(labeller(app)).get(name, 0.0)) for w in windows])


def bound(w: Window, app: str, machine_cores: int, without_client: bool = False) -> float:
    """The highest rate the window's CPU use allows: each rank at most one core, all of
    ours within the cores the outside load left. Every process's CPU per image is taken
    as measured; ``without_client``: the client's CPU is not ours (it runs elsewhere)."""
    grouped = w.usage.grouped(labeller(app))
    ranks = [v for k, v in grouped.items() if k.startswith("rank ")]
    ours = w.usage.ours_s - (grouped.get(cpu.CLIENT, 0.0) if without_client else 0.0)
    left = machine_cores * w.usage.wall_s - w.usage.outside_s
    rank_bound = w.images_per_s * w.usage.wall_s / max(ranks)
    return min(rank_bound, w.images_per_s * left / ours)


# --- sections -------------------------------------------------------------------------


def overhead_section(runs: list[PresetRun], s: Settings, machine_cores: int) -> Section:
    rows, notes = [], []
    for run in runs:
        direct, served = spread(run.rates(SETUPS[0])), spread(run.rates(SETUPS[1]))
        windows = run.windows[SETUPS[1]]
        ms = cpu_ms(windows, run.apps[1])
        around = sum(ms[k].median for k in AROUND if k in ms)
        rows.append(
            [
                run.preset,
                direct.fmt(1),
                served.fmt(1),
                f"**{run.ratio(SETUPS[1], SETUPS[0]).fmt(2)}**",
                f"{1e3 / direct.median:.1f}",
                ms["rank 0"].fmt(1),
                f"{around:.1f}",
                spread([bound(w, run.apps[1], machine_cores) for w in windows]).fmt(1),
            ]
        )
        notes.append(
            f"- {run.preset}: the rank spends {ms['rank 0'].median:.1f} CPU-ms per image "
            f"(one encoder process: {1e3 / direct.median:.1f} ms of wall time), the processes "
            f"around it {around:.1f} more; at most {machine_cores} x 1000 / "
            f"{ms['rank 0'].median + around:.1f} = "
            f"{machine_cores * 1e3 / (ms['rank 0'].median + around):.1f} images/s fit the "
            f"machine, and the rank alone allows {1e3 / ms['rank 0'].median:.1f}."
        )
    header = [
        "preset",
        "one encoder process, images/s",
        "served dp 1, images/s",
        "served / in-process",
        "in-process ms per image",
        "rank CPU-ms per image",
        "CPU-ms per image around the rank",
        "CPU-bound limit, images/s",
    ]
    return Section(
        "Serving overhead (target: served / in-process >= 0.9; tiny >= 0.8)",
        COMMAND.format(part="throughput"),
        [
            conditions(s),
            table(header, rows),
            '"Around the rank": ingress, Serve proxy and controller, client, Ray\'s own '
            'processes and the idle apps ("Where the CPU goes" lists them). The CPU-bound '
            "limit of a window is the lower of the rank's rate at one full core and the rate "
            "at which all of ours would fill the cores the outside load left (`bound`). The "
            "served rate cannot beat the in-process one by more than the rank's extra work "
            "allows, and it falls below it as soon as the work around the rank needs the "
            "rank's core too:",
            "\n".join(notes),
        ],
    )


def scaling_section(runs: list[PresetRun], s: Settings, machine_cores: int) -> Section:
    rows = []
    for run in runs:
        (app1, app2), (w1, w2) = run.apps.values(), (run.windows[SETUPS[1]], run.windows[SETUPS[2]])
        limit = [bound(w, app2, machine_cores) for w in w2]
        free2 = [
            min(bound(w, app2, machine_cores, True) / bound(w, app2, machine_cores), 2) for w in w2
        ]
        free1 = [
            min(bound(w, app1, machine_cores, True) / bound(w, app1, machine_cores), 2) for w in w1
        ]
        given_back = [
            r2 * f2 / (r1 * f1)
            for r1, r2, f1, f2 in zip(
                run.rates(SETUPS[1]), run.rates(SETUPS[2]), free1, free2, strict=True
            )
        ]
        rows.append(
            [
                run.preset,
                spread(run.rates(SETUPS[1])).fmt(1),
                spread(run.rates(SETUPS[2])).fmt(1),
                f"**{run.ratio(SETUPS[2], SETUPS[1]).fmt(2)}**",
                spread(given_back).fmt(2),
                run.ratio(SETUPS[3], SETUPS[0]).fmt(2),
                spread(limit).fmt(1),
                spread([w.usage.cores(w.usage.outside_s) for w in w2]).fmt(2),
                " / ".join(cores(w2, app2, f"rank {r}").fmt(2) for r in (0, 1)),
            ]
        )
    header = [
        "preset",
        "served dp 1, images/s",
        "served dp 2, images/s",
        "dp 2 / dp 1",
        "dp 2 / dp 1, client's CPU given back",
        "machine ceiling: 2 encoder processes / 1",
        "dp 2 CPU-bound limit, images/s",
        "dp 2: outside load, cores",
        "dp 2: rank 0 / rank 1 cores busy",
    ]
    per_repeat = [
        [
            run.preset,
            i + 1,
            f"{w1.usage.cores(w1.usage.outside_s):.2f}",
            f"{w2.usage.cores(w2.usage.outside_s):.2f}",
            f"{w1.images_per_s:.2f}",
            f"{w2.images_per_s:.2f}",
            f"{w2.images_per_s / w1.images_per_s:.2f}",
        ]
        for run in runs
        for i, (w1, w2) in enumerate(
            zip(run.windows[SETUPS[1]], run.windows[SETUPS[2]], strict=True)
        )
    ]
    repeat_header = [
        "preset",
        "repeat",
        "outside load in dp 1's window, cores",
        "in dp 2's",
        "dp 1, images/s",
        "dp 2, images/s",
        "dp 2 / dp 1",
    ]
    return Section(
        "DP scaling (target: dp 2 / dp 1 >= 1.7x)",
        COMMAND.format(part="throughput"),
        [
            conditions(s),
            table(header, rows),
            table(repeat_header, per_repeat),
            "Two ranks need both cores, and everything else (proxy, ingress, controller, "
            "client, Ray's processes, and other users' processes: \"outside\") runs on the same "
            "two; dp 1 leaves a core for them. So dp 2 is bounded by (cores - outside load) "
            "/ (all of our CPU per image), and whatever takes CPU from elsewhere on the "
            'machine comes off dp 2 and not off dp 1. "Client\'s CPU given back" rescales '
            "each window's rate by how much its CPU-bound limit rises when the client's CPU "
            "is not counted (the client on another machine). The machine ceiling is two "
            "plain encoder processes over one, measured in the same repeats.",
        ],
    )


def cpu_section(runs: list[PresetRun], s: Settings) -> Section:
    parts = [conditions(s)]
    for run in runs:
        columns = {dp: cpu_ms(run.windows[SETUPS[dp]], run.apps[dp]) for dp in (1, 2)}
        names = sorted({n for c in columns.values() for n in c}, key=_order)
        rows = [
            [name] + [columns[dp][name].fmt(1) if name in columns[dp] else "–" for dp in (1, 2)]
            for name in names
        ]
        rows.append(
            ["**all of ours**"]
            + [f"**{sum(c[n].median for n in c if n != OUTSIDE):.1f}**" for c in columns.values()]
        )
        direct = 1e3 / spread(run.rates(SETUPS[0])).median
        parts += [
            f"**{run.preset}** (one encoder process: {direct:.1f} ms per image)",
            table(["process", "dp 1: CPU-ms per image", "dp 2: CPU-ms per image"], rows),
        ]
    for run in runs:
        if BATCHED in run.windows:
            parts += split_per_request(run)
    parts.append(
        "CPU time (user + system) of each process over each served window, divided by "
        "the images the app answered in it (a rank of dp 2 encodes about half of them); "
        'median (min–max) over the repeats. "outside" is what the machine spent on '
        "processes that are not this benchmark's. Everything but the ranks is what serving "
        "costs per image on top of the encoder; a GPU deployment pays it on its CPUs."
    )
    return Section("Where the CPU goes", COMMAND.format(part="throughput"), parts)


def split_per_request(run: PresetRun) -> list[str]:
    """Each process's CPU as a cost per request plus a cost per image, from served dp 1
    with PER_REQUEST and with LARGE images per request (c(k) = per image + per request / k)."""
    small = cpu_ms(run.windows[SETUPS[1]], run.apps[1])
    large = cpu_ms(run.windows[BATCHED], run.apps[1])
    rows = []
    for name in sorted((set(small) | set(large)) - {OUTSIDE}, key=_order):
        c_small = small[name].median if name in small else 0.0
        c_large = large[name].median if name in large else 0.0
        # c(k) = per image + per request / k: a line in 1 / k
        per_image, per_request = line_through([1 / PER_REQUEST, 1 / LARGE], [c_small, c_large])
        rows.append(
            [name, f"{c_small:.1f}", f"{c_large:.1f}", f"{per_request:.1f}", f"{per_image:.1f}"]
        )
    served = run.ratio(BATCHED, SETUPS[0])
    header = [
        "process",
        f"CPU-ms per image, {PER_REQUEST} per request",
        f"{LARGE} per request",
        "fitted: CPU-ms per request",
        "+ CPU-ms per image",
    ]
    return [
        f"**{run.preset}, served dp 1: per request and per image.** The same images sent "
        f"{LARGE} per request (alternating with the runs above; served / in-process "
        f"{served.fmt(2)}).",
        table(header, rows),
    ]


def _order(name: str) -> tuple[int, str]:
    first = ["rank 0", "rank 1", *AROUND]
    return (first.index(name) if name in first else len(first), name)


def conditions(s: Settings) -> str:
    mix = ", ".join(f"{w}x{h}" for w, h in MIX)
    windows = ", ".join(f"{p} {w:g} s" for p, w in s.window_s.items())
    return (
        f"Closed loop, {CLIENTS} clients, {PER_REQUEST} images per request (JSON, sizes "
        f"{mix} px, cycling), cache off, one torch thread per rank; {s.repeats} repeats "
        f"alternating the setups {', '.join(SETUPS)}; windows {windows}. Figures: median "
        "(min–max) over the repeats; a ratio is the median of the per-repeat ratios."
    )


# --- cache ----------------------------------------------------------------------------


def cache_section(cluster: Cluster, client: Http, s: Settings) -> Section:
    preset = s.cache_preset
    prefix = cluster.deploy("cached", bind(app_args(preset, 1, feature_cache_bytes=256 << 20)))
    encode = Encode(client, prefix, [])

    def latency(images: list[bytes]) -> float:
        body = json_body(images)
        start = time.perf_counter()
        client.post(encode.path, body, "application/json")
        return time.perf_counter() - start

    miss, hit = [], []
    for k in range(s.cache_images):  # miss, then hit, image after image
        images = [image(640, 480, seed=5000 + k)]
        miss.append(latency(images) * 1e3)
        hit.append(min(latency(images) for _ in range(3)) * 1e3)
    catalog = [image(*MIX[k % len(MIX)], seed=6000 + k) for k in range(50)]
    rng = np.random.default_rng(0)
    draws = [min(int(rng.zipf(1.1)), len(catalog)) - 1 for _ in range(s.zipf_draws)]
    before = encode.info()["ranks"][0]["cache_hits"]
    for d in draws:
        latency([catalog[d]])
    hits = encode.info()["ranks"][0]["cache_hits"] - before
    cluster.delete("cached")
    rows = [
        ["first request (miss), ms", spread(miss).fmt(1)],
        ["same image again (hit, best of 3), ms", spread(hit).fmt(1)],
        ["**speed-up** (per image: miss / hit)", f"**{ratio(miss, hit).fmt(1, 'x')}**"],
        [
            f"Zipf(1.1) over 50 images, {len(draws)} requests: hit rate",
            f"{hits / len(draws):.2f} (distinct: {len(set(draws))})",
        ],
    ]
    return Section(
        "Feature cache (target: hit >= 10x faster)",
        COMMAND.format(part="cache"),
        [
            f"Preset {preset}, dp 1, one 640x480 image per request; {s.cache_images} images, "
            "each sent once (a miss) and then three times (hits).",
            table(["measure", "value"], rows),
        ],
    )


# --- latency vs offered load ----------------------------------------------------------


def open_loop(encode: Encode, rate: float, seconds: float, seed: int) -> list[float]:
    """Latencies (ms) of Poisson arrivals at ``rate`` requests/s for ``seconds``; NaN for a
    failed request (overload past the timeout: counted, not fatal)."""

    def one(k: int) -> float:
        start = time.perf_counter()
        try:
            encode.send(k)
        except Exception:  # noqa: BLE001 - a failure is a data point here
            return float("nan")
        return (time.perf_counter() - start) * 1e3

    rng = np.random.default_rng(seed)
    futures = []
    with cf.ThreadPoolExecutor(64) as pool:
        start = time.perf_counter()
        t, k = 0.0, 0
        while t < seconds:
            delay = start + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, k))
            k += 1
            t += rng.exponential(1 / rate)
        return [f.result() for f in futures]


def latency_section(cluster: Cluster, client: Http, run: PresetRun, s: Settings) -> Section:
    stream = request_stream(24)
    saturated = spread(run.rates(SETUPS[1])).median
    curves = {}
    for dp, app in run.apps.items():
        encode = Encode(client, f"/{app}", stream)
        points = []
        for j, f in enumerate(s.latency_fractions):
            rate = f * saturated / PER_REQUEST
            lat = np.asarray(open_loop(encode, rate, s.latency_window_s, seed=j))
            failed = int(np.isnan(lat).sum())
            assert failed < len(lat), f"every request failed at {rate:.2f} req/s"
            ok = lat[~np.isnan(lat)]
            points.append((rate * PER_REQUEST, *np.percentile(ok, [50, 95, 99]), failed))
        curves[dp] = points
    note = (
        f"Preset {run.preset}; open-loop Poisson arrivals for {s.latency_window_s:g} s per "
        f"point at fractions {list(s.latency_fractions)} of served dp 1's median saturated "
        f"rate ({saturated:.2f} images/s); {PER_REQUEST} images per request."
    )
    png = latency_plot(curves, note)
    return Section(
        "Latency vs offered load",
        COMMAND.format(part="latency"),
        [note, f"![latency vs load]({png})", table(LATENCY_HEADER, latency_rows(curves))],
    )


LATENCY_HEADER = ["dp", "offered images/s", "p50 ms", "p95 ms", "p99 ms", "failed"]


def knee(points) -> int | None:
    base = points[0][2]
    return next((i for i, p in enumerate(points) if p[2] > 2 * base), None)


def latency_rows(curves) -> list[list]:
    rows = []
    for dp, points in curves.items():
        k = knee(points)
        for i, (rate, p50, p95, p99, failed) in enumerate(points):
            mark = " (knee)" if i == k else ""
            rows.append([dp, f"{rate:.2f}{mark}", f"{p50:.0f}", f"{p95:.0f}", f"{p99:.0f}", failed])
    return rows


def latency_plot(curves, note: str) -> str:
    from .common import pyplot, save_plot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), sharey=True)
    for ax, (dp, points) in zip(np.atleast_1d(axes), curves.items(), strict=True):
        rates = [p[0] for p in points]
        for col, label in ((1, "p50"), (2, "p95"), (3, "p99")):
            ax.plot(rates, [p[col] for p in points], marker="o", label=label)
        k = knee(points)
        if k is not None:
            ax.axvline(rates[k], color="gray", linestyle="--", label="knee")
        ax.set_title(f"dp {dp}")
        ax.set_xlabel("offered load (images/s)")
        ax.set_yscale("log")
        ax.legend()
    np.atleast_1d(axes)[0].set_ylabel("latency (ms)")
    fig.suptitle(note, fontsize=7, wrap=True)
    path = save_plot(fig, "latency_vs_load.png")
    plt.close(fig)
    return path


# --- entry points ---------------------------------------------------------------------


def sections(quick: bool, only: tuple[str, ...] = PARTS) -> list[Section]:
    s = Settings.of(quick)
    out: list[Section] = []
    with Cluster() as cluster:
        client = Http(cluster.port)
        runs = []
        if "throughput" in only or "latency" in only:
            for preset in s.presets:
                runs.append(measure_preset(cluster, client, preset, s))
                if preset == s.latency_preset and "latency" in only:
                    latency = latency_section(cluster, client, runs[-1], s)
                for name in runs[-1].apps.values():
                    cluster.delete(name)
        if "throughput" in only:
            machine_cores = os.cpu_count() or 1
            out += [
                overhead_section(runs, s, machine_cores),
                scaling_section(runs, s, machine_cores),
            ]
            out.append(cpu_section(runs, s))
        if "cache" in only:
            out.append(cache_section(cluster, client, s))
        if "latency" in only:
            out.append(latency)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    return standalone(__doc__, lambda a: sections(a.quick, tuple(a.only)), argv, parser)


if __name__ == "__main__":
    sys.exit(main())
