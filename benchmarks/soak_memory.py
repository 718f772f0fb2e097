"""The soak's memory readings: private anonymous memory of every process of the server,
sampled in a thread; what a replica holds, read through ``soak_probe`` after warm-up and
at the end; the growth and slope figures ``bench_soak`` checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import psutil

from .checkout import ROOT, pythonpath
from .cpu import role

MIB = 1 << 20
GROWTH_MIB, GROWTH_SHARE, SLOPE_MIB_PER_MIN = 16.0, 0.05, 1.0


def rss_anon(pid: int) -> int | None:
    """Private anonymous resident bytes of ``pid`` (None: gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def label(proc: psutil.Process) -> str:
    try:
        cmdline = " ".join(proc.cmdline())
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    found = role(cmdline)
    if found.startswith("replica "):
        return found.removeprefix("replica ").partition(":")[2] or found
    if found.startswith("Ray system"):
        return "ray " + (cmdline.split()[0].rsplit("/", 1)[-1] if "python" in name else name)
    return found


class Sampler:
    """``RssAnon`` of every descendant of ``root`` every ``every_s`` seconds, in a thread;
    two processes of one label (the two ingress replicas) are told apart by their pid."""

    def __init__(self, root: int, every_s: float = 5.0):
        self.root, self.every_s = root, every_s
        self.series: dict[int, list[tuple[float, float]]] = {}  # pid -> (t, MiB)
        self.labels: dict[int, str] = {}
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        try:
            procs = psutil.Process(self.root).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            value = rss_anon(proc.pid)
            if value is None:
                continue
            if proc.pid not in self.labels:
                self.labels[proc.pid] = label(proc)
            self.series.setdefault(proc.pid, []).append((now, value / MIB))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def named(self) -> dict[str, list[tuple[float, float]]]:
        """Series by label, ``label (pid)`` where a label has several processes."""
        count = Counter(self.labels.values())
        return {
            (name if count[name] == 1 else f"{name} ({pid})"): self.series[pid]
            for pid, name in sorted(self.labels.items(), key=lambda kv: kv[1])
        }


def at(series: list[tuple[float, float]], t: float, span_s: float) -> float:
    """Median of the samples in ``[t - span_s, t]`` (the nearest one if none)."""
    values = [v for s, v in series if t - span_s <= s <= t]
    if not values:
        return min(series, key=lambda sv: abs(sv[0] - t))[1]
    return float(np.median(values))


def slope_per_min(series: list[tuple[float, float]], t0: float) -> float:
    """Least-squares slope of the samples from ``t0`` on, in MiB per minute."""
    points = [(s, v) for s, v in series if s >= t0]
    if len(points) < 3:
        return 0.0
    x, y = np.array(points).T
    return float(np.polyfit(x / 60.0, y, 1)[0]) + 0.0


def memory(series_by_name: dict, seconds: float, span_s: float) -> dict[str, dict]:
    """Per process: MiB after warm-up and at the end, growth, bound, slope, pass."""
    out = {}
    for name, series in series_by_name.items():
        if not series or series[0][0] > seconds / 3 or series[-1][0] < seconds * 0.9:
            continue  # not there for the whole measured span
        warm, end = at(series, seconds / 3, span_s), at(series, seconds, span_s)
        bound = max(GROWTH_MIB, GROWTH_SHARE * warm)
        slope = slope_per_min(series, seconds / 2)
        out[name] = {
            "warm_mib": round(warm, 1),
            "end_mib": round(end, 1),
            "growth_mib": round(end - warm, 1),
            "bound_mib": round(bound, 1),
            "slope_mib_per_min": round(slope, 2),
            "ok": end - warm <= bound and slope <= SLOPE_MIB_PER_MIN,
        }
    return out


def look(root_pid: int, app: str, start: bool) -> dict:
    """What ``soak_probe`` reads in each replica of ``app`` (tracemalloc started if ``start``)."""
    import ray

    from . import soak_probe as sp

    if not ray.is_initialized():
        sp.attach(root_pid)
    try:
        handles = sp.replicas(app)
        out = {
            "structures": sp.call(handles, sp.structures),
            "allocator": sp.call(handles, sp.allocator),
            "mappings": sp.call(handles, sp.mappings),
        }
        out["heap"] = sp.call(handles, sp.heap_start if start else sp.heap_top)
    except Exception as exc:  # noqa: BLE001 (the soak goes on; the report says what failed)
        return {"error": f"{type(exc).__name__}: {exc}"}
    return out


def trimmed(root_pid: int, app: str) -> dict[str, float]:
    """RssAnon (MiB) of each replica of ``app`` right after a ``malloc_trim(0)`` in it: what
    it holds without the free pages of the last few seconds' work (the replicas trim every
    ``malloc_trim_s`` anyway; a sample between two trims also counts what a batch freed)."""
    # In a process of its own: this one may already be a driver of another cluster (a test
    # session's).
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak_probe", str(root_pid), app],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath(), "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
        text=True,
        check=True,
        timeout=180,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def trimmed_growth(warm: dict[str, float], end: dict[str, float]) -> dict[str, dict]:
    """Per replica: trimmed RssAnon after warm-up and at the end, growth, bound, pass."""
    out = {}
    for name in sorted(set(warm) & set(end)):
        bound = max(GROWTH_MIB, GROWTH_SHARE * warm[name])
        growth = end[name] - warm[name]
        out[name] = {
            "warm_mib": round(warm[name], 1),
            "end_mib": round(end[name], 1),
            "growth_mib": round(growth, 1),
            "bound_mib": round(bound, 1),
            "ok": growth <= bound,
        }
    return out


def trim_loop(root_pid: int, app: str, every_s: float, stop: threading.Event) -> None:
    """``malloc_trim(0)`` in every replica of ``app`` every ``every_s`` (from outside: to
    measure what trimming would do before a replica does it itself)."""
    import ray

    from . import soak_probe as sp

    if not ray.is_initialized():
        sp.attach(root_pid)
    handles = sp.replicas(app)
    while not stop.wait(every_s):
        sp.call(handles, sp.trim)


def changes(looked: dict) -> dict:
    """Per replica: the structures whose length changed, the allocator then and now, and
    the heap's growing sites."""
    warm, end = looked["warm"], looked.get("end", {})
    if "error" in warm or "error" in end:
        return {"error": warm.get("error") or end.get("error")}
    out = {}
    for name, sizes in end["structures"].items():
        before = warm["structures"].get(name, {})
        out[name] = {
            "grew": {k: (before.get(k), v) for k, v in sizes.items() if before.get(k) != v},
            "allocator": (warm["allocator"].get(name), end["allocator"][name]),
            "mappings": (warm["mappings"].get(name), end["mappings"][name]),
            "heap": end["heap"][name],
        }
    return out
