"""Elastic vision DP over real HTTP: ``dp_size: {min: 1, max: 3}``.

- One ingress replica and the default scaling (the test apps' CPU ranks and limits), its
  way back down shortened (``downscale_after_s`` and ``park_after_s`` as below: windows
  the test waits out, not what it measures): idle, one rank process runs. A ramp to 16
  closed-loop clients, each request four distinct 448x448 JPEGs (all cache misses: the
  work queues on the ranks), has 3 ranks live within 60 s; once the load stops, 1 again
  within 120 s, the other two ranks' replicas released (no process left).
- Two and three ingress replicas, both caches off, one decision for all of them (the
  app's scaler): a load that comes and goes (three cycles of 12 clients, then idle for
  less than downscale_after_s), a rank killed while it starts, then no request at all.
  The pool comes back to one rank and one rank process within downscale_after_s +
  park_after_s + 30 s, as every ingress replica's /v1/info says (several answers in a
  row, from every replica, agree); no more rank processes started than the ranks there
  can be, the killed one's replacement aside.

Every answer is 200 and every image's features equal the in-process reference's (the
fixed-dp parity bound).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import requests
from serve_helpers import (
    Ramp,
    app_args,
    rank_processes,
    replica_actor,
    replica_actors,
    served,
    wait_for,
)

APP = "elastic"
CLIENTS = 16
UP_WITHIN_S = 60.0
DOWN_WITHIN_S = 120.0
AFTER_UP_S = 2.0  # load kept on the three ranks before it stops
# Several ingress replicas: a load that comes back before the pool shrinks, then goes.
SCALING = {"upscale_after_s": 1.0, "downscale_after_s": 6.0, "park_after_s": 2.0}
CYCLES, LOAD_S, IDLE_S, CYCLE_CLIENTS = 3, 6.0, 4.0, 12
AGREE = 3  # answers in a row from every ingress replica that must agree
# The ramp's scaling: the default upscale, the way back down on the windows above.
RAMP_SCALING = {key: SCALING[key] for key in ("downscale_after_s", "park_after_s")}


def info(url: str) -> dict:
    return requests.get(f"{url}/v1/info", timeout=30).json()


def test_ranks_follow_a_ramp_of_clients_up_and_back_down(serve_url, reference):
    args = app_args(dp_size={"min": 1, "max": 3}, scaling=RAMP_SCALING)
    with served(serve_url, APP, args) as url:
        idle = info(url)
        assert idle["ranks_live"] == [0]
        assert [r["state"] for r in idle["ranks"]] == ["live", "parked", "parked"]
        assert rank_processes(APP, 3) == {0: 1, 1: 0, 2: 0}  # idle: one rank process runs

        ramp = Ramp(url)
        started = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            clients = []
            for k in range(CLIENTS):  # one more client every 0.25 s
                clients.append(pool.submit(ramp.client, k))
                time.sleep(0.25)
            try:
                try:
                    wait_for(lambda: info(url)["ranks_live"] == [0, 1, 2], UP_WITHIN_S, "3 ranks")
                except AssertionError as missed:  # say where each rank stood, and why
                    now = info(url)
                    states = [(r["rank"], r["state"], r.get("reason")) for r in now["ranks"]]
                    raise AssertionError(f"{missed}: {states}; {now['scaling']}") from None
                up_s = time.monotonic() - started
                time.sleep(AFTER_UP_S)
            finally:
                ramp.stop.set()
            for client in clients:
                client.result()
        stopped = time.monotonic()

        def back_to_one() -> bool:
            now = info(url)
            states = [r["state"] for r in now["ranks"]]
            return now["ranks_live"] == [0] and states[1:] == ["parked", "parked"]

        wait_for(back_to_one, DOWN_WITHIN_S, "back to 1 rank")
        down_s = time.monotonic() - stopped
        wait_for(lambda: rank_processes(APP, 3) == {0: 1, 1: 0, 2: 0}, 30, "replicas released")
        decisions = info(url)["scaling"]["decisions"]

    print(
        f"\n3 ranks live {up_s:.1f} s after the ramp began; 1 again {down_s:.1f} s after it "
        f"stopped; {len(ramp.statuses)} answers, {len(ramp.features)} images"
    )
    assert [d["scale"] for d in decisions][-2:] == ["down", "down"]
    ramp.check(reference)


def agreed(url: str, replicas: int, want) -> dict | None:
    """The scaling section once ``AGREE`` answers in a row from each of the ``replicas``
    ingress replicas satisfy ``want`` and name the same decision (None otherwise)."""
    seen: dict[str, int] = {}
    decided = set()
    for _ in range(AGREE * replicas * 6):
        now = info(url)
        scaling, caller = now["scaling"], now["assignment"]["caller"]
        if not want(now):
            return None
        seen[caller] = seen.get(caller, 0) + 1
        decided.add((scaling["decided_by"], tuple(scaling["wanted"])))
        if len(seen) == replicas and min(seen.values()) >= AGREE:
            assert len(decided) == 1, decided  # one decision, whichever replica answered
            return scaling
    return None


def kill_while_starting(url: str, app: str) -> int | None:
    """Kill the replica of the first rank that is starting (its constructor running), as
    soon as its actor exists: the rank it was, or None if no start was caught."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        starting = [r["rank"] for r in info(url)["ranks"] if r["state"] == "starting"]
        for rank in starting:
            if replica_actors(app, f"EncoderRank_{rank}"):
                ray.kill(replica_actor(app, rank), no_restart=True)
                return rank
        time.sleep(0.05)
    print("no start caught:", info(url)["scaling"], [r["state"] for r in info(url)["ranks"]])
    return None


