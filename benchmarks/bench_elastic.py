"""Elastic ranks against fixed ranks: throughput at the same steady peak, and what a
scale-up costs.

    python -m benchmarks.bench_elastic [--quick]

One Ray cluster, four apps side by side (tiny preset, CPU ranks with one logical CPU and
one torch thread each, rank cache off so every image is work queued on a rank): for one
and for two ingress replicas, ``fixed`` with ``dp_size: 3`` and ``elastic`` with
``dp_size: {min: 1, max: 3}`` and the default ``scaling`` (with two replicas, both
follow the app's one scaler). Each repeat, for one then two ingress replicas:

1. Scale-up: the elastic app idle at one rank, ``CLIENTS`` closed-loop clients of four
   distinct images each start at once. From the first request on, the queue is beyond
   one rank's capacity; the times to the first answer from rank 1 and from rank 2 (their
   ``owner_rank``), and until ``/v1/info`` lists three ranks live.
2. Steady peak: a closed-loop window on the elastic app (three ranks live), then one on
   the fixed app: images/s, and their ratio.
3. The load stops; the time until the elastic app is back to one rank (the next repeat
   starts from there).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field

from .common import Section, ratio, spread, table
from .page import standalone
from .serving import Cluster, Encode, bench_args, closed_loop, request_stream

CLIENTS = 16
PER_REQUEST = 4
BOUND_S = 300  # longest a scale-up or scale-down is waited for


@dataclass(frozen=True)
class Settings:
    repeats: int
    window_s: float

    @classmethod
    def of(cls, quick: bool) -> Settings:
        return cls(1, 5.0) if quick else cls(3, 10.0)


INGRESS = (1, 2)  # ingress replicas of each pair of apps


@dataclass
class Figures:
    first_answer_s: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})
    three_live_s: list[float] = field(default_factory=list)
    back_to_one_s: list[float] = field(default_factory=list)
    elastic_images_per_s: list[float] = field(default_factory=list)
    fixed_images_per_s: list[float] = field(default_factory=list)


def wait(condition, what: str) -> float:
    """Seconds until ``condition()`` holds (polled every 0.25 s), at most ``BOUND_S``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > BOUND_S:
            raise TimeoutError(f"{what} not within {BOUND_S} s")
        time.sleep(0.25)
    return time.monotonic() - start


def scale_up(encode: Encode, figures: Figures) -> None:
    """Clients start at once on the idle elastic app; each answer's owners are noted."""
    first: dict[int, float] = {}
    stop = threading.Event()
    lock = threading.Lock()
    start = time.monotonic()

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            body, _ = encode.bodies[i % len(encode.bodies)]
            data, _ = encode.client.post(encode.path, body, "application/json")
            owners = {item["owner_rank"] for item in json.loads(data)["items"]}
            with lock:
                for rank in owners:
                    first.setdefault(rank, time.monotonic() - start)
            i += CLIENTS

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        figures.three_live_s.append(
            wait(lambda: encode.info()["ranks_live"] == [0, 1, 2], "3 ranks live")
        )
        wait(lambda: {1, 2} <= set(first), "answers from ranks 1 and 2")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    for rank in (1, 2):
        figures.first_answer_s[rank].append(first[rank])


def back_to_one(encode: Encode) -> bool:
    info = encode.info()
    states = [r["state"] for r in info["ranks"]]
    return info["ranks_live"] == [0] and states[1:] == ["parked", "parked"]


def sections(quick: bool) -> list[Section]:
    s = Settings.of(quick)
    stream = request_stream(48, PER_REQUEST)
    figures = {n: Figures() for n in INGRESS}
    scaling = {}
    with Cluster(logical_cpus=24) as cluster:
        encodes = {}
        for n in INGRESS:
            apps = {
                f"fixed{n}": bench_args("tiny", 3, feature_cache_bytes=0, ingress_replicas=n),
                f"elastic{n}": bench_args(
                    "tiny", {"min": 1, "max": 3}, feature_cache_bytes=0, ingress_replicas=n
                ),
            }
            for name, args in apps.items():
                encodes[name] = cluster.encode(name, args, stream)
            encodes[f"fixed{n}"].send(0)  # warm-up; an elastic app's first request: its ramp's
        for _ in range(s.repeats):
            for n in INGRESS:
                elastic, fixed, f = encodes[f"elastic{n}"], encodes[f"fixed{n}"], figures[n]
                wait(lambda e=elastic: back_to_one(e), "the elastic app at one rank")
                scale_up(elastic, f)
                for name, encode in (("elastic", elastic), ("fixed", fixed)):
                    window = closed_loop(encode.send, CLIENTS, s.window_s)
                    getattr(f, f"{name}_images_per_s").append(window.images_per_s)
                stopped = time.monotonic()
                wait(lambda e=elastic: back_to_one(e), "back to one rank")
                f.back_to_one_s.append(time.monotonic() - stopped)
        for n in INGRESS:
            scaling[n] = encodes[f"elastic{n}"].info()["scaling"]
    return [section(s, figures, scaling)]


def section(s: Settings, figures: dict[int, Figures], scaling: dict[int, dict]) -> Section:
    measures = [
        ("first answer from rank 1 after the load began, s", lambda f: f.first_answer_s[1]),
        ("first answer from rank 2 after the load began, s", lambda f: f.first_answer_s[2]),
        ("three ranks live after the load began, s", lambda f: f.three_live_s),
        ("back to one rank after the load stopped, s", lambda f: f.back_to_one_s),
        ("elastic, three ranks live: images/s", lambda f: f.elastic_images_per_s),
        ("fixed dp 3: images/s", lambda f: f.fixed_images_per_s),
    ]
    rows = [[name, *(spread(get(figures[n])).fmt(1) for n in INGRESS)] for name, get in measures]
    peaks = [ratio(f.elastic_images_per_s, f.fixed_images_per_s) for f in figures.values()]
    bold = [f"**{x.fmt(2, 'x')}**" for x in peaks]
    rows.append(["**elastic / fixed** at the steady peak", *bold])
    target = scaling[INGRESS[0]]["target_queue_s"]
    header = ["measure", *(f"{n} ingress replica{'s' if n > 1 else ''}" for n in INGRESS)]
    return Section(
        "Elastic ranks: scale-up and steady peak against fixed ranks (target: >= 0.95x)",
        "python -m benchmarks.bench_elastic",
        [
            f"Preset tiny, CPU ranks (one logical CPU, one torch thread each), rank cache off; "
            f"{CLIENTS} closed-loop clients of {PER_REQUEST} distinct images each (the "
            f"served benchmarks' mix, 224x224 to 640x480); {s.repeats} repeats, windows of "
            f"{s.window_s:g} s, one then two ingress replicas in each repeat. `elastic` is "
            f"`dp_size: {{min: 1, max: 3}}` with the default scaling (target_queue_s "
            f"{target:g} s; with two ingress replicas both follow the app's one scaler); "
            "`fixed` is `dp_size: 3` with as many ingress replicas. The load begins on the "
            "idle elastic app at one rank: its queue is beyond one rank's capacity from the "
            "first requests on, so the time to a new rank's first answer is "
            "`scaling.upscale_after_s` plus that rank's start (process, model, calibration).",
            table(header, rows),
        ],
    )


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
