"""What a replica holds, asked from outside while the soak runs (``bench_soak --probe``).

A driver joins the soak's Ray cluster and runs these functions inside each replica of
the app through Ray's ``__ray_call__`` (a function called with the actor instance):

- ``heap_start`` / ``heap_top``: tracemalloc from the end of the warm-up, then the
  allocation sites whose live bytes grew most since (the diff of two snapshots);
- ``structures``: the length of every dict, list, deque and set reachable from the
  replica's deployment object through our own classes (``deployments.*``,
  ``kimi_encoder.*``), by attribute path, and the bytes of every byte-bounded cache;
- ``mappings``: private anonymous memory in glibc's main heap, in the other anonymous
  mappings and in private file pages, and the number of pymalloc arenas and threads;
- ``allocator``: glibc's ``mallinfo2`` (bytes in use, free in the heaps, in mmapped
  blocks, the main heap's size) and the number of malloc arenas (``malloc_info``);
  ``trim`` calls ``malloc_trim(0)`` and says what it gave back.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import os
import re
import tempfile
import tracemalloc
from collections import Counter

import psutil

OURS = ("deployments", "kimi_encoder")
FRAMES = 12


def attach(root_pid: int) -> None:
    """``ray.init`` into the cluster whose GCS runs under ``root_pid``."""
    import ray

    for proc in psutil.Process(root_pid).children(recursive=True):
        for arg in proc.cmdline():
            found = re.match(r"--gcs-address=(\S+:\d+)$", arg)
            if found:
                ray.init(
                    address=found.group(1),
                    namespace="serve",
                    log_to_driver=False,
                    logging_level="ERROR",
                )
                return
    raise RuntimeError(f"no raylet (--gcs-address) under pid {root_pid}")


def replicas(app: str) -> dict[str, object]:
    """Actor handles of ``app``'s replicas, by deployment name (and a count where several)."""
    import ray

    found = [
        actor
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("SERVE_REPLICA::") and f"{app}#" in actor["name"]
    ]
    count = Counter(actor["name"].split("#")[1] for actor in found)
    out: dict[str, object] = {}
    for actor in sorted(found, key=lambda a: a["name"]):
        _, deployment, replica = actor["name"].split("#")
        key = deployment if count[deployment] == 1 else f"{deployment} {replica}"
        out[key] = ray.get_actor(actor["name"], namespace=actor["namespace"])
    return out


def call(handles: dict[str, object], fn, *args) -> dict[str, object]:
    import ray

    refs = {name: h.__ray_call__.remote(fn, *args) for name, h in handles.items()}
    return {name: ray.get(ref, timeout=120) for name, ref in refs.items()}


def _user(actor) -> object:
    return actor._replica_impl._user_callable_wrapper.user_callable


def heap_start(actor) -> int:
    tracemalloc.start(FRAMES)
    actor.__dict__["_soak_heap"] = tracemalloc.take_snapshot()
    return os.getpid()


def heap_top(actor, count: int = 12) -> list[str]:
    before = actor.__dict__.get("_soak_heap")
    if before is None:
        return ["tracemalloc not started"]
    now = tracemalloc.take_snapshot()
    stats = now.compare_to(before, "traceback")
    total = sum(s.size_diff for s in stats)
    lines = [f"total {total / 2**20:+.2f} MiB traced since the start"]
    for stat in stats[:count]:
        frames = [
            f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno}" for f in stat.traceback
        ]
        lines.append(
            f"{stat.size_diff / 2**20:+.3f} MiB {stat.count_diff:+d} blocks: "
            + " <- ".join(frames[-1:-5:-1] if len(frames) > 4 else frames[::-1])
        )
    return lines


def _ours(obj) -> bool:
    return type(obj).__module__.split(".")[0] in OURS


CONTAINERS = (dict, list, collections.deque, set)


def _children(path: str, obj) -> list[tuple[str, object]]:
    """What the walk goes on to from ``obj``: a container's first items, our objects'
    attributes."""
    if isinstance(obj, (*CONTAINERS, tuple)):
        items = list(obj.values() if isinstance(obj, dict) else obj)[:8]
        pairs = [(f"{path}[{i}]", value) for i, value in enumerate(items)]
    else:
        pairs = [(f"{path}.{k}", v) for k, v in getattr(obj, "__dict__", {}).items()]
    return [(p, v) for p, v in pairs if _ours(v) or isinstance(v, (*CONTAINERS, tuple))]