@pytest.mark.parametrize("replicas", [2, 3])
def test_several_ingress_replicas_follow_one_decision(serve_url, reference, replicas):
    args = app_args(
        dp_size={"min": 1, "max": 3},
        ingress={"replicas": replicas, "cache_bytes": 0},
        ranks={"cache_bytes": 0},
        scaling=SCALING,
    )
    name = f"{APP}{replicas}"
    with served(serve_url, name, args) as url:
        ramp = Ramp(url, first_seed=replicas * 10_000_000)
        killed = None
        for cycle in range(CYCLES):
            ramp.stop.clear()
            with ThreadPoolExecutor(CYCLE_CLIENTS) as pool:
                clients = [pool.submit(ramp.client, cycle * 100 + k) for k in range(CYCLE_CLIENTS)]
                try:
                    if cycle == 0:
                        killed = kill_while_starting(url, name)
                    time.sleep(LOAD_S)
                finally:
                    ramp.stop.set()
                for client in clients:
                    client.result()
            if cycle == 0 and killed is not None:  # Serve starts it again: it takes work
                wait_for(lambda k=killed: k in info(url)["ranks_live"], 60, "its replacement")
            elif cycle < CYCLES - 1:
                time.sleep(IDLE_S)  # shorter than downscale_after_s: the pool stays
        stopped = time.monotonic()
        bound = SCALING["downscale_after_s"] + SCALING["park_after_s"] + 30

        def at_minimum(now: dict) -> bool:
            states = [r["state"] for r in now["ranks"]]
            return now["scaling"]["wanted"] == [0] and states == ["live", "parked", "parked"]

        scaling = wait_for(lambda: agreed(url, replicas, at_minimum), bound, "back to 1 rank")
        down_s = time.monotonic() - stopped
        wait_for(lambda: rank_processes(name, 3) == {0: 1, 1: 0, 2: 0}, 30, "replicas released")
        started = sum(rank_processes(name, 3, alive=False).values())

    print(
        f"\n{replicas} ingress replicas: rank {killed} killed while it started; back to 1 rank "
        f"{down_s:.1f} s after the load stopped (bound {bound:g} s); {started} rank processes "
        f"started in all; {len(ramp.statuses)} answers; decided by {scaling['decided_by']}"
    )
    assert killed is not None, "no rank was caught starting"
    assert started <= 3 + 1  # the ranks there can be, and the killed one's replacement
    ramp.check(reference)
