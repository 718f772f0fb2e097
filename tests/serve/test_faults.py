"""Faults over real HTTP: a rank killed mid-request, every rank killed, a failing health
check, cancellations and timeouts, graceful shutdown.

Ranks are killed with ``ray.kill`` on their Serve replica actor. Each rank's encoder is
the real one behind a test switchboard (``controlled.py``): a test holds a rank's
forward until it is done with it (and waits until the forward is held), or makes it
return NaN, always for one process id, so a replacement runs normally. Features are
compared with the in-process encoder. Time bounds are stated next to each assertion;
measured figures are printed (``pytest -s``).
"""

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
from serve_helpers import (
    app_args,
    b64,
    decode_features,
    kill_ranks,
    one_thread,
    replica_actor,
    wait_for,
)

from deployments.app import bind_app

FAULTS_APP = "faults"
# Graceful: the shutdown test deletes this app while a request runs.
OPTIONS = {
    "graceful_shutdown_wait_loop_s": 0.2,
    "graceful_shutdown_timeout_s": 15,
    "health_check_period_s": 1,  # short only in tests: a failing rank is replaced fast
    "health_check_timeout_s": 10,
}
FAST_RESTART = {
    "ranks": {"cache_bytes": 0, "calibration_grids": []},
    "dispatch": {"cost_model": "patches"},
}
REDISPATCH_BOUND_S = 10  # kill -> the request that was on the dead rank answers 200
UNAVAILABLE_BOUND_S = 5  # kill of every rank -> 503 with Retry-After
RECOVERY_BOUND_S = 45  # kill -> the replacement rank takes work again
HEALTH_REPLACE_BOUND_S = 30  # failing health check -> a new process serves the rank


def images(count: int, seed: int) -> list[bytes]:
    sizes = [(96, 64), (64, 48), (120, 90), (80, 56), (56, 84), (70, 70)]
    return [image_bytes("RGB", sizes[i % len(sizes)], 5000 + seed + i) for i in range(count)]


def post(url: str, data: list[bytes], timeout: float = 60) -> requests.Response:
    items = [{"type": "image", "image": b64(b)} for b in data]
    return requests.post(f"{url}/v1/encode", json={"items": items}, timeout=timeout)


def info(url: str) -> dict:
    return requests.get(f"{url}/v1/info", timeout=30).json()


def assert_features(response: requests.Response, data: list[bytes], reference) -> list[int]:
    """Every item's features are its own image's; returns the owner ranks."""
    assert response.status_code == 200, response.text
    items = response.json()["items"]
    assert len(items) == len(data)
    with one_thread():
        want = reference.encode([reference.plan(b) for b in data])
    for item, expected in zip(items, want, strict=True):
        np.testing.assert_allclose(decode_features(item), expected.numpy(), rtol=0, atol=1e-5)
    return [item["owner_rank"] for item in items]


def hold(board, url: str, *ranks: int) -> None:
    """Hold the forwards of ``ranks``' current processes (their replacements run)."""
    current = pids(url)
    for rank in ranks:
        ray.get(board.set.remote(rank, "hold", current[rank]))


def release(board, *ranks: int) -> None:
    for rank in ranks:
        ray.get(board.set.remote(rank, "run"))


def wait_held(board, *ranks: int) -> None:
    for rank in ranks:
        ray.get(board.wait_held.remote(rank), timeout=30)


def pids(url: str) -> list[int | None]:
    return [r.get("pid") for r in info(url)["ranks"]]


def leases_idle(url: str) -> bool:
    ranks = info(url)["ranks"]
    return all(
        r.get("state") == "live"
        and r["leases"]["inflight_bytes"] == 0
        and r["leases"]["leases_granted"] == r["leases"]["leases_released"]
        for r in ranks
    )


@pytest.fixture(scope="module")
def board(serve_url):
    return Switchboard.remote()


@pytest.fixture(scope="module")
def faults_url(serve_url, board):
    args = app_args(
        FAST_RESTART,
        dp_size=2,
        ranks={"serve_options": OPTIONS},
        ingress={"request_timeout_s": 30},
        dispatch={"cooldown_s": 0.5},
    )
    app = bind_app(args, controlled_factory(board))
    serve.run(app, name=FAULTS_APP, route_prefix=f"/{FAULTS_APP}")
    yield f"{serve_url}/{FAULTS_APP}"
    if FAULTS_APP in serve.status().applications:
        serve.delete(FAULTS_APP)


