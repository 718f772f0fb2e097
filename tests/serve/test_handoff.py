"""The engine hand-off over real HTTP and real ZMQ PULL sockets on loopback.

sglang's ``/encode`` in both transfer modes (zmq_to_tokenizer: the part's own
port; zmq_to_scheduler: every address registered with ``/scheduler_receive_url``,
before or after the part), behind two ingress replicas; ``/health``; failures as
an error frame plus a non-200 answer carrying sglang's ``message``; receive
addresses outside ``handoff.receive_networks`` refused with nothing connecting to
them (a loopback listener, loopback left out of the list); vLLM encoder-cache files
written before ``/v1/encode`` answers. Every payload is
compared with ``/v1/encode``'s features of the same images: float32 bit for bit,
bfloat16 equal to the float32 features rounded. tests/interop runs sglang's and
vLLM's own code against the same routes.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import requests
import torch
import zmq
from images import image_bytes
from safetensors.torch import load_file
from serve_helpers import (
    IMAGE_SPECS,
    app_args,
    b64,
    data_url,
    decode_features,
    rank_calls,
    read_part,
    served,
)
from serve_helpers import sglang_part as part

from kimi_encoder.items import MSG_IMAGE_ONLY

APP, BF16_APP, CLOSED_APP = "handoff", "handoff_bf16", "handoff_closed"
# Features compared bit for bit: no cache, owners by patch count (no calibration) over
# exact loads. With the default 50 ms reports, an ingress replica may still count the
# other replica's finished work on one rank and give it none of a part's images (seen
# in a loaded parallel pass), so the part's batches differ from /v1/encode's.
REFERENCE_PATH = {
    "ranks": {"cache_bytes": 0, "calibration_grids": []},
    "dispatch": {"cost_model": "patches", "load_report_interval_ms": 0},
}
# Mixed sizes and modes: RGB, the big one (resized to the tiny preset's budget), RGBA, palette.
IMAGES = [image_bytes(mode, size, seed, fmt=fmt) for mode, size, seed, fmt in IMAGE_SPECS[:4]]
RECEIVE_S = 60  # a pushed part reaches its socket within this (it was sent before the answer)


@pytest.fixture(scope="module")
def url(serve_url, ec_root):
    """dp 2 behind two ingress replicas, float32, writing vLLM entries under ec_root."""
    args = app_args(
        REFERENCE_PATH,
        dp_size=2,
        ingress={"replicas": 2},
        handoff={"ec_root": str(ec_root), "wait_s": 30},
    )
    with served(serve_url, APP, args) as url:
        yield url


@pytest.fixture(scope="module")
def bf16_url(serve_url):
    """dp 1 in bfloat16, no ec_root, image URLs fetched (loopback allowed)."""
    urls = {"allow_http": True, "allow_private_networks": True}
    args = app_args(
        REFERENCE_PATH, dp_size=1, model={"dtype": "bfloat16"}, handoff={"image_urls": urls}
    )
    with served(serve_url, BF16_APP, args) as url:
        yield url


@pytest.fixture(scope="module")
def closed_url(serve_url):
    """dp 1 whose receive networks leave loopback out: every receive address here is refused."""
    args = app_args(REFERENCE_PATH, dp_size=1, handoff={"receive_networks": ["10.0.0.0/8"]})
    with served(serve_url, CLOSED_APP, args) as url:
        yield url


@pytest.fixture
def pull():
    """``pull()`` -> (a PULL socket bound on loopback, its 'host:port')."""
    ctx = zmq.Context()

    def bind() -> tuple[zmq.Socket, str]:
        sock = ctx.socket(zmq.PULL)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return sock, f"127.0.0.1:{port}"

    yield bind
    ctx.destroy(linger=0)


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=120)


def register(url: str, req_id: str, address: str, count: int) -> None:
    body = {"req_id": req_id, "receive_count": count, "receive_url": address, "modality": "IMAGE"}
    response = post(url, "/scheduler_receive_url", body)
    assert response.status_code == 200, response.text
    assert response.json() is None, response.text


def receive(sock: zmq.Socket):
    assert sock.poll(RECEIVE_S * 1000), "nothing was pushed to the receive address"
    return read_part(sock.recv_multipart())


def v1_encode(url: str, images: list[bytes]) -> tuple[np.ndarray, list[dict]]:
    """/v1/encode's float32 features of ``images``, rows concatenated, and its items."""
    items = [{"type": "image", "image": b64(data)} for data in images]
    body = {"items": items, "feature_dtype": "float32"}
    response = requests.post(f"{url}/v1/encode", json=body, timeout=120)
    assert response.status_code == 200, response.text
    items = response.json()["items"]
    return np.concatenate([decode_features(item) for item in items]), items


