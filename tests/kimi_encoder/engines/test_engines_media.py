"""Image references under a fetch policy: inline data, refused schemes, guarded http."""

import base64
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from images import image_bytes

from kimi_encoder.engines.media import FetchPolicy, address_refusal, read_image_ref
from kimi_encoder.items import EncoderInputError, LimitExceededError

PNG = image_bytes("RGB", (64, 48), seed=5)
B64 = base64.b64encode(PNG).decode()
OFF = FetchPolicy()
LOOPBACK = FetchPolicy(
    allow_http=True, allow_private_networks=True, max_bytes=len(PNG) + 10, timeout_s=5
)


@pytest.mark.parametrize(
    "ref", [f"data:image/png;base64,{B64}", f"DATA:;BASE64,{B64}", B64], ids=["data", "bare", "b64"]
)
def test_inline_references(ref):
    assert read_image_ref(ref, OFF) == PNG


@pytest.mark.parametrize(
    ("ref", "error", "match"),
    [
        ("data:image/png;base64,@@@@", EncoderInputError, "data URL is not valid base64"),
        ("data:image/png,%89PNG", EncoderInputError, "data URL is not base64"),
        ("data:image/png;base64,", EncoderInputError, "data URL is empty"),
        ("/etc/hosts", EncoderInputError, "plain base64 is not valid base64.*paths are refused"),
        ("file:///etc/hosts", EncoderInputError, "scheme 'file' is refused"),
        ("ftp://example.com/a.png", EncoderInputError, "scheme 'ftp' is refused"),
        ("http://example.com/a.png", EncoderInputError, "does not fetch image URLs"),
        ("A" * 200, LimitExceededError, "holds about 150 bytes, over the limit of 100"),
    ],
    ids=["bad-b64", "not-b64", "empty", "path", "file", "ftp", "http-off", "over-cap"],
)
def test_refused_references(ref, error, match):
    with pytest.raises(error, match=match):
        read_image_ref(ref, FetchPolicy(max_bytes=100), index=2)


@pytest.mark.parametrize(
    ("address", "private_ok", "refusal"),
    [
        ("8.8.8.8", False, None),
        ("2606:4700::1111", False, None),
        ("127.0.0.1", False, "a loopback address"),
        ("::ffff:127.0.0.1", False, "a loopback address"),
        ("10.1.2.3", False, "a private address"),
        ("169.254.0.9", False, "a link-local address"),
        ("fd00::1", False, "a private address"),
        ("10.1.2.3", True, None),
        ("224.0.0.1", True, "always refused"),
        ("240.0.0.1", True, "always refused"),
        ("0.0.0.0", True, "always refused"),
    ],
)
def test_address_refusal(address, private_ok, refusal):
    policy = FetchPolicy(allow_http=True, allow_private_networks=private_ok)
    result = address_refusal(address, policy)
    assert result is None if refusal is None else refusal in result


def test_private_address_refused_when_http_is_allowed():
    policy = FetchPolicy(allow_http=True)
    with pytest.raises(EncoderInputError, match=r"resolves to 127\.0\.0\.1, a loopback address"):
        read_image_ref("http://localhost:9/a.png", policy)


class _Handler(BaseHTTPRequestHandler):
    release: threading.Event

    def do_GET(self):  # http.server calls it by this name
        if self.path == "/a.png":
            self._answer(200, PNG, {"Content-Length": str(len(PNG))})
        elif self.path == "/moved":
            self._answer(302, b"", {"Location": "/a.png", "Content-Length": "0"})
        elif self.path == "/declared":
            self._answer(200, b"", {"Content-Length": str(10 * len(PNG))})
        elif self.path == "/big":  # no Content-Length: the cap applies while reading
            self._answer(200, PNG + PNG, {"Connection": "close"})
        elif self.path == "/slow":
            self.release.wait(30)
        else:
            self._answer(404, b"", {"Content-Length": "0"})

    def _answer(self, status, body, headers):
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    release = threading.Event()
    handler = type("Handler", (_Handler,), {"release": release})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_fetch_from_an_allowed_loopback_server(server):
    assert read_image_ref(f"{server}/a.png", LOOPBACK) == PNG


@pytest.mark.parametrize(
    ("path", "error", "match"),
    [
        ("/moved", EncoderInputError, "answered 302 .*redirects are not followed"),
        ("/missing", EncoderInputError, "answered HTTP 404"),
        ("/big", LimitExceededError, f"sent more than {len(PNG) + 10} bytes"),
        ("/declared", LimitExceededError, f"declares {10 * len(PNG)} bytes, over the limit"),
    ],
    ids=["redirect", "404", "over-cap", "declared-over-cap"],
)
def test_fetch_refusals(server, path, error, match):
    with pytest.raises(error, match=match):
        read_image_ref(f"{server}{path}", LOOPBACK, index=0)


def test_fetch_deadline(server):
    policy = FetchPolicy(allow_http=True, allow_private_networks=True, timeout_s=0.2)
    with pytest.raises(EncoderInputError, match=r"took longer than 0\.2 s"):
        read_image_ref(f"{server}/slow", policy)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("http://127.0.0.1:99999/a.png", "invalid port"),
        ("http://user:pw@127.0.0.1/a.png", "carry no credentials"),
        ("http:///a.png", "must name a host"),
    ],
    ids=["port", "credentials", "no-host"],
)
def test_malformed_urls(url, match):
    with pytest.raises(EncoderInputError, match=match):
        read_image_ref(url, LOOPBACK)


def test_fetch_from_a_closed_port(server):
    port = int(server.rsplit(":", 1)[1])
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))  # a port nobody listens on
    closed = probe.getsockname()[1]
    probe.close()
    assert closed != port
    with pytest.raises(EncoderInputError, match=r"could not fetch image URL .*ConnectionRefused"):
        read_image_ref(f"http://127.0.0.1:{closed}/a.png", LOOPBACK)


def test_policy_is_checked():
    with pytest.raises(ValueError, match="timeout_s must be positive, got 0"):
        FetchPolicy(timeout_s=0)
    with pytest.raises(ValueError, match="max_bytes must be at least 1, got 0"):
        FetchPolicy(max_bytes=0)
