"""API key, request timeout and the default bind address, over real HTTP.

One app of its own ("strict": 1 rank, an API key file, request_timeout_s=5)
serves both: every encode here sends the key. Its rank's forwards run normally unless
a test holds them (tests/controlled.py), so the timeout is reached by holding, not by
hoping the machine is slow.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import requests
import yaml
from controlled import Switchboard, controlled_factory
from images import image_bytes
from ray import serve
from serve_helpers import REFERENCE_PATH, app_args, b64, encode, replica_pids, wait_for

from deployments.app import bind_app

GOOD = image_bytes("RGB", (64, 48), seed=1)


KEY = "kimi-test-key-7f3a9c51e2"
WRONG = "kimi-wrong-key-0b8d44a6"
# Past a small encode's latency on a loaded machine (a 1 s limit gave a plain encode a 504
# in a parallel pass), and short: the timeout test waits it out once.
TIMEOUT_S = 5.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def board(serve_url):
    return Switchboard.remote()


@pytest.fixture(scope="module")
def strict(serve_url, board, tmp_path_factory) -> Iterator[str]:
    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(KEY + "\n")
    args = app_args(
        REFERENCE_PATH,
        dp_size=1,
        ingress={
            "api_key_file": str(key_file),
            "request_timeout_s": TIMEOUT_S,
            "limits": {"max_images_per_request": 64, "max_patches_per_request": 1 << 20},
        },
        handoff={"engine_callers": {"networks": []}},
    )
    serve.run(bind_app(args, controlled_factory(board)), name="strict", route_prefix="/strict")
    url = f"{serve_url}/strict"
    # Ready when a rank answers the ingress's load report within /health's 1 s: the first
    # call through a new handle can take longer than that on a busy machine.
    wait_for(lambda: health(url).status_code == 200, 60, "the strict app's /health")
    yield url
    serve.delete("strict")


def auth(key: str = KEY) -> dict:
    return {"authorization": f"Bearer {key}"}


def health(url: str) -> requests.Response:
    return requests.get(f"{url}/health", headers=auth(), timeout=30)


def healthy_now(url: str) -> requests.Response | None:
    """``/health``'s answer if 200; None after a 503 (no rank answered within 1 s)."""
    response = health(url)
    if response.status_code == 503:
        assert response.json()["error"]["type"] == "unavailable", response.text
        return None
    assert response.status_code == 200, response.text
    return response


def small_body() -> dict:
    return {"items": [{"type": "image", "image": b64(GOOD)}]}


@pytest.mark.parametrize(
    "headers",
    [{}, auth(WRONG), {"authorization": KEY}, {"authorization": f"Basic {KEY}"}],
    ids=["none", "wrong-key", "no-scheme", "basic"],
)
def test_encode_info_and_load_need_the_key(strict, headers):
    for response in (
        requests.post(f"{strict}/v1/encode", json=small_body(), headers=headers, timeout=60),
        requests.get(f"{strict}/v1/info", headers=headers, timeout=60),
        requests.get(f"{strict}/v1/load", headers=headers, timeout=60),
    ):
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json() == {
            "error": {
                "type": "unauthorized",
                "message": "missing or wrong API key; send the header "
                "'Authorization: Bearer <key>'.",
            }
        }


@pytest.mark.parametrize("path", ["/encode", "/scheduler_receive_url", "/health"])
def test_handoff_routes_need_the_key_outside_the_engine_networks(strict, path):
    """sglang's routes do the same work as /v1/encode: keyless only from
    handoff.engine_callers.networks, none here (tests/serve/test_handoff.py has the rest)."""
    send = requests.get if path == "/health" else requests.post
    response = send(f"{strict}{path}", json={}, timeout=60)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["type"] == "unauthorized", response.text
    assert "handoff.engine_callers.networks" in response.json()["error"]["message"]
    # The refusal left the app serving: /health with the key is 200 once a rank answers its
    # load report within 1 s (on a starved machine a late report is a 503, "unavailable").
    ok = wait_for(lambda: healthy_now(strict), 30, "the strict app's /health after a refusal")
    assert ok.json() == {"status": "ok"}


def test_the_key_opens_and_healthz_stays_open(strict):
    assert requests.get(f"{strict}/healthz", timeout=30).json() == {"status": "ok"}
    response = requests.post(f"{strict}/v1/encode", json=small_body(), headers=auth(), timeout=60)
    assert response.status_code == 200, response.text
    assert requests.get(f"{strict}/v1/info", headers=auth(), timeout=60).json()["dp_size"] == 1
    assert "ranks" in requests.get(f"{strict}/v1/load", headers=auth(), timeout=60).json()
    # A bad body with a bad key is refused for the key: nothing is parsed before the check.
    response = requests.post(
        f"{strict}/v1/encode", data=b"\x80\x04junk", headers=auth(WRONG), timeout=60
    )
    assert response.status_code == 401


def test_request_timeout_gives_504_and_the_rank_recovers(strict, board):
    """The rank's forward held past request_timeout_s: 504 at the deadline, naming the
    limit; released, the rank serves again, the same process."""
    pids = replica_pids(strict, "strict", auth())
    ray.get(board.set.remote(0, "hold"))
    started = time.perf_counter()
    try:
        response = requests.post(
            f"{strict}/v1/encode", json=small_body(), headers=auth(), timeout=60
        )
    finally:
        ray.get(board.set.remote(0, "run"))
    elapsed = time.perf_counter() - started
    assert response.status_code == 504, response.text[:300]
    error = response.json()["error"]
    assert error["type"] == "timeout", error
    assert f"request_timeout_s={TIMEOUT_S:g} s" in error["message"], error
    assert elapsed < TIMEOUT_S + 2.0, elapsed  # answered at the deadline, not after the rank
    # The rank finishes or drops the abandoned work, then serves again: same process.
    deadline = time.monotonic() + 60
    while True:
        response = requests.post(
            f"{strict}/v1/encode", json=small_body(), headers=auth(), timeout=60
        )
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        assert response.status_code == 504, response.text
        time.sleep(0.5)
    assert response.status_code == 200, response.text
    assert replica_pids(strict, "strict", auth()) == pids


def test_the_key_is_never_logged(strict):
    """After the requests above (right and wrong keys), no Ray log file holds either key."""
    encode(strict, [{"type": "image", "image": b64(GOOD)}])  # unauthorized, logged as a 401
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert any("EncodeServer" in p.name for p in files), "no ingress log found"
    for path in files:
        data = path.read_bytes()
        assert KEY.encode() not in data, path
        assert WRONG.encode() not in data, path


def test_default_config_binds_loopback_and_has_no_key_in_it():
    config = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    for name in ("config.yaml", "k3-8gpu.yaml"):
        (app,) = yaml.safe_load((ROOT / "configs" / name).read_text())["applications"]
        # only ingress.api_key_file (or the env var) may hold it
        assert "api_key" not in app["args"].get("ingress", {})
