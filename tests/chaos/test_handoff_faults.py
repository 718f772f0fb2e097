"""The engine hand-off when a rank dies under load. vLLM encoder-cache files and sglang
parts are delivered by the ranks, so a rank killed while it writes or pushes must leave
nothing half-written under the name vLLM reads, and every part must reach its prefill
either whole or as its error frame.

A dp-2 app under four closed-loop clients (two images per request, fresh uuids or part
ids every time); rank 1 is killed once the clients have had answers, and the load goes
on until they have had as many again. vLLM: a watcher reads every entry the moment its
final name appears; every answer must be 200 with files equal to the in-process
encoder's features. sglang: a PULL socket collects what the ranks push; every 200 part
arrives whole and right, every other answer's part arrives as its error frame.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import requests
import zmq
from safetensors.torch import load_file
from serve_helpers import app_args, b64, data_url, read_part, replica_actor, served, sglang_part

from chaos.load import pool
from kimi_encoder.engines.vllm import EC_FILENAME, EC_KEY

APP = "chaos_handoff"
CLIENTS = 4
ANSWERS = 12  # before the kill, and again after it


@pytest.fixture(scope="module")
def url(serve_url, ec_root):
    args = app_args(
        dp_size=2,
        ranks={"cache_bytes": 0},
        dispatch={"cost_model": "patches", "cooldown_s": 1.0},
        handoff={"ec_root": str(ec_root)},
    )
    with served(serve_url, APP, args) as url:
        yield url


class Watcher(threading.Thread):
    """Reads every entry as soon as its final name exists; records any it cannot read."""

    def __init__(self, root: Path):
        super().__init__(daemon=True)
        self.root = root
        self.stop = threading.Event()
        self.read: set[str] = set()
        self.unreadable: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            for path in self.root.glob(f"*/{EC_FILENAME}"):
                if path.parent.name in self.read:
                    continue
                try:
                    load_file(path)[EC_KEY]
                except Exception as exc:  # noqa: BLE001 - what a consumer would hit
                    self.unreadable.append(f"{path}: {exc!r}")
                self.read.add(path.parent.name)
            self.stop.wait(0.005)


def both_ranks_ready(url: str) -> None:
    """Until both ranks answer ``/v1/info`` as ready (rank 1 may be a replacement still
    starting after the previous test killed it)."""
    deadline = time.monotonic() + 120
    while True:
        ranks = requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]
        if all(r.get("state") == "live" for r in ranks):
            return
        assert time.monotonic() < deadline, ranks
        time.sleep(0.2)


def under_a_kill(url: str, send) -> tuple[list, int]:
    """``CLIENTS`` threads calling ``send(k, rng)`` (one request each time, returning what
    the test checks later) until they have had ``ANSWERS`` answers after rank 1 was
    killed, which happens after their first ``ANSWERS``; returns the answers and how
    many came before the kill."""
    both_ranks_ready(url)
    answers: list = []
    lock = threading.Lock()
    enough = threading.Event()
    stop = threading.Event()

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        while not stop.is_set():
            answer = send(k, rng)
            with lock:
                answers.append(answer)
                if len(answers) >= ANSWERS:
                    enough.set()

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        assert enough.wait(120), "the clients had no answers"
        ray.kill(replica_actor(APP, 1), no_restart=True)
        with lock:
            killed_after = len(answers)
        while True:
            with lock:
                if len(answers) >= killed_after + ANSWERS:
                    break
            assert all(t.is_alive() for t in threads), "a client died"
            threads[0].join(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(90)
    return answers, killed_after


def test_a_rank_killed_while_writing_leaves_no_partial_file(url, ec_root, reference):
    images, features = pool(reference, count=8, seed=400)
    counter = itertools.count()

    def send(k: int, rng) -> tuple[int, list[str], list[int]]:
        picks = [int(p) for p in rng.choice(len(images), 2, replace=False)]
        uuids = [f"req-{next(counter)}-{i}" for i in range(2)]
        body = {
            "items": [{"type": "image", "image": b64(images[p])} for p in picks],
            "output": {"kind": "vllm_ec", "uuids": uuids},
        }
        status = requests.post(f"{url}/v1/encode", json=body, timeout=60).status_code
        return status, uuids, picks

    watcher = Watcher(ec_root)
    watcher.start()
    try:
        answers, killed_after = under_a_kill(url, send)
    finally:
        watcher.stop.set()
        watcher.join(10)

    print(f"\n{len(answers)} vllm_ec requests, rank 1 killed after {killed_after}")
    assert {status for status, _, _ in answers} == {200}
    assert watcher.unreadable == []
    for _, uuids, picks in answers:
        for uuid, pick in zip(uuids, picks, strict=True):
            written = load_file(ec_root / uuid / EC_FILENAME)[EC_KEY].numpy()
            np.testing.assert_allclose(written, features[pick], atol=1e-5, rtol=0)
    temporary = [p for p in ec_root.rglob("*") if p.is_file() and p.name != EC_FILENAME]
    assert all(p.name.endswith(".tmp") and p.name.startswith(".") for p in temporary), temporary


def test_a_rank_killed_while_pushing_sends_each_part_whole_or_as_its_error(url, reference):
    images, features = pool(reference, count=8, seed=500)
    context = zmq.Context()
    sink = context.socket(zmq.PULL)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    counter = itertools.count()

    def send(k: int, rng) -> tuple[int, str, list[int]]:
        picks = [int(p) for p in rng.choice(len(images), 2, replace=False)]
        req_id = f"chaos-{next(counter)}_local_part_0"
        body = sglang_part(req_id, [data_url(images[p]) for p in picks], f"127.0.0.1:{port}")
        status = requests.post(f"{url}/encode", json=body, timeout=60).status_code
        return status, req_id, picks

    try:
        answers, killed_after = under_a_kill(url, send)
        received: dict[str, list] = {}
        deadline = time.monotonic() + 30  # every answered part has been pushed by now
        while len(received) < len(answers) and time.monotonic() < deadline:
            if sink.poll(100):
                meta, embedding = read_part(sink.recv_multipart())
                received.setdefault(meta.req_id, []).append((meta, embedding))
    finally:
        sink.close(linger=0)
        context.term()

    statuses = sorted({status for status, _, _ in answers})
    print(f"\n{len(answers)} parts, rank 1 killed after {killed_after}: statuses {statuses}")
    for status, req_id, picks in answers:
        assert len(received.get(req_id, [])) == 1, (status, req_id, received.get(req_id))
        ((meta, embedding),) = received[req_id]
        if status == 200:
            want = np.concatenate([features[p] for p in picks])
            np.testing.assert_allclose(embedding.float().numpy(), want, atol=1e-5, rtol=0)
        else:
            assert embedding is None, (status, meta)
            assert meta.error_msg, (status, meta)
