"""Image references to bytes: data URLs and base64 inline, http(s) only by policy.

An engine forwards whatever its client put in the prompt, so a reference can
point anywhere. Inline data is decoded here; a URL is fetched only when the
policy allows it, from a public address (checked after resolving the host, and
the connection goes to the address that was checked), without redirects, within
a byte cap and a deadline. Local files and every other scheme are refused.
"""

from __future__ import annotations

import http.client
import ipaddress
import re
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from .. import b64
from ..items import EncoderInputError, LimitExceededError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_CHUNK = 1 << 16
INLINE_FORMS = "a data URL (data:image/png;base64,...) or plain base64"


@dataclass(frozen=True)
class FetchPolicy:
    """What an image reference may make this server read."""

    # Off by default: fetching a client's URL makes the server a client of anyone.
    allow_http: bool = False
    # Loopback, private, link-local and other non-global unicast addresses.
    allow_private_networks: bool = False
    max_bytes: int = 64 * 1024 * 1024
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {self.max_bytes}.")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}.")


def read_image_ref(ref: str, policy: FetchPolicy, index: int | None = None) -> bytes:
    """The encoded image a reference names: a data URL, base64, or an http(s) URL.

    Blocks while fetching a URL: call it through ``asyncio.to_thread`` from a loop.
    """
    match = _SCHEME.match(ref)
    scheme = match.group(1).lower() if match else None
    if scheme == "data":
        return decode_data_url(ref, policy.max_bytes, index)
    if scheme in ("http", "https"):
        return fetch_url(ref, policy, index)
    if scheme is None:
        return decode_base64(ref, policy.max_bytes, index, what="plain base64")
    raise EncoderInputError(
        f"image reference with scheme {scheme!r} is refused ({_short(ref)}); send "
        f"{INLINE_FORMS}, or an http(s) URL where this server fetches URLs.",
        index,
    )


def decode_data_url(ref: str, max_bytes: int, index: int | None = None) -> bytes:
    """Bytes of ``data:[<media type>];base64,<data>``; the media type is not checked."""
    header, sep, payload = ref.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise EncoderInputError(
            f"data URL is not base64 ({_short(ref)}); send data:<media type>;base64,<data>.",
            index,
        )
    return decode_base64(payload, max_bytes, index, what="data URL")


def decode_base64(text: str, max_bytes: int, index: int | None = None, *, what: str) -> bytes:
    if len(text) // 4 * 3 > max_bytes:
        raise LimitExceededError(
            f"{what} holds about {len(text) // 4 * 3} bytes, over the limit of {max_bytes}; "
            "send a smaller image.",
            index,
        )
    try:
        data = b64.decode(text)
    except ValueError:  # binascii.Error included
        raise EncoderInputError(
            f"{what} is not valid base64 ({_short(text)}); send {INLINE_FORMS} without "
            "line breaks. Local file paths are refused.",
            index,
        ) from None
    if not data:
        raise EncoderInputError(f"{what} is empty; send the image's bytes.", index)
    return data


def fetch_url(url: str, policy: FetchPolicy, index: int | None = None) -> bytes:
    """GET an http(s) URL under ``policy``: one request, no redirects, capped, timed."""
    if not policy.allow_http:
        raise EncoderInputError(
            f"this server does not fetch image URLs (received {_short(url)}); send "
            f"{INLINE_FORMS}, or enable URL fetching in the server's fetch policy.",
            index,
        )
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise EncoderInputError(f"image URL has an invalid port: {_short(url)}.", index) from None
    if not parts.hostname or parts.username is not None or parts.password is not None:
        raise EncoderInputError(
            f"image URL must name a host and carry no credentials: {_short(url)}.", index
        )
    https = parts.scheme.lower() == "https"
    port = port or (443 if https else 80)
    deadline = time.monotonic() + policy.timeout_s
    address = resolve_allowed(parts.hostname, port, policy, index)
    conn_cls = _PinnedHTTPS if https else _PinnedHTTP
    conn = conn_cls(parts.hostname, port, address, policy.timeout_s)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request("GET", target, headers={"Accept": "image/*", "User-Agent": "kimi-encoder"})
        response = conn.getresponse()
        if 300 <= response.status < 400:
            raise EncoderInputError(
                f"image URL {_short(url)} answered {response.status} (redirect to "
                f"{response.getheader('Location')!r}); redirects are not followed: send the "
                "final URL.",
                index,
            )
        if response.status != 200:
            raise EncoderInputError(
                f"image URL {_short(url)} answered HTTP {response.status} {response.reason}; "
                "send a URL that serves the image.",
                index,
            )
        return _read_capped(conn, response, url, policy.max_bytes, deadline, index)
    except TimeoutError:
        raise EncoderInputError(
            f"image URL {_short(url)} took longer than {policy.timeout_s} s; send the image "
            "inline or from a faster host.",
            index,
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        raise EncoderInputError(
            f"could not fetch image URL {_short(url)} ({type(exc).__name__}: {exc}).", index
        ) from None
    finally:
        conn.close()


def resolve_allowed(host: str, port: int, policy: FetchPolicy, index: int | None = None) -> str:
    """The address to connect to; refuses the host if any of its addresses is refused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise EncoderInputError(f"cannot resolve image host {host!r} ({exc}).", index) from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        refusal = address_refusal(address, policy)
        if refusal is not None:
            raise EncoderInputError(
                f"image host {host!r} resolves to {address}, {refusal}; fetch images from "
                "public hosts only.",
                index,
            )
    return addresses[0]


def address_refusal(address: str, policy: FetchPolicy) -> str | None:
    """Why ``address`` may not be fetched from, or None if it may."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        return "a multicast, unspecified or reserved address (always refused)"
    if ip.is_global or policy.allow_private_networks:
        return None
    kind = "loopback" if ip.is_loopback else "link-local" if ip.is_link_local else "private"
    return f"a {kind} address (refused unless the fetch policy allows private networks)"


def _read_capped(conn, response, url: str, max_bytes: int, deadline: float, index) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise LimitExceededError(
            f"image URL {_short(url)} declares {declared} bytes, over the limit of "
            f"{max_bytes}; send a smaller image.",
            index,
        )
    chunks, total = [], 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        conn.live_socket.settimeout(remaining)
        chunk = response.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise LimitExceededError(
                f"image URL {_short(url)} sent more than {max_bytes} bytes; send a smaller image.",
                index,
            )
        chunks.append(chunk)


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects to an address checked beforehand, not to a fresh DNS answer."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address
        # http.client drops ``sock`` once a response will close the connection.
        self.live_socket: socket.socket | None = None

    def connect(self) -> None:
        self.sock = self.live_socket = socket.create_connection(
            (self._address, self.port), self.timeout
        )


class _PinnedHTTPS(_PinnedHTTP):
    default_port = 443

    def connect(self) -> None:
        super().connect()
        context = ssl.create_default_context()
        self.sock = self.live_socket = context.wrap_socket(self.sock, server_hostname=self.host)


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
