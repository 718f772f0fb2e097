"""sglang encode/prefill protocol: requests, frames, the ZMQ push, the receive registry.

Frames are checked here for structure and bytes; tests/interop checks that
sglang's own unpickler and receiver accept them.
"""

import asyncio
import base64
import hashlib
import pickletools
import socket

import numpy as np
import pytest
import torch
import zmq
from images import image_bytes
from serve_helpers import read_frame0

from kimi_encoder.engines.media import FetchPolicy
from kimi_encoder.engines.sglang import (
    EMBEDDING_DATA,
    FRAME0_GLOBALS,
    MODALITY,
    MODALITY_IMAGE,
    EncodeRequest,
    ReceiverRegistry,
    ReceiveTimeout,
    ReceiveUrlRequest,
    RegistryFull,
    deliver,
    error_body,
    error_target,
    load_images,
)
from kimi_encoder.engines.sglang_frames import (
    embedding_frames,
    error_frames,
    stored_embedding_frames,
)
from kimi_encoder.engines.transport import PushError, ZmqPusher, tcp_endpoint
from kimi_encoder.features import to_numpy
from kimi_encoder.items import MSG_IMAGE_ONLY, EncoderInputError

PNG = image_bytes("RGB", (100, 37), seed=3)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def encode_body(**overrides):
    body = {
        "encoder_idx": 1,
        "encoder_url": "http://10.0.0.2:8000",
        "mm_items": [DATA_URL],
        "num_parts": 2,
        "part_idx": 1,
        "req_id": "9f2c_local_part_1",
        "modality": "IMAGE",
        "prefill_host": "10.0.0.1",
        "embedding_port": None,
        "time_stats_json": None,
    }
    return body | overrides


def test_encode_request_zmq_to_scheduler():
    req = EncodeRequest.from_json(encode_body())
    assert (req.rid, req.part_idx, req.num_parts, req.receive_address) == ("9f2c", 1, 2, None)
    assert req.mm_items[0].url == DATA_URL
    assert req.mm_items[0].content_hash is None


def test_encode_request_zmq_to_tokenizer():
    req = EncodeRequest.from_json(encode_body(embedding_port=40123, req_id="abc"))
    assert (req.rid, req.receive_address) == ("abc", "10.0.0.1:40123")


def test_media_item_dict_with_hash_and_ignored_options():
    digest = "sha256:" + "AB" * 32
    item = {"url": DATA_URL, "content_hash": digest, "detail": "high"}
    req = EncodeRequest.from_json(encode_body(mm_items=[item, DATA_URL]))
    assert req.mm_items[0].content_hash == digest.lower()
    assert req.mm_items[1].url == DATA_URL


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"modality": "VIDEO"}, MSG_IMAGE_ONLY),
        ({"mm_items": []}, "mm_items must be a non-empty list"),
        ({"part_idx": 2}, "part_idx 2 is not below num_parts 2"),
        ({"num_parts": True}, "'num_parts' must be an integer >= 1"),
        ({"req_id": ""}, "'req_id' must be a non-empty string"),
        ({"embedding_port": 5, "prefill_host": None}, "no prefill_host"),
        ({"time_stats_json": "x"}, "time_stats_json must be an object"),
        ({"hashes": [1]}, r"unknown fields \['hashes'\]; sglang 0\.5\.23 sends"),
        ({"mm_items": [{"path": "x"}]}, "item 0: mm_items entry must be a URL string"),
        ({"mm_items": [{"url": "u", "fps": 2}]}, r"keys \['fps'\] this encoder does not know"),
        ({"mm_items": [{"url": "u", "content_hash": "md5:1"}]}, "'sha256:' and 64 hex"),
    ],
    ids=[
        "video",
        "empty",
        "part",
        "bool",
        "req_id",
        "port",
        "stats",
        "unknown",
        "item",
        "item-key",
        "hash",
    ],
)
def test_encode_request_errors(overrides, match):
    with pytest.raises(EncoderInputError, match=match):
        EncodeRequest.from_json(encode_body(**overrides))


