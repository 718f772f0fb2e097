"""Output kind ``vllm_push`` through a running app, into the consumer side of the wire
(``kimi_encoder.engines.ecreceive.Receiver``, what each vLLM worker runs inside our
connector; vLLM's own code drives it in tests/interop/test_vllm_push.py).

What the receiver staged equals ``/v1/encode``'s features bit for bit; the ranks count
their pushes per destination; a full consumer is a 503 with Retry-After; a rank killed
while its pushes wait on a slow consumer, under load, loses no request and no image; and
across a simulated node boundary (ranks on other nodes than the ingress, no directory
shared) the pushes arrive from the ranks' nodes (``multinode_push.py``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import requests
import torch
from images import image_bytes
from serve_helpers import app_args, b64, decode_features, free_port, replica_actor, served

from kimi_encoder.engines import ecreceive
from kimi_encoder.engines.ecreceive import Receiver, Staging, Watcher

APP = "vllm_push"
ROOT = Path(__file__).resolve().parents[2]
ACK_TIMEOUT_S = 4.0
IMAGES = [image_bytes("RGB", (90 + 12 * i, 60 + 10 * i), 500 + i) for i in range(4)]


@pytest.fixture(scope="module")
def url(serve_url):
    args = app_args(
        dp_size=2,
        ranks={"cache_bytes": 0, "calibration_grids": []},
        dispatch={"cost_model": "patches", "cooldown_s": 1.0},
        handoff={"vllm_push": {"ack_timeout_s": ACK_TIMEOUT_S}},
    )
    with served(serve_url, APP, args) as url:
        yield url


class SlowReceiver(Receiver):
    """A worker that takes ``delay_s`` to stage each push (a consumer under load)."""

    delay_s = 0.0

    def _handle(self, frames) -> None:
        time.sleep(self.delay_s)
        super()._handle(frames)


@pytest.fixture
def receiver():
    made = []

    def make(capacity: int = 1 << 26, delay_s: float = 0.0, ttl_s: float = 300) -> Receiver:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        rx = SlowReceiver("127.0.0.1", port, Staging(capacity, ttl_s))
        rx.delay_s = delay_s
        made.append(rx)
        return rx

    yield make
    for rx in made:
        rx.close()


def push(url: str, images: list[bytes], uuids: list[str], to: list[str]) -> requests.Response:
    items = [{"type": "image", "image": b64(b)} for b in images]
    output = {"kind": "vllm_push", "uuids": uuids, "to": to}
    return requests.post(f"{url}/v1/encode", json={"items": items, "output": output}, timeout=90)


def v1_features(url: str, images: list[bytes]) -> list[np.ndarray]:
    items = [{"type": "image", "image": b64(b)} for b in images]
    answer = requests.post(f"{url}/v1/encode", json={"items": items}, timeout=90)
    assert answer.status_code == 200, answer.text
    return [decode_features(item) for item in answer.json()["items"]]


def address(rx: Receiver) -> str:
    return rx.address.removeprefix("tcp://")


def assert_staged(rx: Receiver, uuids: list[str], want: list[np.ndarray], atol=0.0) -> None:
    """Staged as ``want``: bit for bit, or within ``atol`` where concurrent requests may
    share the ranks' batches."""
    for uuid, features in zip(uuids, want, strict=True):
        staged = rx.staging.get(uuid)
        assert staged is not None, f"{uuid} was not staged"
        error = float((staged - torch.from_numpy(features.copy())).abs().max())
        assert error <= atol, (uuid, error)


def test_staged_features_are_v1_encode_features_and_counted(url, receiver):
    rx = receiver()
    uuids = [f"counted-{i}" for i in range(len(IMAGES))]
    answer = push(url, IMAGES, uuids, [address(rx)])
    assert answer.status_code == 200, answer.text
    assert {e["owner_rank"] for e in answer.json()["items"]} == {0, 1}  # both ranks pushed
    assert_staged(rx, uuids, v1_features(url, IMAGES))
    ranks = requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]
    counts = [rank["ec_push"][rx.address] for rank in ranks if rx.address in rank["ec_push"]]
    assert sum(c["pushes"] for c in counts) == sum(c["acks"] for c in counts) == len(IMAGES)
    assert sum(c["bytes"] for c in counts) == sum(e["bytes"] for e in answer.json()["items"])
    assert sum(c["failures"] for c in counts) == 0


def hold(rx: Receiver, request_id: str, uuids: list[str]) -> Watcher:
    """A scheduler's watcher with ``request_id`` naming ``uuids``, confirmed by the worker."""
    watcher = Watcher([rx.address])
    watcher.hold(request_id, uuids)
    deadline = time.monotonic() + 10
    while not (watcher.drain(), watcher.held(request_id))[1]:
        assert time.monotonic() < deadline, "the hold was not confirmed"
        time.sleep(0.01)
    return watcher


def test_a_full_consumer_is_a_503_with_retry_after(url, receiver):
    one = v1_features(url, IMAGES[:1])[0].nbytes
    rx = receiver(capacity=one)  # room for one image, named by a request: the next is busy
    assert push(url, IMAGES[:1], ["full-0"], [address(rx)]).status_code == 200
    watcher = hold(rx, "chat-full", ["full-0"])
    try:
        answer = push(url, IMAGES[1:2], ["full-1"], [address(rx)])
    finally:
        watcher.close()
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "1"
    message = answer.json()["error"]["message"]
    assert "item 0 (uuid 'full-1')" in message
    assert f"{rx.address} is full" in message
    assert f"{one} of them named by unfinished requests" in message
    assert rx.staging.get("full-1") is None


def test_a_rank_killed_mid_push_under_load_loses_nothing(url, receiver):
    """Every push waits 0.3 s on the consumer; rank 1 is killed while requests' pushes wait
    on it. Its images go to rank 0, which encodes and pushes them again."""
    rx = receiver(delay_s=0.3)
    batches = [
        [image_bytes("RGB", (70 + 8 * i, 50 + 6 * k), 700 + 10 * k + i) for i in range(2)]
        for k in range(4)
    ]
    want = [v1_features(url, batch) for batch in batches]
    with cf.ThreadPoolExecutor(len(batches)) as pool:
        answers = [
            pool.submit(push, url, batch, [f"kill-{k}-{i}" for i in range(2)], [address(rx)])
            for k, batch in enumerate(batches)
        ]
        deadline = time.monotonic() + 30
        while rx.received == 0:  # pushes have begun
            assert time.monotonic() < deadline, "nothing was pushed"
            time.sleep(0.01)
        ray.kill(replica_actor(APP, 1), no_restart=True)
        results = [a.result(timeout=120) for a in answers]
    for k, answer in enumerate(results):
        assert answer.status_code == 200, answer.text
        assert_staged(rx, [f"kill-{k}-{i}" for i in range(2)], want[k], atol=1e-5)


def test_across_nodes_without_a_shared_directory():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("multinode_push.py")), str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (rc {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    out = json.loads(lines[-1])
    assert out["status"] == 200, out
    assert out["ingress_node"] not in out["rank_nodes"], out  # pushed from other nodes
    assert set(out["owners"]) == {0, 1}, out
    assert out["max_error"] == 0.0, out  # staged == the in-process encoder's, bit for bit


def test_a_scheduler_reading_every_few_seconds_loses_nothing(url, receiver, monkeypatch):
    """A steady stream of pushes through the app (one every 0.2 s, two clients) to a
    worker whose scheduler side reads only every 1.5 s and that remembers 8 events (each
    read is behind them): every acknowledged item is seen and loads, the staging stays
    within its limit, and once every request finished nothing is staged."""
    monkeypatch.setattr(ecreceive, "MAX_EVENTS", 8)
    one = v1_features(url, IMAGES[:1])[0].nbytes
    limit = 48 * one
    rx = receiver(capacity=limit)
    count = 30
    uuids = [f"stream-{k}" for k in range(count)]
    pace, peak, loaded = threading.Event(), [0], set()  # pace is never set: a timer

    def scheduler() -> None:
        watcher = Watcher([rx.address])
        deadline = time.monotonic() + 120
        try:
            while len(loaded) < count:
                assert time.monotonic() < deadline, f"seen {len(loaded)} of {count}"
                pace.wait(1.5)  # vLLM idle: nothing reads in between
                watcher.drain()
                peak[0] = max(peak[0], rx.staging.held_bytes)
                seen = [u for u in uuids if u not in loaded and watcher.rows(u)]
                for uuid in seen:
                    watcher.hold(f"chat-{uuid}", [uuid])
                while not all(watcher.held(f"chat-{u}") for u in seen):
                    assert time.monotonic() < deadline, "holds not confirmed"
                    watcher.drain()
                    pace.wait(0.01)
                for uuid in seen:
                    assert rx.staging.get(uuid) is not None, f"{uuid} reported but gone"
                    loaded.add(uuid)
                    watcher.release(f"chat-{uuid}", after_step=0)
            while rx.staging.held_bytes:
                assert time.monotonic() < deadline, rx.staging.snapshot()
                watcher.drain()
                pace.wait(0.01)
        finally:
            watcher.close()

    def client(first: int) -> list[int]:
        codes = []
        for k in range(first, count, 2):
            answer = push(url, [IMAGES[k % len(IMAGES)]], [uuids[k]], [address(rx)])
            codes.append(answer.status_code)
            pace.wait(0.2)
        return codes

    with cf.ThreadPoolExecutor(3) as pool:
        reader = pool.submit(scheduler)
        clients = [pool.submit(client, first) for first in (0, 1)]
        codes = [code for c in clients for code in c.result(timeout=120)]
        reader.result(timeout=150)
    assert codes == [200] * count
    assert loaded == set(uuids)  # every acknowledged item seen and loaded
    assert 0 < peak[0] <= limit
    assert rx.staging.counts["evicted"] == rx.staging.counts["expired"] == 0
    assert rx.staging.held_bytes == 0