def structures(actor, limit: int = 400) -> dict[str, int]:
    """``path -> len`` of the containers reachable from the deployment object through our
    classes; every table and feature cache of the process (entries, bytes); the number of
    objects the garbage collector tracks, by type."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    todo = [("self", _user(actor), 0)]
    while todo and len(out) < limit:
        path, obj, depth = todo.pop()
        if id(obj) in seen or depth > 7:
            continue
        seen.add(id(obj))
        if isinstance(obj, CONTAINERS):
            out[path] = len(obj)
        todo += [(p, v, depth + 1) for p, v in _children(path, obj)]
    objects = gc.get_objects()
    for i, obj in enumerate(
        o for o in objects if type(o).__name__ in ("TableCache", "FeatureCache")
    ):
        stats = getattr(obj, "stats", obj)
        out[f"{type(obj).__name__}#{i}.entries"] = len(
            getattr(obj, "_tables", getattr(obj, "_data", ()))
        )
        out[f"{type(obj).__name__}#{i}.bytes"] = stats.bytes
    counts = collections.Counter(type(o).__name__ for o in objects)
    out.update({f"gc:{name}": n for name, n in counts.most_common(12)})
    out["gc:objects"] = len(objects)
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def allocator(actor=None) -> dict[str, float]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    mib = 2**20
    out = {
        "heap_main_mib": info.arena / mib,
        "in_use_mib": info.uordblks / mib,
        "free_in_heaps_mib": info.fordblks / mib,
        "mmapped_mib": info.hblkhd / mib,
        "free_chunks": info.ordblks,
    }
    with tempfile.TemporaryFile() as f:
        libc.fdopen.restype = ctypes.c_void_p
        fp = ctypes.c_void_p(libc.fdopen(os.dup(f.fileno()), b"w"))
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        f.seek(0)
        xml = f.read().decode()
    out["arenas"] = xml.count("<heap nr=")
    sizes = re.findall(r'<system type="current" size="(\d+)"/>', xml)
    out["arena_bytes_mib"] = sum(int(s) for s in sizes[:-1]) / mib
    out["env_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
    return out


def _pymalloc_arenas() -> int:
    """Python's small-object allocator's arenas in use (``sys._debugmallocstats``, which
    writes to the C stderr: read through a file put there for the call)."""
    import sys

    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        found = re.search(rb"# arenas allocated current\s*=\s*([\d,]+)", f.read())
    return int(found.group(1).replace(b",", b"")) if found else -1


def mappings(actor=None) -> dict[str, float]:
    """This process's private anonymous memory (MiB, ``/proc/self/smaps``) in glibc's main
    heap (``[heap]``), in other anonymous mappings (glibc's other arenas, Python's 1 MiB
    small-object arenas, thread stacks, torch's and Ray's own: the kernel merges
    neighbours, so their sizes do not say which is which) and in private file pages; the
    number of pymalloc arenas (1 MiB each) and of threads."""
    kinds: Counter = Counter()
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                name = head[5] if len(head) > 5 else ""
            elif head[0] == "Anonymous:" and int(head[1]):
                if name == "[heap]":
                    kind = "main heap"
                elif name and not name.startswith("["):
                    kind = "file-backed (private)"
                else:
                    kind = "anonymous mappings"
                kinds[kind] += int(head[1])
    out = {f"{kind} MiB": kib / 1024 for kind, kib in sorted(kinds.items())}
    out["pymalloc arenas"] = _pymalloc_arenas()
    out["threads"] = len(os.listdir("/proc/self/task"))
    return out


def rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def trim(actor=None) -> dict[str, float]:
    """``malloc_trim(0)`` here, and this process's RssAnon before and after it."""
    before = rss_anon_mib()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return {"before_mib": before, "after_mib": rss_anon_mib()}


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.soak_probe ROOT_PID APP``: trim every replica of APP in the
    cluster under ROOT_PID and print their RssAnon after it (MiB) as one JSON line."""
    import json
    import sys

    root, app = (argv or sys.argv[1:])[:2]
    attach(int(root))
    print(json.dumps({name: row["after_mib"] for name, row in call(replicas(app), trim).items()}))


if __name__ == "__main__":
    main()
