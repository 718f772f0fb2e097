"""Where frames may be pushed: ``ReceivePolicy`` (resolve once, check every address,
connect to the IP that was checked) and the hand-off setting that configures it.
The ZMQ pusher itself is tested in test_engines_sglang.py."""

import asyncio
import re
import socket
import threading
import time

import pytest
import zmq
from pydantic import ValidationError

from deployments.args import AppArgs
from kimi_encoder.engines.sglang import EncodeRequest, ReceiverRegistry, ReceiveUrlRequest, deliver
from kimi_encoder.engines.transport import (
    DEFAULT_RECEIVE_NETWORKS,
    ReceiveAddressRefused,
    ReceivePolicy,
    ZmqPusher,
    parse_networks,
    split_address,
)
from kimi_encoder.items import EncoderInputError

DEFAULT = ReceivePolicy()
NO_LOOPBACK = ReceivePolicy.from_cidrs(["10.0.0.0/8"], setting="handoff.receive_networks")
OUTSIDE = "is outside the networks this encoder pushes to"


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("127.0.0.1:5000", "tcp://127.0.0.1:5000"),
        ("127.8.9.10:1", "tcp://127.8.9.10:1"),
        ("10.1.2.3:65535", "tcp://10.1.2.3:65535"),
        ("172.31.255.255:7", "tcp://172.31.255.255:7"),
        ("192.168.0.9:7", "tcp://192.168.0.9:7"),
        ("127.1:7", "tcp://127.0.0.1:7"),  # a short form the resolver reads
        ("[::1]:7", "tcp://[::1]:7"),
        ("[fd12:3456::1]:7", "tcp://[fd12:3456::1]:7"),
        ("fd00::1:7", "tcp://[fd00::1]:7"),  # unbracketed: the last colon splits
        ("[::ffff:10.0.0.1]:7", "tcp://10.0.0.1:7"),  # IPv4-mapped: checked as IPv4
    ],
    ids=["v4", "v4-loopback-net", "v4-10", "v4-172", "v4-192", "v4-short", "v6-loopback",
         "v6-ula", "v6-unbracketed", "v4-mapped"],
)  # fmt: skip
def test_default_networks_allow_loopback_and_private(address, endpoint):
    resolved = DEFAULT.check(address)
    assert resolved.endpoint == endpoint
    assert resolved.address == address


@pytest.mark.parametrize(
    ("address", "shown"),
    [
        ("8.8.8.8:5000", "8.8.8.8"),
        ("172.32.0.1:5000", "172.32.0.1"),  # just past 172.16.0.0/12
        ("169.254.169.254:80", "169.254.169.254"),  # link-local: cloud metadata
        ("[fe80::1]:5000", "fe80::1"),
        ("[2001:db8::1]:5000", "2001:db8::1"),
        ("[::ffff:8.8.8.8]:5000", "8.8.8.8"),
    ],
    ids=["public-v4", "past-172", "link-local-v4", "link-local-v6", "public-v6", "mapped"],
)
def test_default_networks_refuse_everything_else(address, shown):
    with pytest.raises(
        ReceiveAddressRefused,
        match=rf"receive address '{_re(address)}' resolves to {_re(shown)}: {_re(shown)} "
        rf"{OUTSIDE} \(127\.0\.0\.0/8, ::1/128, 10\.0\.0\.0/8, 172\.16\.0\.0/12, "
        r"192\.168\.0\.0/16, fc00::/7\); nothing was sent to it\. To push there, add its "
        r"network to the allowed receive networks\.",
    ):
        DEFAULT.check(address)


def test_listed_networks_are_allowed_and_only_they():
    policy = ReceivePolicy.from_cidrs(["169.254.0.0/16", "fe80::/10", "8.8.8.8"], setting="x")
    assert policy.check("169.254.1.2:80").endpoint == "tcp://169.254.1.2:80"
    assert policy.check("[fe80::1]:80").endpoint == "tcp://[fe80::1]:80"
    assert policy.check("8.8.8.8:53").endpoint == "tcp://8.8.8.8:53"
    with pytest.raises(ReceiveAddressRefused, match=rf"8\.8\.4\.4 {OUTSIDE}.*add its network to x"):
        policy.check("8.8.4.4:53")
    with pytest.raises(ReceiveAddressRefused, match=r"\(none\)"):
        ReceivePolicy.from_cidrs([], setting="x").check("127.0.0.1:5")