def test_encode_request_missing_field_and_not_object():
    body = encode_body()
    del body["mm_items"]
    with pytest.raises(EncoderInputError, match=r"missing fields \['mm_items'\]"):
        EncodeRequest.from_json(body)
    with pytest.raises(EncoderInputError, match="must be a JSON object, got"):
        EncodeRequest.from_json([body])


def test_error_target_of_a_refused_body():
    """A refused part still has an address for its error frame when its routing fields hold."""
    target = error_target(encode_body(modality="VIDEO", embedding_port=40123, mm_items="x"))
    assert (target.req_id, target.num_parts, target.part_idx) == ("9f2c_local_part_1", 2, 1)
    assert (target.receive_address, target.mm_items) == ("10.0.0.1:40123", ())
    (frame0,) = error_frames(target, MSG_IMAGE_ONLY, 400)
    meta = read_frame0(frame0)
    assert (meta.req_id, meta.error_msg, meta.error_code) == (target.req_id, MSG_IMAGE_ONLY, 400)
    assert error_target(encode_body(hashes=[1])).receive_address is None  # zmq_to_scheduler


@pytest.mark.parametrize(
    "body",
    [
        ["not", "an", "object"],
        encode_body(req_id=None),
        encode_body(num_parts=0),
        encode_body(part_idx=2),
        encode_body(embedding_port=5, prefill_host=None),
        encode_body(embedding_port="5"),
    ],
    ids=["list", "req_id", "num_parts", "part_idx", "port-without-host", "port-type"],
)
def test_error_target_without_usable_routing_is_none(body):
    assert error_target(body) is None


def test_receive_url_request():
    body = {
        "req_id": "r_local_part_0",
        "receive_count": 2,
        "receive_url": "[::1]:5001",
        "modality": "IMAGE",
    }
    req = ReceiveUrlRequest.from_json(body)
    assert (req.receive_count, tcp_endpoint(req.receive_url)) == (2, "tcp://[::1]:5001")
    with pytest.raises(EncoderInputError, match="must be 'host:port'"):
        ReceiveUrlRequest.from_json(body | {"receive_url": "http://h"})
    with pytest.raises(EncoderInputError, match="'receive_count' must be an integer >= 1"):
        ReceiveUrlRequest.from_json(body | {"receive_count": 0})
    with pytest.raises(EncoderInputError, match=MSG_IMAGE_ONLY):
        ReceiveUrlRequest.from_json(body | {"modality": "AUDIO"})


def test_tcp_endpoint_forms():
    assert tcp_endpoint("10.1.2.3:7") == "tcp://10.1.2.3:7"
    assert tcp_endpoint("fe80::1:7") == "tcp://[fe80::1]:7"
    with pytest.raises(ValueError, match="got 'host:0'"):
        tcp_endpoint("host:0")


