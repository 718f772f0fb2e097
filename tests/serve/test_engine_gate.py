"""The engines' routes with an API key set, over real HTTP (handoff.engine_callers).

Runs in both passes of ``make test``: behind Serve's proxy, a keyless caller from the
engine networks (loopback by default) is served on sglang's three routes and one outside
them is refused before its body is read; behind Serve's HAProxy ingress
(``RAY_SERVE_ENABLE_HA_PROXY=1``), which passes no caller address, every keyless call is
refused. Everywhere: the key opens every route, /v1/* needs it, a forwarded address is
never trusted, and a refused call encodes and pushes nothing. IPv6 and IPv4-mapped peers
are covered on the gate itself (tests/deployments/test_engine_gate_rules.py) and by the
interop service, whose proxy listens on '::' (tests/interop).
"""

from __future__ import annotations

import pytest
import requests
import zmq
from images import image_bytes
from serve_helpers import app_args, data_url, served
from serve_helpers import sglang_part as part

from deployments.engine_gate import behind_haproxy

KEY = "gate-key-5d1e0a77"
HAPROXY = behind_haproxy()  # the pass this module runs in (Serve reads the same variable)
IMAGE = data_url(image_bytes("RGB", (64, 48), 7))
ROUTES = ["/encode", "/scheduler_receive_url", "/health"]


def auth() -> dict:
    return {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gate") / "key"
    path.write_text(KEY)
    return str(path)


@pytest.fixture(scope="module")
def gated(serve_url, key_file):
    """A key, and the default engine networks (loopback)."""
    args = app_args(dp_size=1, ingress={"api_key_file": key_file})
    with served(serve_url, "gated", args) as url:
        yield url


@pytest.fixture(scope="module")
def gated_far(serve_url, key_file):
    """A key, and engine networks that leave loopback out: every keyless caller here is out."""
    args = app_args(
        dp_size=1,
        ingress={"api_key_file": key_file},
        handoff={"engine_callers": {"networks": ["10.0.0.0/8", "fd00::/8"]}},
    )
    with served(serve_url, "gated_far", args) as url:
        yield url


@pytest.fixture
def pull():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"127.0.0.1:{port}"
    ctx.destroy(linger=0)


def call(url: str, route: str, address: str, headers: dict | None = None) -> requests.Response:
    if route == "/health":
        return requests.get(f"{url}{route}", headers=headers, timeout=60)
    if route == "/encode":
        body = part(f"gate-{route}-{address}", [IMAGE], address)
    else:
        body = {"req_id": "gate-r", "receive_count": 1, "receive_url": address, "modality": "IMAGE"}
    return requests.post(f"{url}{route}", json=body, headers=headers, timeout=60)


def encoded(url: str) -> int:
    info = requests.get(f"{url}/v1/info", headers=auth(), timeout=30).json()
    return sum(rank.get("items", 0) for rank in info["ranks"])


def assert_refused(response: requests.Response, why: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    message = response.json()["error"]["message"]
    assert why in message, message
    assert "handoff.engine_callers.networks" in message


@pytest.mark.parametrize("route", ROUTES)
def test_keyless_loopback_caller(gated, pull, route):
    """Served behind Serve's proxy (loopback is an engine network); refused behind HAProxy,
    where every caller arrives from HAProxy's own address."""
    sock, address = pull
    before = encoded(gated)
    response = call(gated, route, address)
    if HAPROXY:
        assert_refused(response, "HAProxy forwards every call from its own address")
        assert encoded(gated) == before
        assert not sock.poll(200), "a refused part was pushed"
        return
    assert response.status_code == 200, response.text
    if route == "/encode":
        assert sock.poll(30_000), "the served part was not pushed"


@pytest.mark.parametrize("route", ROUTES)
def test_keyless_caller_outside_the_networks_is_refused(gated_far, pull, route):
    sock, address = pull
    before = encoded(gated_far)
    why = "HAProxy forwards" if HAPROXY else "the caller 127.0.0.1 is outside the networks"
    assert_refused(call(gated_far, route, address), why)
    assert encoded(gated_far) == before  # nothing encoded
    assert not sock.poll(200), "a refused part was pushed"


@pytest.mark.parametrize("route", ROUTES)
def test_the_key_opens_every_route_from_anywhere(gated_far, pull, route):
    sock, address = pull
    response = call(gated_far, route, address, headers=auth())
    assert response.status_code == 200, response.text
    if route == "/encode":
        assert sock.poll(30_000), "the served part was not pushed"


@pytest.mark.parametrize("route", ROUTES)
def test_a_forwarded_address_is_not_trusted(gated, pull, route):
    """A client's X-Forwarded-For claiming loopback: Serve's proxy and HAProxy both let
    uvicorn put it in the scope, neither sets it itself."""
    sock, address = pull
    spoofed = {"x-forwarded-for": "127.0.0.1"}
    why = "HAProxy forwards" if HAPROXY else "carries x-forwarded-for"
    assert_refused(call(gated, route, address, headers=spoofed), why)
    assert not sock.poll(200)


def test_v1_routes_still_need_the_key(gated):
    body = {"items": [{"type": "image", "image": IMAGE.split(",", 1)[1]}]}
    for response in (
        requests.post(f"{gated}/v1/encode", json=body, timeout=60),
        requests.get(f"{gated}/v1/info", timeout=30),
    ):
        assert response.status_code == 401, response.text
        assert "missing or wrong API key" in response.json()["error"]["message"]
    assert requests.post(f"{gated}/v1/encode", json=body, headers=auth(), timeout=60).ok