@pytest.mark.parametrize("address", ["0.0.0.0:5", "[::]:5", "224.0.0.1:5", "[ff02::1]:5"], ids=str)
def test_unspecified_and_multicast_are_never_receive_addresses(address):
    everything = ReceivePolicy.from_cidrs(["0.0.0.0/0", "::/0"], setting="x")
    with pytest.raises(ReceiveAddressRefused, match="an unspecified or multicast address"):
        everything.check(address)


def test_a_name_is_resolved_and_the_checked_ip_is_what_connects():
    resolved = DEFAULT.check("localhost:5000")
    assert resolved.address == "localhost:5000"
    assert resolved.endpoint in ("tcp://127.0.0.1:5000", "tcp://[::1]:5000")
    assert resolved.host_port in ("127.0.0.1:5000", "[::1]:5000")


def test_a_name_resolving_outside_is_refused_naming_what_it_resolved_to():
    with pytest.raises(
        ReceiveAddressRefused,
        match=r"receive address 'localhost:5000' resolves to (127\.0\.0\.1|::1)[^:]*: "
        rf"(127\.0\.0\.1|::1) {OUTSIDE} \(10\.0\.0\.0/8\); nothing was sent to it\. To push "
        r"there, add its network to handoff\.receive_networks\.",
    ):
        NO_LOOPBACK.check("localhost:5000")


def test_a_name_that_does_not_resolve_is_refused():
    # An over-long label fails in the name's encoding, before any resolver is asked.
    with pytest.raises(ReceiveAddressRefused, match=r"'x{300}:5' does not resolve \("):
        DEFAULT.check("x" * 300 + ":5")


@pytest.mark.parametrize(
    "address",
    ["10.0.0.1", "10.0.0.1:", ":5", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:http",
     "10.0.0.1:-5", "10.0.0.1:\uff15", "[prefill]:5", "[10.0.0.1]:5"],
    ids=["no-port", "empty-port", "no-host", "port-0", "port-65536", "port-name",
         "port-negative", "port-fullwidth-digit", "bracketed-name", "bracketed-v4"],
)  # fmt: skip
def test_bad_syntax_is_refused(address):
    with pytest.raises(
        ReceiveAddressRefused,
        match=r"receive address must be 'host:port' with a port in 1-65535 \(IPv6 as "
        rf"'\[addr\]:port'\), got '{_re(address)}'\. Nothing was sent to it\.",
    ):
        DEFAULT.check(address)
    assert issubclass(ReceiveAddressRefused, EncoderInputError)  # answered 400


def test_split_address():
    assert split_address("prefill-0.cluster:5000") == ("prefill-0.cluster", 5000)
    assert split_address("[::1]:5") == ("::1", 5)
    with pytest.raises(ValueError, match="got 'h:0'"):
        split_address("h:0")


def test_check_async_resolves_a_name_once_off_the_loop(monkeypatch):
    lookups = []
    getaddrinfo = socket.getaddrinfo

    def counted(*args, **kwargs):
        lookups.append(threading.get_ident())
        return getaddrinfo(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counted)

    async def main():
        literal = await DEFAULT.check_async("10.0.0.1:5")
        name = await DEFAULT.check_async("localhost:5")
        return literal, name, threading.get_ident()

    literal, name, loop_thread = asyncio.run(main())
    assert literal.endpoint == "tcp://10.0.0.1:5"
    assert name.host_port in ("127.0.0.1:5", "[::1]:5")
    assert len(lookups) == 1, "a literal is not looked up; a name once"
    assert lookups[0] != loop_thread


@pytest.mark.parametrize(
    ("cidr", "reason"),
    [
        ("10.0.0.1/8", "10.0.0.1/8 has host bits set"),
        ("10.0.0.0/33", "'10.0.0.0/33' does not appear to be an IPv4 or IPv6 network"),
        ("private", "'private' does not appear to be an IPv4 or IPv6 network"),
        ("fc00::/129", "'fc00::/129' does not appear"),
    ],
    ids=["host-bits", "prefix", "word", "v6-prefix"],
)
def test_bad_networks_fail_naming_the_entry(cidr, reason):
    with pytest.raises(ValueError, match=rf"receive network '{_re(cidr)}' is not a network"):
        parse_networks(["127.0.0.0/8", cidr])
    with pytest.raises(
        ValidationError,
        match=rf"handoff.receive_networks\n  Value error, receive network '{_re(cidr)}' is not "
        rf"a network in CIDR notation \({_re(reason)}.*e\.g\. '10\.0\.0\.0/8'",
    ):
        AppArgs.model_validate({"handoff": {"receive_networks": ["127.0.0.0/8", cidr]}})