def _globals(frame: bytes) -> set:
    return {
        tuple(arg.split(" ")) for op, arg, _ in pickletools.genops(frame) if op.name == "GLOBAL"
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_embedding_frames(dtype):
    req = EncodeRequest.from_json(encode_body(mm_items=[DATA_URL, DATA_URL]))
    features = torch.randn(12, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    grids = torch.tensor([[1, 4, 8], [1, 4, 4]])
    frame0, frame1 = embedding_frames(req, features, grids, [(100, 37), (50, 50)])

    assert EMBEDDING_DATA in _globals(frame0)
    assert MODALITY in _globals(frame0)
    assert _globals(frame0) <= FRAME0_GLOBALS
    assert ("torch", "LongTensor") in _globals(frame0)  # the grid, from its rows
    meta = read_frame0(frame0)
    assert vars(meta).keys() == {
        "req_id",
        "num_parts",
        "part_idx",
        "grid_dim",
        "modality",
        "embedding",
        "send_time",
        "dtype",
        "shape",
        "_mr_ptr",
        "error_msg",
        "error_code",
        "original_image_sizes",
    }
    assert (meta.req_id, meta.num_parts, meta.part_idx) == ("9f2c_local_part_1", 2, 1)
    assert meta.modality == ("Modality", MODALITY_IMAGE)
    assert type(meta.grid_dim) is torch.Tensor
    assert meta.grid_dim.dtype == torch.int64
    assert torch.equal(meta.grid_dim, grids)
    assert (meta.dtype, meta.shape, meta.embedding, meta.error_msg) == (dtype, [12, 16], None, None)
    assert meta.original_image_sizes == [[100, 37], [50, 50]]
    received = torch.frombuffer(bytearray(frame1), dtype=meta.dtype).reshape(meta.shape)
    assert torch.equal(received, features)


def test_embedding_frames_do_not_copy_contiguous_features():
    req = EncodeRequest.from_json(encode_body())
    features = torch.randn(8, 16).to(torch.bfloat16)
    _, body = embedding_frames(req, features, torch.tensor([[1, 4, 8]]), [(100, 37)])
    assert np.frombuffer(body, np.uint8).ctypes.data == features.data_ptr()


def test_embedding_frames_of_non_contiguous_features():
    req = EncodeRequest.from_json(encode_body())
    features = torch.randn(16, 8).to(torch.bfloat16).t()  # (8, 16), column-major
    frame0, body = embedding_frames(req, features, torch.tensor([[1, 4, 8]]), [(100, 37)])
    meta = read_frame0(frame0)
    assert torch.equal(torch.frombuffer(bytearray(body), dtype=meta.dtype).reshape(8, 16), features)


def test_stored_embedding_frames_send_a_read_only_array_in_place():
    req = EncodeRequest.from_json(encode_body())
    rows = torch.randn(8, 16).to(torch.bfloat16)
    array = to_numpy(rows)  # bfloat16 as its 16-bit words
    array.flags.writeable = False
    frame0, body = stored_embedding_frames(
        req, array, "bfloat16", torch.tensor([[1, 4, 8]]), [(9, 7)]
    )
    assert np.frombuffer(body, np.uint8).ctypes.data == array.ctypes.data
    meta = read_frame0(frame0)
    assert (meta.dtype, meta.shape, meta.original_image_sizes) == (
        torch.bfloat16,
        [8, 16],
        [[9, 7]],
    )
    assert torch.equal(torch.frombuffer(bytearray(body), dtype=meta.dtype).reshape(8, 16), rows)
    # The same frames as from the tensor.
    assert (
        stored_embedding_frames(req, array, "bfloat16", torch.tensor([[1, 4, 8]]), [(9, 7)])[0]
        == embedding_frames(req, rows, torch.tensor([[1, 4, 8]]), [(9, 7)])[0]
    )


@pytest.mark.parametrize(
    ("array", "dtype", "match"),
    [
        (np.zeros((8, 4), np.float32).T, "float32", r"\(4, 8\) float32 \(C-contiguous: False\)"),
        (
            np.zeros((8, 4), np.float32),
            "bfloat16",
            r"bfloat16's storage uint16, got \(8, 4\) float32",
        ),
        (np.zeros((0, 4), np.float32), "float32", r"non-empty C-contiguous"),
        (np.zeros(8, np.float32), "float32", r"got \(8,\) float32"),
    ],
)
def test_stored_embedding_frames_refuse_what_is_not_rows_of_the_dtype(array, dtype, match):
    req = EncodeRequest.from_json(encode_body())
    with pytest.raises(ValueError, match=match):
        stored_embedding_frames(req, array, dtype, torch.tensor([[1, 4, 8]]), [(1, 1)])


def test_embedding_frames_refuse_mismatches():
    req = EncodeRequest.from_json(encode_body())
    with pytest.raises(ValueError, match=r"part has 1 images but grids of shape \(2, 3\)"):
        embedding_frames(req, torch.zeros(8, 4), torch.ones(2, 3), [(1, 1)])
    with pytest.raises(ValueError, match=r"non-empty \(tokens, hidden\) tensor"):
        embedding_frames(req, torch.zeros(8, 4, dtype=torch.int32), torch.ones(1, 3), [(1, 1)])


def test_error_frames():
    req = EncodeRequest.from_json(encode_body())
    (frame0,) = error_frames(req, "cannot read the image header", 400)
    meta = read_frame0(frame0)
    assert (meta.error_msg, meta.error_code, meta.grid_dim, meta.shape) == (
        "cannot read the image header",
        400,
        None,
        None,
    )
    assert error_body("r", "boom") == {"status": "error", "message": "boom", "req_id": "r"}


def _pull(ctx: zmq.Context):
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"127.0.0.1:{port}"


def _dead_address() -> str:
    """A loopback port nothing listens on (closed before anyone connects)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_pusher_delivers_to_a_pull_socket(zmq_ctx):
    sock, address = _pull(zmq_ctx)
    body = np.arange(300_000, dtype=np.float32)  # above pyzmq's copy threshold

    async def main():
        pusher = ZmqPusher(send_timeout_s=10)
        try:
            await pusher.send(tcp_endpoint(address), [b"meta", memoryview(body)])
            await pusher.send(tcp_endpoint(address), [b"again", b"x"], reuse=False)
            return pusher.cached
        finally:
            pusher.close(linger_s=10)

    assert asyncio.run(main()) == [tcp_endpoint(address)]
    # Two connections: the messages may arrive in either order.
    received = sorted((sock.recv_multipart() for _ in range(2)), key=lambda m: m[0])
    assert received[0] == [b"again", b"x"]
    assert received[1][0] == b"meta"
    assert np.array_equal(np.frombuffer(received[1][1], np.float32), body)


def test_pusher_gives_up_on_a_dead_receiver():
    address = _dead_address()

    async def main():
        pusher = ZmqPusher(send_timeout_s=0.2)
        try:
            await pusher.send(tcp_endpoint(address), [b"meta"])
        finally:
            assert pusher.cached == []
            pusher.close()

    with pytest.raises(PushError, match="the receiver is gone or not reading"):
        asyncio.run(main())


def test_pusher_cache_is_bounded(zmq_ctx):
    socks, addresses = zip(*(_pull(zmq_ctx) for _ in range(3)), strict=True)

    async def main():
        pusher = ZmqPusher(max_cached=2)
        try:
            for address in addresses:
                await pusher.send(tcp_endpoint(address), [address.encode()])
            return pusher.cached
        finally:
            pusher.close(linger_s=10)

    assert asyncio.run(main()) == [tcp_endpoint(a) for a in addresses[1:]]
    assert [s.recv_multipart() for s in socks] == [[a.encode()] for a in addresses]


def test_pusher_settings_are_checked():
    with pytest.raises(ValueError, match="send_hwm and max_cached must be at least 1"):
        ZmqPusher(max_cached=0)
    with pytest.raises(ValueError, match="send_timeout_s must be positive"):
        ZmqPusher(send_timeout_s=0)


def _receive_url(req_id, address, count=2):
    return ReceiveUrlRequest(
        req_id=req_id, receive_count=count, receive_url=address, modality="IMAGE"
    )


def test_registry_registration_before_encode():
    async def main():
        registry = ReceiverRegistry()
        registry.register(_receive_url("p", "h:1"))
        registry.register(_receive_url("p", "h:2"))
        registry.register(_receive_url("p", "h:2"))  # a repeat changes nothing
        addresses = await registry.wait_for("p", timeout_s=5)
        return addresses, len(registry)

    assert asyncio.run(main()) == (["h:1", "h:2"], 0)


def test_registry_registration_after_encode():
    async def main():
        registry = ReceiverRegistry()
        waiter = asyncio.create_task(registry.wait_for("p", timeout_s=5))
        await asyncio.sleep(0)  # the waiter now holds the entry
        registry.register(_receive_url("p", "h:1"))
        assert not waiter.done()
        registry.register(_receive_url("p", "h:2"))
        return await waiter, len(registry)

    assert asyncio.run(main()) == (["h:1", "h:2"], 0)


def test_registry_timeout_forgets_the_entry():
    async def main():
        registry = ReceiverRegistry()
        registry.register(_receive_url("p", "h:1"))
        try:
            await registry.wait_for("p", timeout_s=0.05)
        finally:
            assert len(registry) == 0

    with pytest.raises(ReceiveTimeout, match="1 of 2 receive addresses for 'p' came within"):
        asyncio.run(main())


def test_registry_refuses_inconsistent_counts_and_overflow():
    registry = ReceiverRegistry(max_entries=1)
    registry.register(_receive_url("p", "h:1", count=2))
    with pytest.raises(EncoderInputError, match="receive_count for 'p' was 2, now 4"):
        registry.register(_receive_url("p", "h:2", count=4))
    with pytest.raises(RegistryFull, match="max_entries=1"):
        registry.register(_receive_url("q", "h:1"))


def test_registry_expires_entries_nobody_waited_for():
    registry = ReceiverRegistry(ttl_s=0)
    registry.register(_receive_url("old", "h:1"))
    registry.register(_receive_url("new", "h:1"))
    assert len(registry) == 1


def test_deliver_zmq_to_tokenizer(zmq_ctx):
    sock, address = _pull(zmq_ctx)
    host, port = address.rsplit(":", 1)
    req = EncodeRequest.from_json(encode_body(prefill_host=host, embedding_port=int(port)))
    features = torch.randn(300, 1024).to(torch.bfloat16)  # 600 KB: sent without a copy
    frames = embedding_frames(req, features, torch.tensor([[1, 20, 60]]), [(100, 37)])

    async def main():
        pusher = ZmqPusher()
        try:
            return await deliver(req, frames, pusher, ReceiverRegistry(), wait_s=1)
        finally:
            pusher.close(linger_s=10)

    assert asyncio.run(main()) == [tcp_endpoint(address)]
    frame0, frame1 = sock.recv_multipart()
    meta = read_frame0(frame0)
    assert (meta.req_id, meta.shape) == (req.req_id, [300, 1024])
    assert torch.equal(
        torch.frombuffer(bytearray(frame1), dtype=meta.dtype).reshape(300, 1024), features
    )


def test_deliver_zmq_to_scheduler_reaches_every_rank(zmq_ctx):
    (sock0, address0), (sock1, address1) = _pull(zmq_ctx), _pull(zmq_ctx)
    req = EncodeRequest.from_json(encode_body())

    async def main():
        pusher, registry = ZmqPusher(), ReceiverRegistry()
        registry.register(_receive_url(req.req_id, address0))  # one rank before /encode
        try:
            task = asyncio.create_task(deliver(req, [b"m", b"e"], pusher, registry, wait_s=5))
            await asyncio.sleep(0)
            registry.register(_receive_url(req.req_id, address1))  # the other after
            return await task
        finally:
            pusher.close(linger_s=10)

    assert asyncio.run(main()) == [tcp_endpoint(address0), tcp_endpoint(address1)]
    assert sock0.recv_multipart() == sock1.recv_multipart() == [b"m", b"e"]


def test_load_images_inline_and_hash():
    plain = base64.b64encode(PNG).decode()
    digest = "sha256:" + hashlib.sha256(PNG).hexdigest()
    items = [DATA_URL, plain, {"url": DATA_URL, "content_hash": digest}]
    req = EncodeRequest.from_json(encode_body(mm_items=items))
    loaded = load_images(req, FetchPolicy())
    assert [image.data for image in loaded] == [PNG, PNG, PNG]
    # the checked hash is kept for the item's key; unhashed items leave it to admission
    assert [image.sha256 for image in loaded] == [None, None, hashlib.sha256(PNG).digest()]


def test_load_images_hash_mismatch():
    wrong = "sha256:" + "0" * 64
    req = EncodeRequest.from_json(encode_body(mm_items=[{"url": DATA_URL, "content_hash": wrong}]))
    with pytest.raises(EncoderInputError, match=r"item 0: content_hash sha256:0+ does not match"):
        load_images(req, FetchPolicy())


def test_deliver_reports_a_rank_that_is_gone(zmq_ctx):
    (live, live_address), dead_address = _pull(zmq_ctx), _dead_address()
    req = EncodeRequest.from_json(encode_body())

    async def main():
        pusher, registry = ZmqPusher(send_timeout_s=0.2), ReceiverRegistry()
        for address in (live_address, dead_address):
            registry.register(_receive_url(req.req_id, address))
        try:
            await deliver(req, [b"m"], pusher, registry, wait_s=5)
        finally:
            pusher.close(linger_s=10)

    with pytest.raises(PushError, match="1 of 2 sends failed"):
        asyncio.run(main())
    assert live.recv_multipart() == [b"m"]
