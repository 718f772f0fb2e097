"""Elastic vision DP over real HTTP: ``dp_size: {min: 1, max: 3}`` and no other setting
changed (the test apps' CPU ranks and limits).

Idle, one rank process runs. A ramp to 16 closed-loop clients, each request four
distinct 448x448 JPEGs (all cache misses: the work queues on the ranks), has 3 ranks
live within 60 s; once the load stops, 1 again within 120 s, the other two ranks'
replicas released (no process left). Over the whole ramp every answer is 200 and every
image's features equal the in-process reference's (the fixed-dp parity bound).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
import requests
from images import image_bytes
from serve_helpers import app_args, decode_features, one_thread, served

pytestmark = pytest.mark.serve

APP = "elastic"
CLIENTS = 16
PER_REQUEST = 4
SIDE = 448  # 32x32 patches: 4 per request fill the test apps' 4096-patch limit
UP_WITHIN_S = 60.0
DOWN_WITHIN_S = 120.0
AFTER_UP_S = 5.0  # load kept on the three ranks before it stops


def rank_processes() -> dict[int, int]:
    """Live replica actors of each rank of the app."""
    counts = {0: 0, 1: 0, 2: 0}
    for actor in ray._private.state.actors().values():
        for rank in counts:
            if actor["State"] == "ALIVE" and f"{APP}#EncoderRank_{rank}#" in actor["Name"]:
                counts[rank] += 1
    return counts


def info(url: str) -> dict:
    return requests.get(f"{url}/v1/info", timeout=30).json()


def wait_for(condition, within_s: float, what: str):
    """Poll ``condition`` (returns a truthy value when met) until it holds or time is up."""
    deadline = time.monotonic() + within_s
    while True:
        met = condition()
        if met:
            return met
        assert time.monotonic() < deadline, f"{what} not within {within_s:g} s"
        time.sleep(0.5)


class Ramp:
    """Closed-loop clients, each sending requests of fresh seeded JPEGs until stopped;
    every answer's status and features are kept."""

    def __init__(self, url: str):
        self.url = url
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.statuses: list[int] = []
        self.features: dict[int, np.ndarray] = {}  # image seed -> its features

    def client(self, k: int) -> None:
        n = 0
        while not self.stop.is_set():
            seeds = [100_000 * (k + 1) + PER_REQUEST * n + j for j in range(PER_REQUEST)]
            files = [
                ("image", (f"{s}.jpg", image_bytes("RGB", (SIDE, SIDE), s, fmt="JPEG")))
                for s in seeds
            ]
            answer = requests.post(f"{self.url}/v1/encode", files=files, timeout=120)
            with self.lock:
                self.statuses.append(answer.status_code)
                if answer.status_code == 200:
                    for seed, item in zip(seeds, answer.json()["items"], strict=True):
                        self.features[seed] = decode_features(item)
            n += 1


def test_ranks_follow_a_ramp_of_clients_up_and_back_down(serve_url, reference):
    args = app_args(dp_size={"min": 1, "max": 3})
    with served(serve_url, APP, args) as url:
        idle = info(url)
        assert idle["ranks_live"] == [0]
        assert [r["state"] for r in idle["ranks"]] == ["live", "parked", "parked"]
        assert rank_processes() == {0: 1, 1: 0, 2: 0}  # idle: one rank process runs

        ramp = Ramp(url)
        started = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            clients = []
            for k in range(CLIENTS):  # one more client every 0.25 s
                clients.append(pool.submit(ramp.client, k))
                time.sleep(0.25)
            try:
                wait_for(lambda: info(url)["ranks_live"] == [0, 1, 2], UP_WITHIN_S, "3 ranks")
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
        wait_for(lambda: rank_processes() == {0: 1, 1: 0, 2: 0}, 30, "replicas released")
        decisions = info(url)["scaling"]["decisions"]

    print(
        f"\n3 ranks live {up_s:.1f} s after the ramp began; 1 again {down_s:.1f} s after it "
        f"stopped; {len(ramp.statuses)} answers, {len(ramp.features)} images"
    )
    assert [d["scale"] for d in decisions][-2:] == ["down", "down"]
    assert set(ramp.statuses) == {200}, {s: ramp.statuses.count(s) for s in set(ramp.statuses)}
    with one_thread():
        for seed, got in ramp.features.items():
            item = reference.plan(image_bytes("RGB", (SIDE, SIDE), seed, fmt="JPEG"))
            (want,) = reference.encode([item])
            np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-5, err_msg=str(seed))
