"""Pushing multipart messages to an engine's ZMQ PULL sockets.

Every send is bounded: a PUSH socket refuses to queue a message while it has no
finished connection (``IMMEDIATE``) and gives up after ``send_timeout_s``
(``SNDTIMEO``), so a dead or stalled receiver costs one timeout, never a hang.
Once queued, a message has ``linger_s`` to leave after its socket is closed.

Where a message may go is decided before any socket exists: an engine names its
receive address in a request anyone on the network can send, so
``ReceivePolicy`` resolves the address once, requires every address it resolves
to to lie in an allowed network, and hands back the ``tcp://ip:port`` endpoint of
the address it checked. ZMQ then connects to that IP, never to a fresh DNS answer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import zmq
import zmq.asyncio

from ..items import EncoderInputError

Frame = bytes | memoryview
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Loopback and the private ranges: where a prefill listens on a cluster's own network.
# Link-local (169.254.0.0/16, fe80::/10) is left out: cloud metadata services live
# there (169.254.169.254), and a prefill is reached at a routable address.
DEFAULT_RECEIVE_NETWORKS = (
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fc00::/7",
)


class PushError(ConnectionError):
    """A message could not be handed to a receiver (nothing listening, or stalled)."""


class ReceiveAddressRefused(EncoderInputError):
    """A receive address that is malformed, does not resolve, or resolves outside the
    allowed networks (HTTP 400). Nothing has connected to it."""


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``, ``[v6]:port`` or, as the last colon splits it,
    ``v6:port``; the host may be a name. Raises ``ValueError``."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not _is_v6(host):
            host = ""
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(
            f"receive address must be 'host:port' with a port in 1-65535 (IPv6 as "
            f"'[addr]:port'), got {address!r}."
        )
    return host, int(port)


def tcp_endpoint(host_port: str) -> str:
    """``tcp://host:port`` from ``host:port`` or ``[v6]:port``, as engines send them.

    Formats only: a name stays a name. What is pushed to comes from ``ReceivePolicy``.
    """
    host, port = split_address(host_port)
    return f"tcp://{_bracketed(host)}:{port}"


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """The networks of ``cidrs`` (``'10.0.0.0/8'``, ``'fd00::/8'``; a bare address is a
    network of one); raises ``ValueError`` naming the first that is not one."""
    networks = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr))
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"receive network {cidr!r} is not a network in CIDR notation ({exc}); write "
                "it as an address and a prefix length, e.g. '10.0.0.0/8' or 'fd00::/8'."
            ) from None
    return tuple(networks)


class Resolved(NamedTuple):
    """A receive address as it was sent, and the IP and port it was checked as."""

    address: str
    ip: str
    port: int

    @property
    def host_port(self) -> str:
        """``ip:port`` (``[ip]:port`` for IPv6): the checked address, as engines write one."""
        return f"{_bracketed(self.ip)}:{self.port}"

    @property
    def endpoint(self) -> str:
        """``tcp://ip:port``: what a PUSH socket connects to."""
        return f"tcp://{self.host_port}"


@dataclass(frozen=True)
class ReceivePolicy:
    """Which receive addresses frames may be pushed to: those whose every resolved
    address lies in one of ``networks``.

    >>> policy = ReceivePolicy.from_cidrs(["10.0.0.0/8"], setting="receive_networks")
    >>> policy.check("10.1.2.3:5000").endpoint
    'tcp://10.1.2.3:5000'
    >>> policy.check("[::ffff:10.1.2.3]:5000").endpoint  # IPv4-mapped: checked as IPv4
    'tcp://10.1.2.3:5000'
    """

    networks: tuple[Network, ...] = parse_networks(DEFAULT_RECEIVE_NETWORKS)
    # The setting a refusal tells the operator to change.
    setting: str = "the allowed receive networks"

    @classmethod
    def from_cidrs(cls, cidrs: Iterable[str], setting: str) -> ReceivePolicy:
        return cls(parse_networks(cidrs), setting)

    def check(self, address: str) -> Resolved:
        """``address`` (``host:port``) resolved once and checked; raises
        ``ReceiveAddressRefused``. Blocks while a name resolves: from an event loop,
        call ``check_async``."""
        host, port = self._split(address)
        literal = _ip(host)
        if literal is not None:
            ips = [literal]
        else:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError, ValueError) as exc:
                raise ReceiveAddressRefused(
                    f"receive address {address!r} does not resolve ({exc}); nothing was sent "
                    "to it. Send an address this encoder can resolve."
                ) from None
            ips = list(dict.fromkeys(_ip(info[4][0]) for info in infos))
        return Resolved(address, str(self._allowed(address, ips)), port)

    async def check_async(self, address: str) -> Resolved:
        """``check`` without blocking the loop: a name resolves in a worker thread."""
        host, _ = self._split(address)
        if _ip(host) is not None:
            return self.check(address)
        return await asyncio.to_thread(self.check, address)

    def _split(self, address: str) -> tuple[str, int]:
        try:
            return split_address(address)
        except ValueError as exc:
            raise ReceiveAddressRefused(f"{exc} Nothing was sent to it.") from None

    def _allowed(self, address: str, ips: list[IPAddress]) -> IPAddress:
        """The first of ``ips`` once all are allowed (``getaddrinfo``'s order)."""
        shown = ", ".join(map(str, ips))
        for ip in ips:
            if ip.is_unspecified or ip.is_multicast:
                raise ReceiveAddressRefused(
                    f"receive address {address!r} resolves to {shown}: {ip} is an unspecified "
                    "or multicast address, never a receive address; nothing was sent to it."
                )
            if not any(ip in network for network in self.networks):
                allowed = ", ".join(map(str, self.networks)) or "none"
                raise ReceiveAddressRefused(
                    f"receive address {address!r} resolves to {shown}: {ip} is outside the "
                    f"networks this encoder pushes to ({allowed}); nothing was sent to it. "
                    f"To push there, add its network to {self.setting}."
                )
        return ips[0]