def test_the_setting_defaults_to_loopback_and_private_and_is_named_in_refusals():
    args = AppArgs.model_validate({})
    assert args.handoff.receive_networks == list(DEFAULT_RECEIVE_NETWORKS)
    assert args.handoff.receive_policy() == ReceivePolicy(setting="handoff.receive_networks")
    listed = AppArgs.model_validate({"handoff": {"receive_networks": ["203.0.113.0/24"]}})
    policy = listed.handoff.receive_policy()
    assert policy.check("203.0.113.9:5").endpoint == "tcp://203.0.113.9:5"
    with pytest.raises(ReceiveAddressRefused, match=r"add its network to handoff\.receive_"):
        policy.check("127.0.0.1:5")


def _listener() -> tuple[socket.socket, int]:
    """A loopback TCP socket in listen mode, and its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock, sock.getsockname()[1]


def _assert_nothing_connected(sock: socket.socket) -> None:
    time.sleep(0.3)  # a ZMQ connect would have been made by its I/O thread by now
    with pytest.raises(BlockingIOError):
        sock.accept()


def _part(**fields) -> EncodeRequest:
    body = {
        "mm_items": ["x"],
        "num_parts": 1,
        "part_idx": 0,
        "req_id": "r_local_part_0",
        "modality": "IMAGE",
    }
    return EncodeRequest.from_json(body | fields)


@pytest.mark.parametrize("mode", ["zmq_to_tokenizer", "zmq_to_scheduler"])
def test_deliver_connects_nowhere_outside_the_networks(mode):
    listener, port = _listener()
    if mode == "zmq_to_tokenizer":
        req = _part(prefill_host="127.0.0.1", embedding_port=port)
    else:
        req = _part(prefill_host="127.0.0.1", embedding_port=None)

    async def main():
        pusher, registry = ZmqPusher(send_timeout_s=0.5), ReceiverRegistry()
        registry.register(ReceiveUrlRequest(req.req_id, 1, f"127.0.0.1:{port}", "IMAGE"))
        try:
            await deliver(req, [b"m"], pusher, registry, wait_s=1, policy=NO_LOOPBACK)
        finally:
            assert pusher.cached == []
            pusher.close()

    try:
        with pytest.raises(ReceiveAddressRefused, match=rf"'127\.0\.0\.1:{port}'.*{OUTSIDE}"):
            asyncio.run(main())
        _assert_nothing_connected(listener)
    finally:
        listener.close()


def test_deliver_pushes_to_the_ip_a_name_resolved_to():
    first = socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)[0][4][0]
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.IPV6, 1)
    pull.setsockopt(zmq.RCVTIMEO, 10_000)
    port = pull.bind_to_random_port(f"tcp://{'[::1]' if ':' in first else first}")
    req = _part(prefill_host="localhost", embedding_port=port)

    async def main():
        pusher = ZmqPusher(send_timeout_s=10)
        try:
            return await deliver(req, [b"m"], pusher, ReceiverRegistry(), wait_s=1)
        finally:
            pusher.close(linger_s=10)

    try:
        assert asyncio.run(main()) == [f"tcp://{'[::1]' if ':' in first else first}:{port}"]
        assert pull.recv_multipart() == [b"m"]
    finally:
        ctx.destroy(linger=0)


def test_a_bare_ipv6_prefill_host_is_bracketed():
    assert _part(prefill_host="fd00::2", embedding_port=9).receive_address == "[fd00::2]:9"
    assert _part(prefill_host="[fd00::2]", embedding_port=9).receive_address == "[fd00::2]:9"
    assert _part(prefill_host="10.0.0.2", embedding_port=9).receive_address == "10.0.0.2:9"


def _re(text: str) -> str:
    return re.escape(text)
