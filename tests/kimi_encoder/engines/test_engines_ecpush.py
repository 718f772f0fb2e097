"""The encoder-cache push (kimi_encoder.engines.ecpush) against its receiving side
(kimi_encoder.engines.ecreceive), over loopback TCP: what a worker stages is what was
pushed, bit for bit; every refusal and timeout is bounded and says why."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import numpy as np
import pytest
import torch
import zmq

from kimi_encoder.engines.ecpush import (
    MAGIC,
    EcPushBusy,
    EcPusher,
    EcPushError,
    check_put,
    put_header,
)
from kimi_encoder.engines.ecreceive import Receiver, Staging, Watcher, worker_ports
from kimi_encoder.features import to_numpy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def receiver():
    made = []

    def make(capacity: int = 1 << 24, ttl_s: float = 60.0, port: int | None = None):
        made.append(Receiver("127.0.0.1", port or free_port(), Staging(capacity, ttl_s)))
        return made[-1]

    yield make
    for r in made:
        r.close()


def run(coro):
    return asyncio.run(coro)


def wait_until(predicate, within_s: float = 5.0):
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pushed_items_are_staged_bit_for_bit(receiver, dtype):
    rx = receiver()
    features = torch.randn(37, 64).to(dtype)
    array = to_numpy(features)  # bfloat16 as its 16-bit words
    name = str(dtype).removeprefix("torch.")

    async def push():
        pusher = EcPusher(timeout_s=5)
        try:
            return await pusher.push(rx.address, "chat-1-image-0", array, name, "item 0"), pusher
        finally:
            pusher.close()

    sent, pusher = run(push())
    assert sent == array.nbytes
    info = pusher.info()[rx.address]
    assert {k: info[k] for k in ("pushes", "bytes", "acks", "busy", "failures")} == {
        "pushes": 1,
        "bytes": array.nbytes,
        "acks": 1,
        "busy": 0,
        "failures": 0,
    }
    assert info["worker"] == rx.stats()  # what the worker said with its answer
    assert (info["worker"]["staged"], info["worker"]["items"]) == (1, 1)
    staged = rx.staging.get("chat-1-image-0")
    assert staged.dtype == dtype
    assert torch.equal(staged, features)
    assert rx.staging.get("chat-1-image-0") is staged  # left staged: it can load again
    assert (rx.staging.counts["loaded"], rx.staging.counts["loaded_again"]) == (1, 1)


def test_a_full_staging_answers_busy_and_stages_nothing(receiver):
    rx = receiver(capacity=1000)
    small, big = np.zeros((2, 100), np.float32), np.zeros((4, 100), np.float32)

    async def push():
        pusher = EcPusher(timeout_s=5)
        try:
            await pusher.push(rx.address, "a", small, "float32", "item 0")  # 800 bytes
            with pytest.raises(
                EcPushBusy,
                match=r"item 1: .* is full .*staging holds 800 of "
                r"1000 bytes, 0 of them named by unfinished requests; this item needs 1600",
            ) as caught:
                await pusher.push(rx.address, "b", big, "float32", "item 1")
            assert caught.value.retry_after_s == 1
            return pusher.info()[rx.address]
        finally:
            pusher.close()

    assert run(push())["busy"] == 1
    assert rx.staging.get("b") is None
    assert rx.busy == 1


def test_nothing_listening_is_an_error_within_the_timeout():
    address = f"tcp://127.0.0.1:{free_port()}"

    async def push():
        pusher = EcPusher(timeout_s=0.5)
        try:
            started = time.monotonic()
            with pytest.raises(
                EcPushError,
                match=r"item 2 \(uuid 'u'\): nothing accepted the "
                r"push at tcp://127.0.0.1:\d+ within 0.5 s",
            ):
                await pusher.push(
                    address, "u", np.zeros((1, 8), np.float32), "float32", "item 2 (uuid 'u')"
                )
            return time.monotonic() - started, pusher.info()[address]
        finally:
            pusher.close()

    took, stats = run(push())
    assert took < 2
    assert stats["failures"] == 1
    assert stats["acks"] == 0


def test_a_receiver_that_never_answers_times_out():
    """A peer that takes the connection but never acknowledges (a stalled consumer)."""
    context = zmq.Context()
    mute = context.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")

    async def push():
        pusher = EcPusher(timeout_s=0.5)
        try:
            with pytest.raises(EcPushError, match=r"did not acknowledge the push within 0\.5 s"):
                await pusher.push(
                    f"tcp://127.0.0.1:{port}",
                    "u",
                    np.zeros((1, 8), np.float32),
                    "float32",
                    "item 0",
                )
        finally:
            pusher.close()

    try:
        run(push())
    finally:
        context.destroy(linger=0)


def test_destination_slots_bound_the_pushes_in_flight():
    context = zmq.Context()
    mute = context.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"

    async def push():
        pusher = EcPusher(timeout_s=0.3, max_in_flight=8, max_per_destination=2)
        array = np.zeros((1, 8), np.float32)
        try:
            results = await asyncio.gather(
                *(pusher.push(endpoint, f"u{k}", array, "float32", f"item {k}") for k in range(3)),
                return_exceptions=True,
            )
            return results, pusher.info()[endpoint]
        finally:
            pusher.close()

    try:
        results, stats = run(push())
    finally:
        context.destroy(linger=0)
    busy = [r for r in results if isinstance(r, EcPushBusy)]
    assert len(busy) == 1
    assert "2 pushes to tcp://127.0.0.1" in str(busy[0])
    assert stats["pushes"] == 2  # the third never left


@pytest.mark.parametrize(
    ("header", "nbytes", "match"),
    [
        ({"op": "watch"}, 0, "expected a put header"),
        ({"op": "put", "mm_hash": "", "dtype": "float32", "shape": [1, 2]}, 8, "mm_hash"),
        ({"op": "put", "mm_hash": "a", "dtype": "int8", "shape": [1, 2]}, 2, "dtype 'int8'"),
        ({"op": "put", "mm_hash": "a", "dtype": "float32", "shape": [0, 2]}, 0, "shape"),
        (
            {"op": "put", "mm_hash": "a", "dtype": "float32", "shape": [2, 2]},
            8,
            r"payload has 8 bytes, \[2, 2\] float32 needs 16",
        ),
    ],
    ids=["not-put", "empty-hash", "dtype", "shape", "size"],
)
def test_malformed_puts_are_named(header, nbytes, match):
    with pytest.raises(ValueError, match=match):
        check_put(header, nbytes)


def test_a_malformed_push_is_refused_over_the_wire(receiver):
    rx = receiver()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(rx.address)
    try:
        sock.send_multipart([MAGIC, put_header(7, "x", "float32", [2, 2]), b"\0" * 8])
        assert sock.poll(5000)
        magic, body = sock.recv_multipart()
        answer = json.loads(body)
        assert (magic, answer["id"], answer["status"]) == (MAGIC, 7, "refused")
        assert "needs 16" in answer["message"]
    finally:
        context.destroy(linger=0)
    assert rx.refused == 1


def test_the_watcher_sees_items_staged_on_every_worker(receiver):
    a, b = receiver(), receiver()
    watcher = Watcher([a.address, b.address])
    array = np.ones((3, 4), np.float32)

    async def push(address, mm_hash):
        pusher = EcPusher(timeout_s=5)
        try:
            await pusher.push(address, mm_hash, array, "float32", "item 0")
        finally:
            pusher.close()

    try:
        run(push(a.address, "img"))

        def seen_on(n):
            watcher.drain()
            return watcher.staged_on("img") == n

        wait_until(lambda: seen_on(1))
        assert watcher.rows("img") is None  # one of two workers
        run(push(b.address, "img"))
        wait_until(lambda: seen_on(2))
        assert watcher.rows("img") == 3
    finally:
        watcher.close()


def test_staged_items_expire_and_the_watcher_hears_it(receiver):
    rx = receiver(ttl_s=0.2)
    watcher = Watcher([rx.address])

    async def push():
        pusher = EcPusher(timeout_s=5)
        try:
            await pusher.push(rx.address, "old", np.ones((1, 4), np.float32), "float32", "i")
        finally:
            pusher.close()

    try:
        run(push())
        watcher.drain()
        wait_until(lambda: (watcher.drain(), rx.staging.held_bytes == 0)[1])
        wait_until(lambda: (watcher.drain(), watcher.staged_on("old") == 0)[1])
    finally:
        watcher.close()


def test_a_taken_port_is_named(receiver):
    rx = receiver()
    port = int(rx.address.rsplit(":", 1)[1])
    with pytest.raises(
        OSError,
        match=rf"cannot listen for pushed features at "
        rf"tcp://127.0.0.1:{port} .*free the port",
    ):
        Receiver("127.0.0.1", port, Staging(1 << 20, 60))


def test_worker_ports_outside_the_range_are_named():
    with pytest.raises(ValueError, match="outside 1-65535; lower ec_port"):
        worker_ports(65535, dp_index=0, tp_size=2)
    with pytest.raises(ValueError, match="set ec_buffer_size and staged_ttl_s above 0"):
        Staging(0, 1)


def test_idle_sockets_beyond_the_bound_are_closed(receiver, monkeypatch):
    monkeypatch.setattr("kimi_encoder.engines.ecpush.MAX_SOCKETS", 2)
    monkeypatch.setattr("kimi_encoder.engines.ecpush.MAX_STATS", 2)
    rxs = [receiver() for _ in range(3)]
    array = np.ones((1, 4), np.float32)

    async def push():
        pusher = EcPusher(timeout_s=5)
        try:
            for rx in rxs:
                await pusher.push(rx.address, "x", array, "float32", "item 0")
            return list(pusher._sockets), pusher.info()
        finally:
            pusher.close()

    sockets, info = run(push())
    assert sockets == [rxs[1].address, rxs[2].address]  # the oldest idle one closed
    assert list(info) == sorted([rxs[1].address, rxs[2].address])


def test_a_scheduler_asking_again_holds_one_watch(receiver):
    rx = receiver()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(rx.address)
    try:
        sock.send_multipart([MAGIC, json.dumps({"op": "watch", "after": 0}).encode()])
        assert sock.poll(5000)
        state = json.loads(sock.recv_multipart()[1])  # a new watcher gets the state first
        assert (state["op"], state["epoch"], state["staged"]) == ("state", rx.epoch, {})
        watch = {"op": "watch", "after": state["last"], "epoch": rx.epoch}
        for _ in range(5):  # asked again while the first waits: one answer, not five
            sock.send_multipart([MAGIC, json.dumps(watch).encode()])
        assert sock.poll(5000)
        assert json.loads(sock.recv_multipart()[1])["events"] == []
        assert not sock.poll(1500)
    finally:
        context.destroy(linger=0)