def test_rank_killed_mid_request_is_redispatched_and_its_replacement_rejoins(
    faults_url, board, reference
):
    data = images(6, seed=0)
    old = pids(faults_url)
    hold(board, faults_url, 1)  # rank 1 holds its share while we kill it
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, faults_url, data)
        wait_held(board, 1)
        killed_at = time.monotonic()
        ray.kill(replica_actor(FAULTS_APP, 1), no_restart=True)
        response = pending.result(timeout=60)
    redispatch_s = time.monotonic() - killed_at
    assert_features(response, data, reference)  # every image answered, each with its own
    assert redispatch_s < REDISPATCH_BOUND_S, redispatch_s
    failover = info(faults_url)["failover"]
    assert failover["redispatched_images"] >= 1
    assert failover["unavailable_errors"][1] >= 1

    # The replacement (a new process, not held) rejoins and takes work.
    def rank1_took_work() -> bool:
        batch = images(4, seed=10)
        answer = post(faults_url, batch)
        return answer.status_code == 200 and 1 in assert_features(answer, batch, reference)

    wait_for(rank1_took_work, RECOVERY_BOUND_S, "rank 1 taking work again", every=0.5)
    recovery_s = time.monotonic() - killed_at
    new = pids(faults_url)
    assert new[0] == old[0]
    assert new[1] not in (None, old[1])
    print(f"\nre-dispatch {redispatch_s:.2f} s; replacement rank took work {recovery_s:.2f} s")
    wait_for(lambda: leases_idle(faults_url), 10, "leases back to zero")


def test_no_rank_alive_means_503_with_retry_after_then_recovery(faults_url, board, reference):
    data = images(4, seed=20)
    hold(board, faults_url, 0, 1)
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, faults_url, data)
        wait_held(board, 0, 1)
        killed_at = time.monotonic()
        kill_ranks(FAULTS_APP, (0, 1))
        response = pending.result(timeout=60)
    unavailable_s = time.monotonic() - killed_at
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) >= 1
    assert response.json()["error"]["type"] == "unavailable"
    assert unavailable_s < UNAVAILABLE_BOUND_S, unavailable_s
    started = time.monotonic()
    statuses = []
    while True:  # a client honouring Retry-After; every answer comes fast, none hangs
        sent = time.monotonic()
        answer = post(faults_url, data, timeout=35)
        assert time.monotonic() - sent < 31  # at most request_timeout_s, never a hang
        statuses.append(answer.status_code)
        if answer.status_code == 200:
            break
        assert answer.status_code == 503, answer.text
        assert "Retry-After" in answer.headers, answer.headers
        assert time.monotonic() - started < RECOVERY_BOUND_S, statuses
        time.sleep(min(float(answer.headers["Retry-After"]), 1.0))
    recovery_s = time.monotonic() - killed_at
    assert_features(answer, data, reference)
    print(
        f"\nall ranks killed: 503 after {unavailable_s:.2f} s; served again after "
        f"{recovery_s:.2f} s; statuses {statuses}"
    )
    wait_for(lambda: leases_idle(faults_url), 10, "leases back to zero")


def test_failing_health_check_replaces_the_rank(faults_url, board, reference):
    before = info(faults_url)["ranks"]
    assert all(r["health_checks"] >= 1 for r in before)  # the real probe encode runs
    old = [r["pid"] for r in before]
    ray.get(board.set.remote(0, "nan", old[0]))  # a broken device: NaN features
    flagged_at = time.monotonic()
    wait_for(
        lambda: pids(faults_url)[0] not in (None, old[0]),
        HEALTH_REPLACE_BOUND_S,
        "a new rank 0 process",
        every=0.5,
    )
    replaced_s = time.monotonic() - flagged_at
    assert pids(faults_url)[1] == old[1]  # the healthy rank was left alone
    data = images(3, seed=30)
    assert_features(post(faults_url, data), data, reference)
    print(f"\nfailing health check -> new rank 0 process in {replaced_s:.2f} s")


def test_cancelled_and_timed_out_calls_release_their_leases(faults_url, board):
    hold(board, faults_url, 0, 1)
    for _ in range(3):  # the client gives up: Serve cancels the ingress and the rank calls
        with pytest.raises(requests.exceptions.ReadTimeout):
            post(faults_url, images(4, seed=40), timeout=0.5)
    bad = image_bytes("RGB", (64, 48), 1)
    truncated = bad[: len(bad) // 2]  # a valid header, a cut body: the rank's decode fails
    release(board, 0, 1)
    before = info(faults_url)["failover"]
    answer = post(faults_url, [images(1, seed=41)[0], truncated])
    assert answer.status_code == 400
    assert "item 1" in answer.json()["error"]["message"]
    after = info(faults_url)["failover"]  # an input error is never re-dispatched
    assert after["redispatched_images"] == before["redispatched_images"]
    assert after["unavailable_errors"] == before["unavailable_errors"]
    wait_for(lambda: leases_idle(faults_url), 10, "leases back to zero after cancels")
    for rank in info(faults_url)["ranks"]:
        assert rank["leases"]["peak_inflight_bytes"] <= rank["leases"]["max_inflight_bytes"]


def test_graceful_shutdown_drains_a_running_request(faults_url, board, reference):
    data = images(2, seed=50)
    hold(board, faults_url, 0, 1)
    with cf.ThreadPoolExecutor(2) as pool:
        pending = pool.submit(post, faults_url, data)
        wait_held(board, 0, 1)  # two images: one on each rank
        deleting = pool.submit(serve.delete, FAULTS_APP)  # blocks while the replicas drain
        wait_for(
            lambda: serve.status().applications[FAULTS_APP].status == "DELETING",
            30,
            "the app deleting",
            every=0.05,
        )
        release(board, 0, 1)  # the request still in flight finishes during the drain
        response = pending.result(timeout=60)
        deleting.result(timeout=60)
    assert_features(response, data, reference)
