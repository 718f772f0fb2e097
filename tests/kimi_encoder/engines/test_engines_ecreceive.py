"""What a vLLM worker keeps of the features pushed to it (kimi_encoder.engines.ecreceive):
an item stays while a request names it and loads again; it goes when the last one
finishes, after staged_ttl_s unnamed, or, evicted oldest unreferenced first, when a push
needs the room; a scheduler that fell behind the worker's event memory gets the whole
state; a restarted worker's items are reported lost; staged bytes return to zero and
the worker's memory stays flat over a long push loop."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest
import torch

from kimi_encoder.engines import ecreceive
from kimi_encoder.engines.ecpush import EcPushBusy, EcPusher
from kimi_encoder.engines.ecreceive import Receiver, Staging, Watcher


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, within_s: float = 10.0):
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


@pytest.fixture
def made():
    things = []
    yield things
    for thing in things:
        thing.close()


def receiver(made, capacity=1 << 24, ttl_s=60.0, port=None) -> Receiver:
    made.append(Receiver("127.0.0.1", port or free_port(), Staging(capacity, ttl_s)))
    return made[-1]


def watcher(made, *rxs) -> Watcher:
    made.append(Watcher([rx.address for rx in rxs]))
    return made[-1]


def push_all(address: str, names: list[str], rows: int = 2, hidden: int = 4, **kwargs):
    """Push each name (features: its index) with the ranks' producer; the answers."""

    async def go():
        pusher = EcPusher(timeout_s=10, **kwargs)
        try:
            pushes = [
                pusher.push(
                    address, name, np.full((rows, hidden), i, np.float32), "float32", f"item {i}"
                )
                for i, name in enumerate(names)
            ]
            return await asyncio.gather(*pushes, return_exceptions=True)
        finally:
            pusher.close()

    return asyncio.run(go())


