"""Backpressure and memory bounds over real HTTP: a burst past the ingress's and the rank's
queues is answered 200 or 503 with Retry-After (nothing else, nothing hangs); the rank's
memory leases bound what it holds and all come back, also after a 504 timeout.

Lateness is set far past the request timeout here (``slow_after_s``, ``route_timeout_s``)
and load polls off (``load_report_interval_ms``), so that a rank whose forwards are held
is neither marked slow nor asked for reports while the test fills its slots: the only
503s come from full queues, and the rank's two slots hold the test's two first calls."""

from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np
import pytest
import ray
import requests
from controlled import Switchboard, controlled_factory
from images import image_bytes
from ray import serve
from serve_helpers import app_args, b64, decode_features, one_thread, replica_actor, wait_for

from deployments.app import bind_app

APP = "bp"
BUDGET = 300_000  # bytes: one 2-image call of these sizes fits, two do not
BURST = 16
# Long enough for the burst test's two first requests to outlast its staging on a starved
# machine; the timeout test holds its request past it.
REQUEST_TIMEOUT_S = 8


def body(seed: int) -> list[bytes]:
    return [image_bytes("RGB", (96, 64), 7000 + seed), image_bytes("RGB", (64, 96), 7100 + seed)]


def post(url: str, data: list[bytes], timeout: float = 60) -> requests.Response:
    items = [{"type": "image", "image": b64(b)} for b in data]
    return requests.post(f"{url}/v1/encode", json={"items": items}, timeout=timeout)


def leases(url: str) -> dict:
    (rank,) = requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]
    assert "leases" in rank, rank
    return rank["leases"]


@pytest.fixture(scope="module")
def board(serve_url):
    return Switchboard.remote()


@pytest.fixture(scope="module")
def bp_url(serve_url, board):
    args = app_args(
        dp_size=1,
        ranks={
            "max_inflight_bytes": BUDGET,
            "cache_bytes": 0,
            "calibration_grids": [],
            "serve_options": {"max_ongoing_requests": 2, "max_queued_requests": 2},
        },
        ingress={
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "serve_options": {"max_ongoing_requests": 6, "max_queued_requests": 2},
        },
        dispatch={
            "cooldown_s": 0.5,
            "cost_model": "patches",
            "slow_after_s": 60,
            "route_timeout_s": 60,
            "load_report_interval_ms": 3_600_000,
        },
    )
    serve.run(bind_app(args, controlled_factory(board)), name=APP, route_prefix=f"/{APP}")
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


def wait_idle(url: str, bound_s: float = 15) -> dict:
    deadline = time.monotonic() + bound_s
    while True:
        state = leases(url)
        if state["inflight_bytes"] == 0 and state["leases_granted"] == state["leases_released"]:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.2)


def ongoing(app: str, rank: int) -> int:
    """Calls the rank's replica holds (Serve's own count: running or about to)."""
    return ray.get(replica_actor(app, rank).get_num_ongoing_requests.remote(), timeout=30)


def test_burst_past_the_queues_is_200_or_503_with_retry_after(bp_url, board, reference):
    ray.get(board.set.remote(0, "hold"))  # the rank's forward waits: its queues fill up
    started = time.monotonic()
    with cf.ThreadPoolExecutor(BURST) as pool:
        # Two calls take the rank's two slots: one holds the budget in its held forward,
        # the other waits for a lease (two calls of these sizes do not fit at once).
        pending = [pool.submit(post, bp_url, body(k), 30) for k in range(2)]
        ray.get(board.wait_held.remote(0), timeout=30)
        wait_for(lambda: ongoing(APP, 0) == 2, 30, "both first calls in the rank")
        # The rest find the queues full: answered at once. Wait for a first 503, let go.
        burst = [pool.submit(post, bp_url, body(k), 30) for k in range(2, BURST)]
        done = next(f for f in cf.as_completed(burst, timeout=30))
        assert done.result().status_code == 503, done.result().text
        ray.get(board.set.remote(0, "run"))
        answers = [f.result() for f in pending + burst]
    burst_s = time.monotonic() - started
    statuses = [a.status_code for a in answers]
    assert statuses[:2] == [200, 200], statuses  # the calls that held the rank's slots
    assert set(statuses) <= {200, 503}, statuses
    assert 200 in statuses, statuses
    assert 503 in statuses, statuses
    for answer in answers:
        if answer.status_code == 503:
            assert int(answer.headers["Retry-After"]) >= 1, answer.headers
    with one_thread():
        for k, answer in enumerate(answers):
            if answer.status_code == 200:
                want = reference.encode([reference.plan(b) for b in body(k)])
                for item, expected in zip(answer.json()["items"], want, strict=True):
                    got = decode_features(item)
                    np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=1e-5)
    state = wait_idle(bp_url)
    assert state["peak_inflight_bytes"] <= BUDGET, state
    assert state["leases_waited"] >= 1, state
    print(
        f"\nburst of {BURST}: {statuses.count(200)} x 200, {statuses.count(503)} x 503 "
        f"in {burst_s:.2f} s; lease peak {state['peak_inflight_bytes']} of {BUDGET} bytes"
    )
    deadline = time.monotonic() + 20  # after the burst the rank takes work again
    while (answer := post(bp_url, body(99))).status_code != 200:
        assert answer.status_code == 503, answer.text
        assert time.monotonic() < deadline, "the rank took no work 20 s after the burst"
        time.sleep(float(answer.headers["Retry-After"]))


def test_timeout_is_504_and_releases_the_lease(bp_url, board):
    ray.get(board.set.remote(0, "hold"))  # held past request_timeout_s
    started = time.monotonic()
    answer = post(bp_url, body(200))
    elapsed = time.monotonic() - started
    ray.get(board.set.remote(0, "run"))
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["type"] == "timeout", answer.text
    # answered at the deadline, not when the rank finished (it is held until after this)
    assert REQUEST_TIMEOUT_S <= elapsed < 2 * REQUEST_TIMEOUT_S, elapsed
    wait_idle(bp_url)
