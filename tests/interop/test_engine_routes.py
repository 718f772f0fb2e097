"""The keyed interop service's routes from IPv6 and IPv4-mapped peers (.venv-vllm).

Its proxy listens on '::', so a caller at ::1 is an IPv6 peer and one at 127.0.0.1 an
IPv4-mapped one (::ffff:127.0.0.1). Both are loopback, the default engine networks:
sglang's routes serve them without the key, /v1/* does not.
"""

from __future__ import annotations

import pytest
import requests
from keyed import AUTH

PEERS = {"ipv6": "[::1]", "ipv4-mapped": "127.0.0.1"}


def _url(service, host: str) -> str:
    return service.urls["bf16"].replace("127.0.0.1", host, 1)


@pytest.mark.parametrize("peer", PEERS.values(), ids=PEERS.keys())
def test_engine_routes_serve_keyless_loopback_peers(service, peer):
    url = _url(service, peer)
    assert requests.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
    body = {
        "req_id": "routes-1",
        "receive_count": 1,
        "receive_url": "127.0.0.1:9",
        "modality": "IMAGE",
    }
    answer = requests.post(f"{url}/scheduler_receive_url", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    answer = requests.post(f"{url}/encode", json={"req_id": "x"}, timeout=30)
    assert answer.status_code == 400, answer.text  # past the gate: its body was read


@pytest.mark.parametrize("peer", PEERS.values(), ids=PEERS.keys())
def test_v1_routes_need_the_key_from_every_peer(service, peer):
    url = _url(service, peer)
    assert requests.get(f"{url}/v1/info", timeout=30).status_code == 401
    assert requests.get(f"{url}/v1/info", headers=AUTH, timeout=30).status_code == 200
