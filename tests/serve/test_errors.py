"""Every row of the error table (deployments/errors.py) through a real route.

One app of its own: an API key, one rank whose forward the test can hold or fail
(controlled.py), one call at a time at the rank and a queue of one, a short request
timeout, short hand-off waits and room for one part in the hand-off registry. Each
case is produced by what a client or a fault really does, and must answer the row's
status and error type in the JSON envelope.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
import time

import pytest
import ray
import requests
import zmq
from controlled import Switchboard, controlled_factory
from images import image_bytes
from pydantic import ValidationError
from ray import serve
from serve_helpers import app_args, b64, free_port, read_part

from deployments.admission import (
    BodyLostError,
    BodyTimeoutError,
    IngressBusyError,
    MalformedBodyError,
    UnsupportedMediaTypeError,
)
from deployments.app import bind_app
from deployments.errors import ERRORS
from deployments.fanout import NoRankAvailableError, RequestTimeoutError
from deployments.security import UnauthorizedError
from kimi_encoder.engines.ecpush import EcPushError
from kimi_encoder.engines.sglang import ReceiveTimeout, RegistryFull
from kimi_encoder.engines.transport import PushError
from kimi_encoder.items import EncoderInputError, LimitExceededError, UnsupportedFormatError

APP = "errors"
KEY = "table-walk-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
IMAGE = image_bytes("RGB", (64, 48), 11)


@pytest.fixture(scope="module")
def board(serve_url):
    return Switchboard.remote()


@pytest.fixture(scope="module")
def url(serve_url, board, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY)
    args = app_args(
        dp_size=1,
        ranks={
            "cache_bytes": 0,
            "calibration_grids": [],
            "serve_options": {"max_ongoing_requests": 1, "max_queued_requests": 1},
        },
        ingress={
            "api_key_file": str(key_file),
            "request_timeout_s": 3,
            "body_pace": {"grace_s": 1.0},  # a stalled body is refused after a second
            "max_concurrent_bodies": 1,
        },
        # The rank has one slot and one queue place (the queue case needs them): a load
        # poll beside a case's own calls would take the place its next call needs. One
        # ingress and one rank: every answer carries the rank's report anyway.
        dispatch={"cooldown_s": 0.5, "load_report_interval_ms": 60_000},
        handoff={
            "wait_s": 1,
            "send_timeout_s": 1,
            "max_pending": 1,
            "vllm_push": {"ack_timeout_s": 1},
        },
    )
    serve.run(bind_app(args, controlled_factory(board)), name=APP, route_prefix=f"/{APP}")
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


def post(url: str, headers=AUTH, **kwargs) -> requests.Response:
    return requests.post(f"{url}/v1/encode", headers=headers, timeout=60, **kwargs)


def one_image(url: str) -> requests.Response:
    return post(url, json={"items": [{"type": "image", "image": b64(IMAGE)}]})


def stalled_body(url: str, first: bytes = b'{"items"') -> socket.socket:
    """A POST whose body stops after its ``first`` bytes: it holds its body slot until
    refused."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST /{APP}/v1/encode HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n"
    )
    sock.sendall(head.encode() + first)
    return sock


def http_answer(sock: socket.socket) -> requests.Response:
    """The raw HTTP answer on ``sock``, as a requests.Response."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    response = requests.Response()
    response.status_code = int(lines[0].split()[1])
    response.headers.update(headers)
    response._content = body
    return response


def too_slow(url: str, board) -> requests.Response:
    with stalled_body(url) as sock:
        return http_answer(sock)


def body_never_came(url: str, board) -> requests.Response:
    """A POST that declares a body and sends none of it: as the ingress sees a body that
    Serve's proxy gave to a replica that died before it took the request."""
    with stalled_body(url, first=b"") as sock:
        return http_answer(sock)


def while_a_body_stalls(url: str, board) -> requests.Response:
    """Another request while the only body slot is held by a stalled upload."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with stalled_body(url) as sock:
            for _ in range(20):
                answer = one_image(url)
                if answer.status_code == 503:
                    return answer
            http_answer(sock)
    raise AssertionError("the stalled body never held the slot")


def quiet(url: str) -> bool:
    """The rank is up for the ingress, has nothing outstanding, and nothing is in flight."""
    info = requests.get(f"{url}/v1/info", headers=AUTH, timeout=30).json()
    load = requests.get(f"{url}/v1/load", headers=AUTH, timeout=30).json()
    (rank,) = info["ranks"]
    return (
        info["failover"]["ranks_up"] == [0]
        and rank.get("outstanding", {}).get("images") == 0
        and load["ranks"][0]["inflight_requests"] == 0
    )


@pytest.fixture
def settled(url):
    """Each case starts on a quiet rank (a held call from the case before has finished)."""
    deadline = time.monotonic() + 30
    while not quiet(url):
        assert time.monotonic() < deadline, "the rank never settled"
        time.sleep(0.1)
    return url


def past_the_queue(url: str, board) -> requests.Response:
    """While a first request's forward holds the rank's only slot, two more: one fits the
    one-call queue, the other is refused at once (whichever comes second)."""
    ray.get(board.set.remote(0, "hold"))
    with cf.ThreadPoolExecutor(3) as pool:
        first = pool.submit(one_image, url)
        ray.get(board.wait_held.remote(0), timeout=30)
        more = [pool.submit(one_image, url) for _ in range(2)]
        try:
            return next(cf.as_completed(more, timeout=30)).result()
        finally:
            ray.get(board.set.remote(0, "run"))
            for call in [first, *more]:
                call.result(timeout=60)


def held_past_the_timeout(url: str, board) -> requests.Response:
    ray.get(board.set.remote(0, "hold"))
    try:
        return one_image(url)  # request_timeout_s=3
    finally:
        ray.get(board.set.remote(0, "run"))


def failing_forward(url: str, board) -> requests.Response:
    ray.get(board.set.remote(0, "fail"))
    try:
        return one_image(url)
    finally:
        ray.get(board.set.remote(0, "run"))


def part(req_id: str, port: int | None = None) -> dict:
    """An sglang /encode body of one image; ``port`` set: zmq_to_tokenizer."""
    return {
        "req_id": req_id,
        "modality": "IMAGE",
        "mm_items": [b64(IMAGE)],
        "num_parts": 1,
        "part_idx": 0,
        "prefill_host": "127.0.0.1",
        "embedding_port": port,
    }


def register(url: str, req_id: str, address: str, count: int) -> requests.Response:
    body = {"req_id": req_id, "receive_count": count, "receive_url": address, "modality": "IMAGE"}
    return requests.post(f"{url}/scheduler_receive_url", headers=AUTH, json=body, timeout=60)


def push_to_nobody(url: str, board) -> requests.Response:
    """The part's receive port has nothing listening: the push gives up after
    handoff_send_timeout_s."""
    port = free_port()
    return requests.post(f"{url}/encode", headers=AUTH, json=part("gone", port), timeout=60)


def vllm_push_to_nobody(url: str, board) -> requests.Response:
    """A vllm_push whose worker address has nothing listening: no acknowledgement within
    handoff.vllm_push.ack_timeout_s, a 503 naming the item and the worker."""
    output = {"kind": "vllm_push", "uuids": ["nobody-0"], "to": [f"127.0.0.1:{free_port()}"]}
    body = {"items": [{"type": "image", "image": b64(IMAGE)}], "output": output}
    return post(url, json=body)


def registry_full(url: str, board) -> requests.Response:
    """handoff.max_pending=1: a part with one of its two ranks registered holds the only
    entry, so another part's registration is refused; then the first part completes."""
    ctx = zmq.Context()
    try:
        socks = [ctx.socket(zmq.PULL) for _ in range(2)]
        addresses = [f"127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in socks]
        assert register(url, "held", addresses[0], 2).status_code == 200
        refused = register(url, "other", addresses[0], 1)
        assert register(url, "held", addresses[1], 2).status_code == 200
        done = requests.post(f"{url}/encode", headers=AUTH, json=part("held"), timeout=60)
        assert done.status_code == 200, done.text
        assert all(s.poll(30_000) for s in socks)
        return refused
    finally:
        ctx.destroy(linger=0)


def nobody_registers(url: str, board) -> requests.Response:
    """A zmq_to_scheduler part whose ranks never say where they listen (handoff.wait_s=1)."""
    return requests.post(f"{url}/encode", headers=AUTH, json=part("unheard"), timeout=60)


CASES = {
    EncoderInputError: lambda url, board: post(
        url, json={"items": [{"type": "image", "image": "%%%"}]}
    ),
    UnauthorizedError: lambda url, board: post(url, headers={}, json={"items": []}),
    LimitExceededError: lambda url, board: post(
        url, json={"items": [{"type": "image", "image": b64(IMAGE)}] * 11}
    ),
    UnsupportedMediaTypeError: lambda url, board: post(
        url, data=b"x", headers={**AUTH, "content-type": "text/plain"}
    ),
    UnsupportedFormatError: lambda url, board: post(
        url, json={"items": [{"type": "image", "image": b64(b"%!PS-Adobe-3.0 EPSF-3.0\n")}]}
    ),
    MalformedBodyError: lambda url, board: post(url, files={"picture": ("a.png", IMAGE)}),
    BodyTimeoutError: too_slow,
    BodyLostError: body_never_came,
    IngressBusyError: while_a_body_stalls,
    ValidationError: lambda url, board: post(url, json={"items": [], "stream": True}),
    NoRankAvailableError: past_the_queue,
    RequestTimeoutError: held_past_the_timeout,
    PushError: push_to_nobody,
    EcPushError: vllm_push_to_nobody,
    RegistryFull: registry_full,
    ReceiveTimeout: nobody_registers,
    RuntimeError: failing_forward,  # no row: any other exception is an internal error
}


def test_every_row_of_the_table_is_reached(url, board):
    assert set(CASES) - {RuntimeError} == set(ERRORS)


@pytest.mark.parametrize("error", list(CASES), ids=lambda e: e.__name__)
def test_error_answers_its_row(settled, board, error):
    status, kind = ERRORS.get(error, (500, "internal_error"))
    response = CASES[error](settled, board)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == kind, response.text
    if status == 503:
        assert int(response.headers["Retry-After"]) >= 1
    if status == 401:
        assert response.headers["WWW-Authenticate"] == "Bearer"


def test_held_part_is_answered_at_the_timeout_with_an_error_frame(settled, board):
    """sglang /encode while the rank holds the forward: the part's error frame, then 504
    with sglang's body, within request_timeout_s=3 (no time is asserted: it is answered)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ray.get(board.set.remote(0, "hold"))
    try:
        body = part("held", port)
        response = requests.post(f"{settled}/encode", headers=AUTH, json=body, timeout=60)
        assert sock.poll(30_000), "no error frame was pushed"
        frames = sock.recv_multipart()
    finally:
        ray.get(board.set.remote(0, "run"))
        ctx.destroy(linger=0)
    assert response.status_code == 504, response.text
    body = response.json()
    assert (body["status"], body["req_id"], body["error"]["type"]) == ("error", "held", "timeout")
    assert "request_timeout_s=3" in body["message"]
    meta, embedding = read_part(frames)
    assert embedding is None
    assert (meta.error_msg, meta.error_code) == (body["message"], 504)


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [("get", "/nope", 404, "not_found"), ("get", "/v1/encode", 405, "method_not_allowed")],
)
def test_routing_errors_use_the_envelope(url, method, path, status, kind):
    response = requests.request(method, f"{url}{path}", headers=AUTH, timeout=30)
    assert response.status_code == status
    assert response.json()["error"]["type"] == kind, response.text
