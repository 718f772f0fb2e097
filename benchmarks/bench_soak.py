"""Soak: memory of every process under a long mixed load, with every answer checked.

    python -m benchmarks.bench_soak [--minutes 30] [--clients 6] [--caches small|default|off]
                                    [--tunables T] [--json OUT]

``serve run`` of configs/config.yaml as shipped (two ingress replicas, dp 2, tiny
preset on CPU) on a free loopback port, and ``clients`` closed-loop clients for
``minutes``, sending benchmarks/soak_mix.py's requests: 1 to 4 images, unique random
shapes 16 to 700 px a side in PNG, JPEG and WebP of four modes, a third repeated, one
request in ten bad. ``--caches small`` sets the rank cache to 4 MiB and the ingress
cache to 2 MiB, so that both evict throughout; ``default`` keeps the config's
(rank 256 MiB, ingress off); ``off`` turns both off. ``--tunables`` sets the app's
``glibc_tunables`` (the allocator's settings in its replicas) instead of the default.

Every few seconds it reads each process's private anonymous memory (``RssAnon`` in
``/proc/PID/status``) for every process of the server (Ray's included). Reported per
process: the value at the end of the first third (warm-up) and at the end, the growth
between them, and the slope of a least-squares line over the last half (MiB/min). The
bounds it checks: growth at most max(16 MiB, 5%) of the value after warm-up, slope at
most 1 MiB/min, every good request answered with its images' features (the in-process
encoder's, within 1e-5), every bad one a 4xx, nothing lost, and the p99 latency of the
last third at most 1.5x that of the second.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .checkout import ROOT
from .common import Section, table
from .page import arguments, pyplot, save_plot, standalone
from .served import ServeRun, served_config
from .serving import free_port
from .soak_memory import Sampler, changes, look, memory, trim_loop, trimmed, trimmed_growth
from .soak_mix import Checker, Mix, Outcome, client

MIB = 1 << 20
P99_RATIO = 1.5
CACHES = {
    "small": {"feature_cache_bytes": 4 * MIB, "ingress_cache_bytes": 2 * MIB},
    "default": {},
    "off": {"feature_cache_bytes": 0, "ingress_cache_bytes": 0},
}


# --- the load ---------------------------------------------------------------------------


def p99_ms(done: list[tuple[float, float]], lo: float, hi: float) -> float:
    values = [lat for t, lat in done if lo <= t < hi]
    return round(float(np.percentile(values, 99)) * 1e3, 1) if values else float("nan")


def soak(
    url: str,
    root_pid: int,
    minutes: float,
    clients: int,
    seed: int,
    every_s: float,
    probe: str | None = None,
    trim_every_s: float = 0.0,
    trimmed_app: str | None = None,
):
    """Run the load against ``url`` while sampling the processes under ``root_pid``;
    ``probe``: the app whose replicas ``soak_probe`` looks into after warm-up and at the
    end; ``trimmed_app``: the app whose replicas' RssAnon is also read right after a
    ``malloc_trim`` then (``soak_memory.trimmed``: without the last seconds' free pages)."""
    checker = Checker()
    seconds = minutes * 60
    sampler = Sampler(root_pid, every_s)
    t0 = time.monotonic()
    sampler.start(t0)
    total = Outcome()
    results: list[Outcome] = []
    threads = [
        threading.Thread(
            target=lambda k=k: results.append(
                client(url, Mix(seed * 1000 + k), checker, t0, t0 + seconds)
            )
        )
        for k in range(clients)
    ]
    for thread in threads:
        thread.start()
    stop_trims = threading.Event()
    if trim_every_s and probe:
        trims = threading.Thread(target=trim_loop, args=(root_pid, probe, trim_every_s, stop_trims))
        trims.start()
    looked, trims = {}, {}
    if probe or trimmed_app:
        threads[0].join(timeout=seconds / 3)
    if probe:
        looked["warm"] = look(root_pid, probe, start=True)
    if trimmed_app:
        trims["warm"] = trimmed(root_pid, trimmed_app)
    for thread in threads:
        thread.join()
    stop_trims.set()
    if probe and "error" not in looked["warm"]:
        looked["end"] = look(root_pid, probe, start=False)
    if trimmed_app:
        trims["end"] = trimmed(root_pid, trimmed_app)
    sampler.stop()
    elapsed = time.monotonic() - t0
    for one in results:
        total.tally.merge(one.tally)
        total.bad_4xx.update(one.bad_4xx)
        total.bad_not_4xx += one.bad_not_4xx
        total.done += one.done
    tally = total.tally
    second = p99_ms(total.done, elapsed / 3, 2 * elapsed / 3)
    last = p99_ms(total.done, 2 * elapsed / 3, elapsed + 1)
    figures = {
        "minutes": round(elapsed / 60, 1),
        "clients": clients,
        "requests_ok": tally.ok,
        "images_ok": tally.images,
        "wrong": tally.wrong,
        "lost": tally.lost,
        "unexpected_5xx": tally.unexpected_5xx,
        "unexpected_4xx": tally.unexpected_4xx,
        "retried_503": tally.retried_503,
        "bad_4xx": dict(total.bad_4xx),
        "bad_not_4xx": len(total.bad_not_4xx),
        "p99_second_third_ms": second,
        "p99_last_third_ms": last,
        "p99_ratio": round(last / second, 2),
        "problems": (tally.problems + total.bad_not_4xx)[:10],
        "probe": changes(looked) if looked else None,
        "trimmed": trimmed_growth(trims["warm"], trims["end"]) if trims else None,
        "memory": memory(sampler.named(), elapsed, max(3 * every_s, elapsed / 30)),
        "series": {
            k: [(round(t, 1), round(v, 2)) for t, v in s] for k, s in sampler.named().items()
        },
    }
    figures["ok"] = passed(figures)
    return figures


def passed(f: dict) -> bool:
    answers = f["wrong"] + f["lost"] + f["unexpected_5xx"] + f["unexpected_4xx"] == 0
    return (
        answers
        and f["bad_not_4xx"] == 0
        and f["p99_ratio"] <= P99_RATIO
        and all(row["ok"] for row in f["memory"].values())
    )


def served(
    minutes: float,
    caches: str,
    tunables: str | None,
    clients: int,
    seed: int,
    every_s: float,
    probe: bool = False,
    trim_every_s: float = 0.0,
    trimmed: bool = False,
    config: Path = ROOT / "configs" / "config.yaml",
) -> dict:
    """The soak against ``serve run`` of ``config`` with ``caches`` and ``tunables``."""
    fields = dict(CACHES[caches])
    if tunables is not None:
        fields["glibc_tunables"] = tunables
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="soak-"))
    with ServeRun(
        served_config(config, port, {"soak": fields}), folder, folder / "serve.log"
    ) as run:
        run.wait_ready(300)
        url = f"http://127.0.0.1:{port}/soak"
        figures = soak(
            url,
            run.proc.pid,
            minutes,
            clients,
            seed,
            every_s,
            "soak" if probe or trim_every_s else None,
            trim_every_s,
            "soak" if trimmed else None,
        )
    figures |= {"caches": caches, "tunables": tunables, "app_fields": fields}
    return figures


