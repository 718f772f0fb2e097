"""Who may call the engines' routes without the API key.

sglang's prefill sends no ``Authorization`` header, so with a key configured its routes
(``/encode``, ``/scheduler_receive_url``, ``/health``) would refuse it. ``EngineGate``
serves a keyless caller there only from ``handoff.engine_callers.networks`` (default:
loopback); a caller with the key is served from anywhere, and ``/v1/*`` keeps requiring
the key (``security.ApiKey``). Without a key every caller is served, as before.

The caller's address is read from the ASGI scope before the body is, and only where the
proxy in front of the application vouches for it (measured with Ray Serve 2.60):

- **Serve's proxy** puts the TCP peer it accepted in the scope's ``client``. Its uvicorn
  replaces that with an ``X-Forwarded-For`` value when the peer is loopback, and neither
  Serve's proxy nor HAProxy ever sets that header: a request that carries one (or
  ``Forwarded``, ``X-Real-IP``) has an address a client wrote, and is not served keyless.
- **Serve's HAProxy ingress** (``RAY_SERVE_ENABLE_HA_PROXY=1``) forwards with no
  ``X-Forwarded-For`` and no PROXY protocol: the replica sees HAProxy's own address for
  every caller (loopback on one node). The caller's address does not reach the
  application, so every keyless call is refused there, with a message saying so.

An IPv4-mapped IPv6 peer (``::ffff:10.1.2.3``, a dual-stack proxy's view of an IPv4
caller) is checked as its IPv4 address.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from starlette.requests import Request

from kimi_encoder.engines.transport import Network, parse_networks

from .security import ApiKey, UnauthorizedError

SETTING = "handoff.engine_callers.networks"
FORWARDING_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")


class KeylessCallerRefused(UnauthorizedError):
    """A caller without the key outside the engines' networks, or whose address cannot be
    known (HTTP 401, before its body is read)."""

    def __init__(self, message: str):
        Exception.__init__(self, message)


def behind_haproxy(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether Serve runs its HAProxy ingress here (read as Serve reads it)."""
    return environ.get("RAY_SERVE_ENABLE_HA_PROXY", "0") == "1"


def check_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    try:
        return parse_networks(cidrs)
    except ValueError as exc:
        raise ValueError(str(exc).replace("receive network", f"{SETTING} entry", 1)) from None


@dataclass(frozen=True)
class EngineGate:
    """``check`` is ``ApiKey.check`` for the engines' routes: the key, or a keyless caller
    from ``networks`` as the proxy saw it."""

    api_key: ApiKey
    networks: tuple[Network, ...]
    haproxy: bool = False

    @classmethod
    def of(cls, api_key: ApiKey, cidrs: Iterable[str], haproxy: bool) -> EngineGate:
        return cls(api_key, check_networks(cidrs), haproxy)

    @property
    def required(self) -> bool:
        return self.api_key.required

    def check(self, request: Request) -> None:
        """Raise ``KeylessCallerRefused`` (401) unless the request carries the key or comes,
        without it, from the engines' networks."""
        if self.api_key.allows(request.headers.get("authorization")):
            return
        self.check_caller(request.scope)

    def check_caller(self, scope: Mapping) -> None:
        shown = ", ".join(map(str, self.networks)) or "none"
        fix = (
            f"Send 'Authorization: Bearer <key>', or call from a network listed in {SETTING} "
            f"(now: {shown})."
        )
        if self.haproxy:
            raise KeylessCallerRefused(
                "no API key, and behind Serve's HAProxy ingress the caller's address does not "
                "reach this application (HAProxy forwards every call from its own address), so "
                f"{SETTING} cannot admit it. Send the key, or serve the engines through "
                "Serve's proxy (without RAY_SERVE_ENABLE_HA_PROXY)."
            )
        headers = {k.decode("latin-1").lower() for k, _ in scope.get("headers", ())}
        forwarded = [h for h in FORWARDING_HEADERS if h in headers]
        if forwarded:
            raise KeylessCallerRefused(
                f"no API key, and the request carries {', '.join(forwarded)}: an address a "
                f"client wrote (neither Serve's proxy nor HAProxy sets it) cannot admit a "
                f"keyless call. {fix}"
            )
        ip = caller_ip(scope)
        if ip is None or not any(ip in network for network in self.networks):
            got = "an unknown address" if ip is None else str(ip)
            raise KeylessCallerRefused(
                f"no API key, and the caller {got} is outside the networks whose keyless "
                f"calls the engines' routes serve. {fix}"
            )


def caller_ip(scope: Mapping) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The scope's client address (an IPv4-mapped one as IPv4), or None."""
    client = scope.get("client")
    if not client:
        return None
    try:
        ip = ipaddress.ip_address(str(client[0]).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip
