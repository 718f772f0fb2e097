"""The engine hand-off when a rank dies under load: vLLM encoder-cache files are written by
the ranks, so a rank killed while it writes must leave nothing half-written under the
name vLLM reads, and its images must be written by the ranks still up.

A dp-2 app writes every ``vllm_ec`` request's entries under a temporary directory while
four closed-loop clients send requests of two images each (fresh uuids every time)
and a watcher reads every entry the moment its final name appears. Rank 1 is killed
once the clients have had answers, and the load goes on until they have had as many
again. Every answer must be 200 with files equal to the in-process encoder's features.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pytest
import ray
import requests
from load import pool
from ray import serve
from safetensors.torch import load_file
from serve_helpers import app_args, b64, replica_actor

from deployments.app import bind_app
from kimi_encoder.engines.vllm import EC_FILENAME, EC_KEY

pytestmark = pytest.mark.chaos

APP = "chaos_handoff"
CLIENTS = 4
ANSWERS = 12  # before the kill, and again after it


@pytest.fixture(scope="module")
def ec_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ec")


@pytest.fixture(scope="module")
def url(serve_url, ec_root):
    args = app_args(
        dp_size=2,
        ranks={"cache_bytes": 0},
        dispatch={"cost_model": "patches", "cooldown_s": 1.0},
        handoff={"ec_root": str(ec_root)},
    )
    serve.run(bind_app(args), name=APP, route_prefix=f"/{APP}")
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


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


def test_a_rank_killed_while_writing_leaves_no_partial_file(url, ec_root, reference):
    images, features = pool(reference, count=8, seed=400)
    counter = itertools.count()
    answers: list[tuple[int, list[str], list[int]]] = []  # status, uuids, image picks
    lock = threading.Lock()
    enough = threading.Event()
    stop = threading.Event()

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        with requests.Session() as session:
            while not stop.is_set():
                picks = [int(p) for p in rng.choice(len(images), 2, replace=False)]
                uuids = [f"req-{next(counter)}-{i}" for i in range(2)]
                body = {
                    "items": [{"type": "image", "image": b64(images[p])} for p in picks],
                    "output": {"kind": "vllm_ec", "uuids": uuids},
                }
                status = session.post(f"{url}/v1/encode", json=body, timeout=60).status_code
                with lock:
                    answers.append((status, uuids, picks))
                    if len(answers) >= ANSWERS:
                        enough.set()

    watcher = Watcher(ec_root)
    watcher.start()
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