def tensor(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes // 4, dtype=torch.float32).reshape(1, -1)


# (pushed in order, holds, next push's bytes) -> evicted, or None: busy
EVICTION = [
    ([("a", 400), ("b", 400)], {}, 400, ["a"]),
    ([("a", 400), ("b", 400)], {"r": ["a"]}, 400, ["b"]),
    ([("a", 400), ("b", 400)], {"r": ["a"], "s": ["b"]}, 400, None),
    ([("a", 400), ("b", 200), ("c", 200)], {"r": ["b"]}, 700, ["a", "c"]),
    ([("a", 400), ("b", 400)], {}, 1200, None),
    ([("a", 400), ("b", 400)], {}, 200, []),
]


@pytest.mark.parametrize(
    ("pushed", "holds", "nbytes", "evicted"),
    EVICTION,
    ids=["oldest", "skip-held", "all-held-busy", "several", "too-big", "fits"],
)
def test_room_is_made_oldest_unreferenced_first(pushed, holds, nbytes, evicted):
    staging = Staging(1000, 60)
    for name, size in pushed:
        staging.put(name, tensor(size), 0.0)
    for request, names in holds.items():
        staging.hold(request, names)
    before = staging.snapshot()
    assert staging.make_room(nbytes, "new") == evicted
    if evicted is None:
        assert staging.snapshot() == before  # nothing dropped for a push that cannot fit
    else:
        assert set(staging.snapshot()) == set(before) - set(evicted)
        assert staging.counts["evicted"] == len(evicted)
    for names in holds.values():
        assert set(names) <= set(staging.snapshot())  # nothing referenced dropped


def test_an_item_stays_while_a_request_names_it_and_goes_with_the_last():
    staging = Staging(1 << 20, 0.05)
    staging.put("img", tensor(64), 0.0)
    staging.hold("first", ["img"])
    staging.hold("second", ["img"])
    assert staging.get("img") is not None
    assert staging.expire(now=10.0) == []  # named: never expires
    assert staging.release("first", 10.0) == []  # the second still names it
    assert staging.get("img") is not None  # loaded again for it
    assert staging.counts["loaded_again"] == 1
    assert staging.release("second", 10.0) == ["img"]
    assert (staging.held_bytes, len(staging), staging.requests()) == (0, 0, [])
    assert staging.counts["released"] == 1


def test_a_push_again_waits_for_a_request_named_after_it():
    """The same uuid pushed again while a request holds it (a router naming images by
    content): the holder finishing does not drop what the next request will ask for."""
    staging = Staging(1 << 20, 5.0)
    staging.put("img", tensor(64), 0.0)
    staging.hold("first", ["img"])
    staging.put("img", tensor(64), 1.0)  # pushed again for the next chat request
    assert staging.release("first", 2.0) == []
    assert "img" in staging.snapshot()
    staging.hold("next", ["img"])
    assert staging.release("next", 3.0) == ["img"]


def test_an_item_named_before_its_push_goes_with_its_request():
    staging = Staging(1 << 20, 5.0)
    staging.hold("early", ["img"])
    staging.put("img", tensor(64), 0.0)
    assert staging.release("early", 1.0) == ["img"]
    assert staging.held_bytes == 0


def test_unnamed_items_expire_after_the_ttl():
    staging = Staging(1 << 20, 5.0)
    staging.put("old", tensor(64), 0.0)
    staging.put("new", tensor(64), 4.0)
    assert staging.expire(now=4.9) == []
    assert staging.expire(now=5.0) == ["old"]
    assert staging.counts["expired"] == 1


def test_a_watcher_behind_the_event_memory_gets_the_whole_state(made, monkeypatch):
    monkeypatch.setattr(ecreceive, "MAX_EVENTS", 16)
    rx = receiver(made)
    view = watcher(made, rx)
    wait_until(lambda: (view.drain(), view._epoch[0] == rx.epoch)[1])
    names = [f"backlog-{i}" for i in range(3 * 16)]  # 3x the events remembered
    assert push_all(rx.address, names) == [2 * 4 * 4] * len(names)  # all acknowledged
    wait_until(lambda: (view.drain(), all(view.rows(n) == 2 for n in names))[1])
    assert view.counts["lost"] == 0


def test_held_items_outlive_their_push_until_released_after_their_loads(made):
    rx = receiver(made, capacity=64)  # room for two items of 32 bytes
    view = watcher(made, rx)
    view.hold("chat-1", ["a"])
    assert push_all(rx.address, ["a", "b"]) == [32, 32]
    wait_until(lambda: (view.drain(), view.held("chat-1") and view.rows("a") == 2)[1])
    # A third push evicts the unreferenced one, never the held one.
    assert push_all(rx.address, ["c"]) == [32]
    wait_until(lambda: (view.drain(), view.fate("b") == (rx.address, "evicted"))[1])
    assert set(rx.staging.snapshot()) == {"a", "c"}
    # Held and full: a push that cannot fit is busy, nothing dropped.
    view.hold("chat-2", ["c"])
    wait_until(lambda: (view.drain(), view.held("chat-2"))[1])
    (busy,) = push_all(rx.address, ["d"])
    assert isinstance(busy, EcPushBusy)
    assert "64 of them named by unfinished requests" in str(busy)
    # A release waits until the worker made the loads of the step it names.
    view.release("chat-1", after_step=3)
    view.drain()
    time.sleep(3 * ecreceive.POLL_MS / 1000)
    assert "a" in rx.staging.snapshot()
    rx.loaded_through(3)
    wait_until(lambda: "a" not in rx.staging.snapshot())
    view.release("chat-2", after_step=0)
    wait_until(lambda: rx.staging.held_bytes == 0)  # every request finished: nothing held
    wait_until(lambda: (view.drain(), view.fate("c") == (rx.address, "released"))[1])


def test_a_restarted_worker_reports_its_items_lost(made):
    port = free_port()
    rx = receiver(made, port=port)
    view = watcher(made, rx)
    view.hold("waiting", ["gone-1", "later"])
    push_all(rx.address, ["gone-1"])
    wait_until(lambda: (view.drain(), view.rows("gone-1") == 2 and view.held("waiting"))[1])
    rx.close()
    made.remove(rx)
    again = receiver(made, port=port)
    wait_until(lambda: (view.drain(), bool(view.lost))[1], within_s=20)
    assert view.lost == [(0, {"gone-1"})]
    assert view.fate("gone-1") == (again.address, "lost")
    assert view.counts["lost"] == 1
    wait_until(lambda: (view.drain(), view.held("waiting"))[1])  # held again on the new one
    push_all(again.address, ["later"])
    wait_until(lambda: (view.drain(), view.rows("later") == 2)[1])


def test_worker_memory_stays_flat_over_a_long_push_loop(made):
    """Push, hold, load and release 64 KiB items in a loop: staged bytes return to zero
    and the receiving process's RSS grows by less than 16 MiB after a warm-up."""
    rx = receiver(made, capacity=1 << 22)
    view = watcher(made, rx)
    wait_until(lambda: (view.drain(), view._epoch[0] == rx.epoch)[1])

    def rss_mib() -> float:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmRSS"))
        return int(line.split()[1]) / 1024

    def loop(rounds: int, start: int) -> None:
        for k in range(start, start + rounds):
            names = [f"loop-{k}-{i}" for i in range(8)]
            view.hold(f"chat-{k}", names)
            wait_until(lambda k=k: (view.drain(), view.held(f"chat-{k}"))[1])
            assert push_all(rx.address, names, rows=16, hidden=1024) == [65536] * 8
            for name in names:
                assert rx.staging.get(name) is not None
            view.release(f"chat-{k}", after_step=0)
        wait_until(lambda: (view.drain(), rx.staging.held_bytes == 0)[1])

    loop(40, 0)
    warm = rss_mib()
    loop(200, 40)  # 1600 items, 100 MiB pushed
    grown = rss_mib() - warm
    print(f"RSS after warm-up {warm:.1f} MiB, grew {grown:.1f} MiB over 1600 pushes")
    assert len(rx.staging) == 0
    assert rx.staging.requests() == []
    assert grown < 16, grown