# --- the report -------------------------------------------------------------------------


def plot(figures: dict, name: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for proc, series in figures["series"].items():
        if proc in figures["memory"] and series:
            t, v = zip(*series, strict=True)
            ax.plot(np.array(t) / 60, v, label=proc, linewidth=1)
    total = figures["minutes"]
    for mark in (total / 3, total / 2):
        ax.axvline(mark, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RssAnon (MiB)")
    ax.set_yscale("log")
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(f"RssAnon per process, caches {figures['caches']}")
    return save_plot(fig, name)


def section(figures: dict, command: str, image: str | None) -> Section:
    rows = [
        [
            name,
            r["warm_mib"],
            r["end_mib"],
            r["growth_mib"],
            r["bound_mib"],
            r["slope_mib_per_min"],
            "yes" if r["ok"] else "**no**",
        ]
        for name, r in figures["memory"].items()
    ]
    head = ["process", "MiB after 1/3", "MiB at end", "growth", "bound", "MiB/min, last half", "ok"]
    load = (
        f"{figures['requests_ok']} requests ({figures['images_ok']} images) answered right, "
        f"{figures['wrong']} wrong, {figures['lost']} lost, {figures['unexpected_5xx']} 5xx, "
        f"{figures['unexpected_4xx']} unexpected 4xx, {figures['retried_503']} retried 503s; "
        f"bad requests answered 4xx: {figures['bad_4xx']}, otherwise: "
        f"{figures['bad_not_4xx']}; p99 second third {figures['p99_second_third_ms']} ms, "
        f"last third {figures['p99_last_third_ms']} ms ({figures['p99_ratio']}x)."
    )
    parts = [load, table(head, rows)]
    if image:
        parts.append(f"![RssAnon per process]({image})")
    parts.append(f"Every bound held: **{'yes' if figures['ok'] else 'no'}**.")
    return Section(
        f"Soak: memory under a mixed load ({figures['minutes']} min, caches {figures['caches']})",
        command,
        parts,
    )


def parser() -> argparse.ArgumentParser:
    p = arguments(__doc__)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--caches", choices=sorted(CACHES), default="small")
    p.add_argument("--tunables", default=None, help="the app's glibc_tunables ('' : none)")
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures (and every sample) here")
    p.add_argument(
        "--trim-every",
        type=float,
        default=0.0,
        help="seconds between malloc_trim(0) calls made in each replica from outside",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="look into the replicas (benchmarks/soak_probe.py): tracemalloc, structures",
    )
    return p


def make(args: argparse.Namespace) -> list[Section]:
    minutes = 3.0 if args.quick and args.minutes == 30.0 else args.minutes
    figures = served(
        minutes,
        args.caches,
        args.tunables,
        args.clients,
        args.seed,
        args.every,
        args.probe,
        args.trim_every,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    summary = {k: v for k, v in figures.items() if k != "series"}
    print(json.dumps(summary, indent=1), flush=True)
    command = f"python -m benchmarks.bench_soak --minutes {args.minutes:g} --caches {args.caches}"
    return [section(figures, command, plot(figures, f"soak-{args.caches}.png"))]


def sections(quick: bool) -> list[Section]:
    return make(parser().parse_args(["--quick"] if quick else []))


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, make, argv, parser())


if __name__ == "__main__":
    sys.exit(main())
