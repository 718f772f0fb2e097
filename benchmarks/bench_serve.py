"""What serving costs over the encoder in-process, and how it scales with dp.

    python -m benchmarks.bench_serve [--quick]

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

Real Ray Serve over HTTP on this machine. ``--only cache`` and ``--only latency``
run ``bench_cache`` and ``bench_latency``, which once were parts of this module.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from . import cpu
from .common import Section, Spread, alternate, line_through, ratio, spread, table
from .direct import DirectWorkers
from .page import arguments, standalone
from .serving import (
    CLIENTS,
    MIX,
    PER_REQUEST,
    Cluster,
    Encode,
    Http,
    Window,
    bench_args,
    bind,
    closed_loop,
    request_stream,
    server_failed,
)

PARTS = ("throughput", "cache", "latency")  # --only: this module's, bench_cache's, bench_latency's
COMMAND = "python -m benchmarks.bench_serve --only throughput"


@dataclass(frozen=True)
class Settings:
    presets: tuple[str, ...]
    repeats: int
    window_s: dict[str, float]  # per preset: long enough for a dozen requests at dp 1
    split_presets: tuple[str, ...] = ("tiny",)  # also run dp 1 with LARGE images per request

    @classmethod
    def of(cls, quick: bool) -> Settings:
        if quick:
            return cls(presets=("tiny",), repeats=3, window_s={"tiny": 3.0})
        return cls(presets=("tiny", "small"), repeats=5, window_s={"tiny": 6.0, "small": 10.0})


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
        prefix = cluster.deploy(name, bind(bench_args(preset, dp, feature_cache_bytes=0)))
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


# --- sections -------------------------------------------------------------------------


def overhead_section(runs: list[PresetRun], s: Settings, machine_cores: int) -> Section:
    rows, notes = [], []
    for run in runs:
        direct, served = spread(run.rates(SETUPS[0])), spread(run.rates(SETUPS[1]))
        windows = run.windows[SETUPS[1]]
        ms = cpu.cpu_ms(windows, run.apps[1])
        around = sum(ms[k].median for k in cpu.AROUND if k in ms)
        rows.append(
            [
                run.preset,
                direct.fmt(1),
                served.fmt(1),
                f"**{run.ratio(SETUPS[1], SETUPS[0]).fmt(2)}**",
                f"{1e3 / direct.median:.1f}",
                ms["rank 0"].fmt(1),
                f"{around:.1f}",
                spread([cpu.bound(w, run.apps[1], machine_cores) for w in windows]).fmt(1),
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
        COMMAND,
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
        limit = [cpu.bound(w, app2, machine_cores) for w in w2]
        free2 = [
            min(cpu.bound(w, app2, machine_cores, True) / cpu.bound(w, app2, machine_cores), 2)
            for w in w2
        ]
        free1 = [
            min(cpu.bound(w, app1, machine_cores, True) / cpu.bound(w, app1, machine_cores), 2)
            for w in w1
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
                " / ".join(cpu.cores(w2, app2, f"rank {r}").fmt(2) for r in (0, 1)),
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
        COMMAND,
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
        columns = {dp: cpu.cpu_ms(run.windows[SETUPS[dp]], run.apps[dp]) for dp in (1, 2)}
        names = sorted({n for c in columns.values() for n in c}, key=_order)
        rows = [
            [name] + [columns[dp][name].fmt(1) if name in columns[dp] else "–" for dp in (1, 2)]
            for name in names
        ]
        rows.append(
            ["**all of ours**"]
            + [
                f"**{sum(c[n].median for n in c if n != cpu.OUTSIDE):.1f}**"
                for c in columns.values()
            ]
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
    return Section("Where the CPU goes", COMMAND, parts)


def split_per_request(run: PresetRun) -> list[str]:
    """Each process's CPU as a cost per request plus a cost per image, from served dp 1
    with PER_REQUEST and with LARGE images per request (c(k) = per image + per request / k)."""
    small = cpu.cpu_ms(run.windows[SETUPS[1]], run.apps[1])
    large = cpu.cpu_ms(run.windows[BATCHED], run.apps[1])
    rows = []
    for name in sorted((set(small) | set(large)) - {cpu.OUTSIDE}, key=_order):
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
    first = ["rank 0", "rank 1", *cpu.AROUND]
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


# --- entry points ---------------------------------------------------------------------


def sections(quick: bool) -> list[Section]:
    s = Settings.of(quick)
    runs = []
    with Cluster() as cluster:
        client = Http(cluster.port)
        for preset in s.presets:
            runs.append(measure_preset(cluster, client, preset, s))
            for name in runs[-1].apps.values():
                cluster.delete(name)
    machine_cores = os.cpu_count() or 1
    return [
        overhead_section(runs, s, machine_cores),
        scaling_section(runs, s, machine_cores),
        cpu_section(runs, s),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--only", nargs="+", choices=PARTS, default=["throughput"])

    def make(args) -> list[Section]:
        from . import bench_cache, bench_latency

        parts = {"throughput": sections, "cache": bench_cache.sections}
        parts["latency"] = bench_latency.sections
        return [section for part in args.only for section in parts[part](args.quick)]

    return standalone(__doc__, make, argv, parser)


if __name__ == "__main__":
    sys.exit(main())