def assert_part(
    meta, embedding, req_id: str, want: np.ndarray, items: list[dict], exact: bool = True
) -> None:
    """Frame 0 names the part, its grids and original sizes; frame 1 is ``want``: bit for
    bit where the part's images were encoded in the same batches as ``want``'s, else (a
    rank batched them with other requests' images) within 1e-5, as test_parity.py."""
    assert (meta.req_id, meta.num_parts, meta.part_idx) == (req_id, 1, 0)
    assert meta.modality == ("Modality", 1)
    assert meta.error_msg is None
    assert meta.grid_dim.tolist() == [item["grid_thw"] for item in items]
    assert meta.original_image_sizes == [item["original_size"] for item in items]
    assert meta.shape == list(want.shape)
    if meta.dtype == torch.float32 and exact:
        assert np.array_equal(embedding.numpy(), want)  # bit for bit
    elif meta.dtype == torch.float32:
        np.testing.assert_allclose(embedding.numpy(), want, rtol=0, atol=1e-5)
    else:
        assert meta.dtype == torch.bfloat16
        assert exact, "a bfloat16 part is compared bit for bit only"
        assert torch.equal(embedding, torch.from_numpy(want).to(torch.bfloat16))


def test_tokenizer_part_is_v1_encode_features_split_across_ranks(url, pull):
    sock, address = pull()
    want, items = v1_encode(url, IMAGES)
    before = rank_calls(url)
    body = part("tok_local_part_0", [data_url(b) for b in IMAGES], address)
    response = post(url, "/encode", body)
    assert response.status_code == 200, response.text
    assert response.json() is None, response.text
    calls = [after - b for after, b in zip(rank_calls(url), before, strict=True)]
    assert all(count >= 1 for count in calls), calls  # the part's images went to both ranks
    assert_part(*receive(sock), "tok_local_part_0", want, items)


def test_a_part_spread_over_ranks_is_pushed_by_one_rank(url, pull):
    """The part's images are encoded on both ranks; one of them gathers the other's rows
    from the object store and pushes the part, so the ingress sends no feature byte:
    the ranks' ``parts_pushed`` count it, and the frames are the features in item order."""
    sock, address = pull()
    want, items = v1_encode(url, IMAGES)
    before = ranks_info(url)
    response = post(
        url, "/encode", part("spread_local_part_0", [data_url(b) for b in IMAGES], address)
    )
    assert response.status_code == 200, response.text
    after = ranks_info(url)
    calls = [a["calls"] - b["calls"] for a, b in zip(after, before, strict=True)]
    pushed = [a["parts_pushed"] - b["parts_pushed"] for a, b in zip(after, before, strict=True)]
    assert all(count >= 1 for count in calls), calls
    assert sorted(pushed) == [0, 1], pushed
    assert_part(*receive(sock), "spread_local_part_0", want, items)


def ranks_info(url: str) -> list[dict]:
    return requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]


def test_bfloat16_part_is_the_float32_features_rounded(bf16_url, pull):
    sock, address = pull()
    want, items = v1_encode(bf16_url, IMAGES[:2])
    body = part("bf16_local_part_0", [data_url(b) for b in IMAGES[:2]], address)
    assert post(bf16_url, "/encode", body).status_code == 200
    meta, embedding = receive(sock)
    assert meta.dtype == torch.bfloat16
    assert_part(meta, embedding, "bf16_local_part_0", want, items)


