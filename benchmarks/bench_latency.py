"""How latency grows with offered load, dp 1 and dp 2.

    python -m benchmarks.bench_latency [--quick]

Two served apps of one preset (full run: small; quick: tiny), dp 1 and dp 2,
cache off, each rank one logical CPU and one torch thread. First served dp 1's
saturated rate: closed-loop windows of ``CLIENTS`` clients, their median. Then
open-loop Poisson arrivals at fractions of that rate, on each app in turn; the
knee is the first load whose p95 is over twice the lightest load's.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time
from dataclasses import dataclass

import numpy as np

from .common import Section, spread, table
from .page import pyplot, save_plot, standalone
from .serving import CLIENTS, PER_REQUEST, Cluster, Encode, bench_args, closed_loop, request_stream


@dataclass(frozen=True)
class Settings:
    preset: str
    saturation_windows: int  # closed-loop windows measuring served dp 1's saturated rate
    saturation_window_s: float
    fractions: tuple[float, ...]
    window_s: float

    @classmethod
    def of(cls, quick: bool) -> Settings:
        if quick:
            return cls("tiny", 3, 3.0, (0.2, 0.5, 0.8, 1.0, 1.3), 4.0)
        return cls("small", 5, 10.0, (0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.4), 8.0)


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


def sections(quick: bool) -> list[Section]:
    s = Settings.of(quick)
    stream = request_stream(24)
    curves = {}
    with Cluster() as cluster:
        encodes = {}
        for dp in (1, 2):
            app = bench_args(s.preset, dp, feature_cache_bytes=0)
            encodes[dp] = cluster.encode(f"{s.preset}-dp{dp}", app, stream)
            encodes[dp].send(0)  # warm-up
        windows = [
            closed_loop(encodes[1].send, CLIENTS, s.saturation_window_s)
            for _ in range(s.saturation_windows)
        ]
        saturated = spread([w.images_per_s for w in windows]).median
        for dp, encode in encodes.items():
            points = []
            for j, f in enumerate(s.fractions):
                rate = f * saturated / PER_REQUEST
                lat = np.asarray(open_loop(encode, rate, s.window_s, seed=j))
                failed = int(np.isnan(lat).sum())
                assert failed < len(lat), f"every request failed at {rate:.2f} req/s"
                ok = lat[~np.isnan(lat)]
                points.append((rate * PER_REQUEST, *np.percentile(ok, [50, 95, 99]), failed))
            curves[dp] = points
    note = (
        f"Preset {s.preset}; open-loop Poisson arrivals for {s.window_s:g} s per point at "
        f"fractions {list(s.fractions)} of served dp 1's median saturated rate "
        f"({saturated:.2f} images/s, {s.saturation_windows} closed-loop windows of "
        f"{s.saturation_window_s:g} s, {CLIENTS} clients); {PER_REQUEST} images per request."
    )
    png = latency_plot(curves, note)
    return [
        Section(
            "Latency vs offered load",
            "python -m benchmarks.bench_latency",
            [note, f"![latency vs load]({png})", table(HEADER, latency_rows(curves))],
        )
    ]


HEADER = ["dp", "offered images/s", "p50 ms", "p95 ms", "p99 ms", "failed"]


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


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