def _ip(host: str) -> IPAddress | None:
    """``host`` as an IP address (an IPv4-mapped IPv6 address as its IPv4), else None."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _is_v6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass
class _Entry:
    socket: zmq.asyncio.Socket
    busy: int = 0


@dataclass
class ZmqPusher:
    """PUSH sockets by endpoint, kept for reuse up to ``max_cached``; use from one loop."""

    send_timeout_s: float = 30.0
    linger_s: float = 30.0
    # Messages queued per socket before a send waits (and then times out).
    send_hwm: int = 16
    max_cached: int = 64
    _context: zmq.asyncio.Context = field(
        default_factory=zmq.asyncio.Context, init=False, repr=False
    )
    _sockets: OrderedDict[str, _Entry] = field(default_factory=OrderedDict, init=False, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.send_timeout_s > 0 or self.linger_s < 0:
            raise ValueError(
                f"send_timeout_s must be positive and linger_s non-negative, got "
                f"{self.send_timeout_s} and {self.linger_s}."
            )
        if self.send_hwm < 1 or self.max_cached < 1:
            raise ValueError(
                f"send_hwm and max_cached must be at least 1, got {self.send_hwm} and "
                f"{self.max_cached}."
            )

    async def send(self, endpoint: str, frames: Sequence[Frame], *, reuse: bool = True) -> None:
        """Queue one multipart message for ``endpoint`` (``tcp://host:port``).

        ``reuse=False`` is for one-off receivers (a port opened for one request):
        the socket is closed right after the send instead of being cached.
        Frames are not copied; pyzmq keeps them alive until they have left.
        """
        self._check_loop()
        entry = self._sockets.get(endpoint) if reuse else None
        if entry is None:
            entry = _Entry(self._open(endpoint), busy=1)
            if reuse:
                self._sockets[endpoint] = entry
                self._evict_idle()
        else:
            entry.busy += 1
            self._sockets.move_to_end(endpoint)
        try:
            await entry.socket.send_multipart(list(frames), copy=False)
        except zmq.ZMQError as exc:
            self._drop(endpoint, entry)
            raise PushError(
                f"could not send to {endpoint} within {self.send_timeout_s} s "
                f"({type(exc).__name__}: {exc}); the receiver is gone or not reading."
            ) from None
        finally:
            entry.busy -= 1
        if not reuse:
            entry.socket.close(linger=int(self.linger_s * 1000))

    def close(self, linger_s: float = 0.0) -> None:
        """Close every socket; queued messages get ``linger_s`` to leave (this blocks)."""
        self._sockets.clear()
        self._context.destroy(linger=int(linger_s * 1000))

    @property
    def cached(self) -> list[str]:
        return list(self._sockets)

    def _open(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        sock.setsockopt(zmq.SNDTIMEO, int(self.send_timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, int(self.linger_s * 1000))
        sock.connect(endpoint)
        return sock

    def _drop(self, endpoint: str, entry: _Entry) -> None:
        if self._sockets.get(endpoint) is entry:
            del self._sockets[endpoint]
        entry.socket.close(linger=0)

    def _evict_idle(self) -> None:
        # Oldest first; a socket with a send in flight stays until it is done.
        for endpoint in [e for e, entry in self._sockets.items() if entry.busy == 0]:
            if len(self._sockets) <= self.max_cached:
                return
            self._sockets.pop(endpoint).socket.close()

    def _check_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("ZmqPusher is bound to the event loop it first sent from.")