@pytest.fixture
def image_server():
    """An HTTP server on loopback answering GET /image with IMAGES[2]."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/image" else 404)
            self.send_header("Content-Length", str(len(IMAGES[2])))
            self.end_headers()
            self.wfile.write(IMAGES[2])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_http_image_url_is_fetched_where_allowed(bf16_url, pull, image_server):
    sock, address = pull()
    want, items = v1_encode(bf16_url, IMAGES[2:3])
    body = part("url_local_part_0", [f"{image_server}/image"], address)
    response = post(bf16_url, "/encode", body)
    assert response.status_code == 200, response.text
    assert_part(*receive(sock), "url_local_part_0", want, items)


def parts_pending(url: str) -> int:
    return requests.get(f"{url}/v1/info", timeout=30).json()["handoff"]["registry"]["parts_pending"]


@pytest.mark.parametrize("order", ["registered-first", "encode-first"])
def test_scheduler_part_reaches_every_registered_rank(url, pull, order):
    """receive_count 2: both scheduler ranks get the same two frames, whichever came first."""
    (sock_a, addr_a), (sock_b, addr_b) = pull(), pull()
    req_id = f"sched-{order}_local_part_0"
    want, items = v1_encode(url, IMAGES[1:3])
    body = part(req_id, [data_url(b) for b in IMAGES[1:3]])
    with cf.ThreadPoolExecutor(1) as pool:
        if order == "registered-first":
            register(url, req_id, addr_a, 2)
            register(url, req_id, addr_b, 2)
            answer = pool.submit(post, url, "/encode", body)
        else:
            pending = parts_pending(url)
            answer = pool.submit(post, url, "/encode", body)
            deadline = time.monotonic() + 60
            while parts_pending(url) == pending:  # until the part waits for its addresses
                assert time.monotonic() < deadline, "the part never asked for its addresses"
                time.sleep(0.05)
            assert answer.running()
            register(url, req_id, addr_a, 2)
            register(url, req_id, addr_b, 2)
        response = answer.result()
    assert response.status_code == 200, response.text
    for sock in (sock_a, sock_b):
        assert_part(*receive(sock), req_id, want, items)
    assert parts_pending(url) == 0


def test_registrations_and_parts_spread_over_two_ingress_replicas(url, pull):
    """Twelve parts, each registered and then encoded: the proxy spreads the 24 requests
    over both ingress replicas (a per-replica registry would miss most parts)."""
    images = [image_bytes("RGB", (40 + 8 * i, 40), 100 + i) for i in range(12)]
    sockets = [pull() for _ in images]
    for i, (_, address) in enumerate(sockets):
        register(url, f"spread{i}_local_part_0", address, 1)
    with cf.ThreadPoolExecutor(4) as pool:
        bodies = [part(f"spread{i}_local_part_0", [data_url(b)]) for i, b in enumerate(images)]
        answers = list(pool.map(lambda body: post(url, "/encode", body), bodies))
    assert [a.status_code for a in answers] == [200] * len(images), [a.text for a in answers]
    # Sent at once, the parts' images shared the ranks' batches; on CPUs whose matrix
    # kernels depend on a batch's row count (AVX-512 MKL), an image's float32 features
    # then differ in the last bits from those of the image encoded alone.
    for i, ((sock, _), data) in enumerate(zip(sockets, images, strict=True)):
        want, items = v1_encode(url, [data])
        assert_part(*receive(sock), f"spread{i}_local_part_0", want, items, exact=False)


TRUNCATED = IMAGES[0][: len(IMAGES[0]) // 2]  # a valid header, pixels cut off
FAILURES = {
    "video": ({"modality": "VIDEO"}, [data_url(IMAGES[0])], 400, MSG_IMAGE_ONLY),
    "truncated": ({}, [data_url(TRUNCATED)], 400, "item 1: cannot decode the image"),
    "not-an-image": ({}, [data_url(b"hello")], 415, "cannot read the image header"),
    "file-url": ({}, ["file:///etc/hosts"], 400, "scheme 'file' is refused"),
    "http-url": ({}, ["http://127.0.0.1:9/a.png"], 400, "does not fetch image URLs"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_failed_part_sends_an_error_frame_and_answers_its_status(url, pull, case):
    fields, refs, status, message = FAILURES[case]
    sock, address = pull()
    req_id = f"fail-{case}_local_part_0"
    response = post(url, "/encode", part(req_id, [data_url(IMAGES[1]), *refs], address, **fields))
    assert response.status_code == status, response.text
    body = response.json()
    assert (body["status"], body["req_id"]) == ("error", req_id)
    assert message in body["message"]
    assert body["message"] == body["error"]["message"]
    meta, embedding = receive(sock)
    assert embedding is None
    assert meta.req_id == req_id
    assert (meta.error_msg, meta.error_code) == (body["message"], status)


def test_failed_scheduler_part_reaches_every_registered_rank(url, pull):
    (sock_a, addr_a), (sock_b, addr_b) = pull(), pull()
    req_id = "fail-sched_local_part_0"
    register(url, req_id, addr_a, 2)
    register(url, req_id, addr_b, 2)
    response = post(url, "/encode", part(req_id, [data_url(IMAGES[0])], modality="VIDEO"))
    assert response.status_code == 400
    assert MSG_IMAGE_ONLY in response.json()["message"]
    for sock in (sock_a, sock_b):
        meta, embedding = receive(sock)
        assert embedding is None
        assert meta.error_msg == response.json()["message"]


def test_health_and_protocol_versions(url):
    assert requests.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
    handoff = requests.get(f"{url}/v1/info", timeout=30).json()["handoff"]
    assert (handoff["sglang"], handoff["vllm"], handoff["dtype"]) == ("0.5.23", "0.33.0", "float32")
    assert handoff["vllm_ec"] is True
    assert handoff["image_urls"] is False


def test_vllm_ec_files_are_complete_when_answered(url, ec_root):
    uuids = ["chat-1-img-0", "chat-1-img-1", "chat-1-img-2"]
    images = IMAGES[1:]
    want, items = v1_encode(url, images)
    body = {
        "items": [{"type": "image", "image": b64(data)} for data in images],
        "output": {"kind": "vllm_ec", "uuids": uuids},
    }
    response = requests.post(f"{url}/v1/encode", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    offset = 0
    for i, (entry, uuid, item) in enumerate(zip(answer["items"], uuids, items, strict=True)):
        path = ec_root / uuid / "encoder_cache.safetensors"
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file
        tensors = load_file(path)  # read right after the answer
        rows = item["num_tokens"]
        assert list(tensors) == ["ec_cache"]
        assert np.array_equal(tensors["ec_cache"].numpy(), want[offset : offset + rows])
        assert entry == {
            "index": i,
            "uuid": uuid,
            "path": f"{uuid}/encoder_cache.safetensors",
            "grid_thw": item["grid_thw"],
            "num_tokens": rows,
            "owner_rank": entry["owner_rank"],
            "shape": [rows, 80],
            "dtype": "float32",
            "bytes": path.stat().st_size,
        }
        offset += rows
    assert answer["usage"]["tokens"] == offset == len(want)


def test_vllm_ec_files_are_written_by_the_ranks(url, ec_root):
    """The rank that encodes an image writes its entries, one per uuid (an image sent
    twice under two uuids is encoded once and written twice): ranks' ``ec_entries``
    count every file, so none was written by the ingress."""
    images = [IMAGES[0], IMAGES[2], IMAGES[0]]
    uuids = ["twice-a", "once-b", "twice-c"]
    before = sum(
        r["ec_entries"] for r in requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]
    )
    body = {
        "items": [{"type": "image", "image": b64(data)} for data in images],
        "output": {"kind": "vllm_ec", "uuids": uuids},
    }
    response = requests.post(f"{url}/v1/encode", json=body, timeout=120)
    assert response.status_code == 200, response.text
    entries = response.json()["items"]
    assert entries[0]["owner_rank"] == entries[2]["owner_rank"]  # one image, one rank
    files = {u: load_file(ec_root / u / "encoder_cache.safetensors")["ec_cache"] for u in uuids}
    assert torch.equal(files["twice-a"], files["twice-c"])
    assert not torch.equal(files["twice-a"][:1], files["once-b"][:1])
    for entry in entries:
        assert entry["bytes"] == (ec_root / entry["path"]).stat().st_size
    assert ec_entries(url) - before == len(uuids)


def ec_entries(url: str) -> int:
    """Encoder-cache files written by all ranks of the app so far."""
    return sum(r["ec_entries"] for r in requests.get(f"{url}/v1/info", timeout=30).json()["ranks"])


def test_vllm_ec_without_ec_root_says_how_to_configure_it(bf16_url):
    body = {
        "items": [{"type": "image", "image": b64(IMAGES[0])}],
        "output": {"kind": "vllm_ec", "uuids": ["a"]},
    }
    response = requests.post(f"{bf16_url}/v1/encode", json=body, timeout=120)
    assert response.status_code == 400
    assert "set the app's args handoff.ec_root to the vLLM consumer's" in response.text


@pytest.fixture
def listener():
    """(a plain TCP socket listening on loopback, its 'host:port')."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        yield sock, f"127.0.0.1:{sock.getsockname()[1]}"


