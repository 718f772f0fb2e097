"""The engines' routes gate (deployments/engine_gate.py) on ASGI scopes as Serve's proxy
and its HAProxy ingress hand them over: IPv4, IPv6 and IPv4-mapped peers, forwarded
headers, the key. tests/serve/test_engine_gate.py runs the same over real HTTP."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.args import HandoffArgs
from deployments.engine_gate import EngineGate, KeylessCallerRefused, caller_ip
from deployments.errors import classify, error_headers
from deployments.security import ApiKey

KEY = "gate-test-key"
DEFAULT = HandoffArgs().engine_callers.networks


def scope(client, headers=()) -> dict:
    return {
        "type": "http",
        "client": client,
        "headers": [(k.encode(), v.encode()) for k, v in headers],
    }


def gate(networks=DEFAULT, haproxy=False, key=KEY) -> EngineGate:
    return EngineGate.of(ApiKey(key), networks, haproxy)


@pytest.mark.parametrize(
    ("client", "networks"),
    [
        (("127.0.0.1", 5000), DEFAULT),
        (("::1", 5000), DEFAULT),
        (("::ffff:127.0.0.1", 5000), DEFAULT),  # a dual-stack proxy's view of IPv4 loopback
        (("10.1.2.3", 5000), ["10.0.0.0/8"]),
        (("::ffff:10.1.2.3", 5000), ["10.0.0.0/8"]),
        (("fd00::7", 5000), ["fd00::/8"]),
    ],
    ids=["v4-loopback", "v6-loopback", "mapped-loopback", "v4-listed", "mapped-listed", "v6"],
)
def test_keyless_callers_inside_the_networks_pass(client, networks):
    gate(networks).check_caller(scope(client))


@pytest.mark.parametrize(
    ("client", "shown"),
    [
        (("10.1.2.3", 5000), "10.1.2.3"),
        (("2001:db8::5", 5000), "2001:db8::5"),
        (("::ffff:192.168.0.9", 5000), "192.168.0.9"),
        (None, "an unknown address"),
        (("not-an-ip", 1), "an unknown address"),
    ],
    ids=["v4", "v6", "mapped", "no-client", "garbage"],
)
def test_keyless_callers_outside_are_refused_naming_the_setting(client, shown):
    with pytest.raises(
        KeylessCallerRefused,
        match=rf"the caller {shown} is outside .* handoff\.engine_callers\.networks "
        r"\(now: 127\.0\.0\.0/8, ::1/128\)",
    ) as caught:
        gate().check_caller(scope(client))
    assert classify(caught.value) == (401, "unauthorized")
    assert error_headers(caught.value) == {"WWW-Authenticate": "Bearer"}


@pytest.mark.parametrize("header", ["X-Forwarded-For", "Forwarded", "X-Real-IP"])
def test_a_forwarded_address_is_never_trusted(header):
    # Serve's proxy puts an X-Forwarded-For value in `client` when its peer is loopback.
    with pytest.raises(KeylessCallerRefused, match=f"carries {header.lower()}"):
        gate().check_caller(scope(("127.0.0.1", 0), [(header, "127.0.0.1")]))


@pytest.mark.parametrize("client", [("127.0.0.1", 40290), ("::1", 1)], ids=["v4", "v6"])
def test_behind_haproxy_keyless_calls_are_refused(client):
    with pytest.raises(KeylessCallerRefused, match="HAProxy forwards every call from its own"):
        gate(haproxy=True).check_caller(scope(client))


def test_the_key_passes_from_anywhere_and_no_key_means_open():
    class Req:
        def __init__(self, headers, client):
            self.headers = dict(headers)
            self.scope = scope(client)

    far = ("203.0.113.7", 1)
    gate(haproxy=True).check(Req({"authorization": f"Bearer {KEY}"}, far))
    gate(key=None).check(Req({}, far))  # no key configured: as before
    with pytest.raises(KeylessCallerRefused):
        gate().check(Req({"authorization": "Bearer wrong"}, far))


def test_mapped_addresses_read_as_ipv4():
    assert str(caller_ip(scope(("::ffff:10.0.0.1", 1)))) == "10.0.0.1"
    assert str(caller_ip(scope(("fe80::1%eth0", 1)))) == "fe80::1"


def test_a_bad_network_fails_the_config_naming_it():
    with pytest.raises(
        ValidationError, match=r"handoff\.engine_callers\.networks entry '10\.0\.0\.0/33'"
    ):
        HandoffArgs(engine_callers={"networks": ["10.0.0.0/33"]})
