"""Pushing multipart messages to an engine's ZMQ PULL sockets.

Every send is bounded: a PUSH socket refuses to queue a message while it has no
finished connection (``IMMEDIATE``) and gives up after ``send_timeout_s``
(``SNDTIMEO``), so a dead or stalled receiver costs one timeout, never a hang.
Once queued, a message has ``linger_s`` to leave after its socket is closed.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

Frame = bytes | memoryview


class PushError(ConnectionError):
    """A message could not be handed to a receiver (nothing listening, or stalled)."""


def tcp_endpoint(host_port: str) -> str:
    """``tcp://host:port`` from ``host:port`` or ``[v6]:port``, as engines send them."""
    host, sep, port = host_port.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"receive address must be 'host:port' (IPv6 as '[addr]:port'), got {host_port!r}."
        )
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


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
