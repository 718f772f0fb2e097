"""Elastic ranks against fixed ranks: throughput at the same steady peak, and what a
scale-up costs.

    python -m benchmarks.bench_elastic [--quick]

One Ray cluster, two apps side by side (tiny preset, CPU ranks with one logical CPU and
one torch thread each, rank cache off so every image is work queued on a rank):
``fixed`` with ``dp_size: 3`` and ``elastic`` with ``dp_size: {min: 1, max: 3}`` and
the default ``scaling``. Each repeat:

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
from .serving import (
    Cluster,
    Encode,
    Http,
    bench_args,
    bind,
    closed_loop,
    get_json,
    request_stream,
)

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
    figures = Figures()
    with Cluster() as cluster:
        client = Http(cluster.port)
        apps = {
            "fixed": bench_args("tiny", 3, feature_cache_bytes=0),
            "elastic": bench_args("tiny", {"min": 1, "max": 3}, feature_cache_bytes=0),
        }
        encodes = {
            name: Encode(client, cluster.deploy(name, bind(args)), stream)
            for name, args in apps.items()
        }
        encodes["fixed"].send(0)  # warm-up; the elastic app's first request is its ramp's
        for _ in range(s.repeats):
            wait(lambda: back_to_one(encodes["elastic"]), "the elastic app at one rank")
            scale_up(encodes["elastic"], figures)
            for name in ("elastic", "fixed"):
                window = closed_loop(encodes[name].send, CLIENTS, s.window_s)
                getattr(figures, f"{name}_images_per_s").append(window.images_per_s)
            stopped = time.monotonic()
            wait(lambda: back_to_one(encodes["elastic"]), "back to one rank")
            figures.back_to_one_s.append(time.monotonic() - stopped)
        scaling = get_json(client, "/elastic/v1/info")["scaling"]
    return [section(s, figures, scaling)]


def section(s: Settings, f: Figures, scaling: dict) -> Section:
    rows = [
        ["first answer from rank 1 after the load began, s", spread(f.first_answer_s[1]).fmt(1)],
        ["first answer from rank 2 after the load began, s", spread(f.first_answer_s[2]).fmt(1)],
        ["three ranks live after the load began, s", spread(f.three_live_s).fmt(1)],
        ["back to one rank after the load stopped, s", spread(f.back_to_one_s).fmt(1)],
        ["elastic, three ranks live: images/s", spread(f.elastic_images_per_s).fmt(1)],
        ["fixed dp 3: images/s", spread(f.fixed_images_per_s).fmt(1)],
        [
            "**elastic / fixed** at the steady peak",
            f"**{ratio(f.elastic_images_per_s, f.fixed_images_per_s).fmt(2, 'x')}**",
        ],
    ]
    return Section(
        "Elastic ranks: scale-up and steady peak against fixed ranks (target: >= 0.9x)",
        "python -m benchmarks.bench_elastic",
        [
            f"Preset tiny, CPU ranks (one logical CPU, one torch thread each), rank cache off; "
            f"{CLIENTS} closed-loop clients of {PER_REQUEST} distinct images each (the "
            f"served benchmarks' mix, 224x224 to 640x480); {s.repeats} repeats, windows of "
            f"{s.window_s:g} s. `elastic` is `dp_size: {{min: 1, max: 3}}` with the default "
            f"scaling (target_queue_s {scaling['target_queue_s']:g} s); `fixed` is "
            "`dp_size: 3`. The load begins on the idle elastic app at one rank: its queue is "
            "beyond one rank's capacity from the first requests on, so the time to a new "
            "rank's first answer is `scaling.upscale_after_s` plus that rank's start "
            "(process, model, calibration).",
            table(["measure", "value"], rows),
        ],
    )


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