def assert_nothing_connected(sock: socket.socket) -> None:
    time.sleep(0.5)  # an error frame is pushed before the answer; give a connect time anyway
    with pytest.raises(BlockingIOError):
        sock.accept()


def assert_refused(response: requests.Response, address: str) -> str:
    """A 400 naming the address, what it resolved to, the networks and the setting."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["message"] == (
        f"receive address {address!r} resolves to 127.0.0.1: 127.0.0.1 is outside the "
        "networks this encoder pushes to (10.0.0.0/8); nothing was sent to it. To push "
        "there, add its network to handoff.receive_networks."
    )
    return error["message"]


def test_tokenizer_part_outside_the_networks_is_refused_before_encoding(closed_url, listener):
    sock, address = listener
    req_id = "closed-tok_local_part_0"
    before = rank_calls(closed_url)
    response = post(closed_url, "/encode", part(req_id, [data_url(IMAGES[0])], address))
    message = assert_refused(response, address)
    body = response.json()
    assert (body["status"], body["req_id"], body["message"]) == ("error", req_id, message)
    assert rank_calls(closed_url) == before  # nothing was encoded
    assert_nothing_connected(sock)


def test_refused_part_gets_no_error_frame_outside_the_networks(closed_url, listener):
    """A part refused for its content still names a receive address: outside the
    networks, its error frame is not sent there."""
    sock, address = listener
    req_id = "closed-video_local_part_0"
    body = part(req_id, [data_url(IMAGES[0])], address, modality="VIDEO")
    response = post(closed_url, "/encode", body)
    assert response.status_code == 400, response.text
    assert MSG_IMAGE_ONLY in response.json()["message"]
    assert_nothing_connected(sock)


def test_registration_outside_the_networks_is_refused(closed_url, listener):
    sock, address = listener
    body = {
        "req_id": "closed-sched_local_part_0",
        "receive_count": 1,
        "receive_url": address,
        "modality": "IMAGE",
    }
    assert_refused(post(closed_url, "/scheduler_receive_url", body), address)
    assert parts_pending(closed_url) == 0  # the registry never saw it
    assert_nothing_connected(sock)


def test_a_rank_registered_by_name_gets_the_part_at_the_ip_it_resolved_to(url, pull):
    if socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)[0][4][0] != "127.0.0.1":
        pytest.skip("localhost resolves to another address first here")
    sock, address = pull()
    req_id = "by-name_local_part_0"
    register(url, req_id, f"localhost:{address.rpartition(':')[2]}", 1)
    want, items = v1_encode(url, IMAGES[:1])
    response = post(url, "/encode", part(req_id, [data_url(IMAGES[0])]))
    assert response.status_code == 200, response.text
    assert_part(*receive(sock), req_id, want, items)
