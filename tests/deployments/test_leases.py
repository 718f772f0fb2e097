"""deployments/leases.py: the byte budget of a rank (pure asyncio, no Ray)."""

from __future__ import annotations

import asyncio

import pytest
from PIL import Image

from deployments.leases import MemoryLeases, item_bytes
from kimi_encoder.encoder import VisionEncoder


def run(coro):
    return asyncio.run(coro)


def test_waits_for_room_and_releases_on_success_error_and_cancel():
    async def scenario():
        leases = MemoryLeases(100)
        order: list[str] = []
        first_in = asyncio.Event()
        release_first = asyncio.Event()

        async def holder(name: str, nbytes: int, gate: asyncio.Event | None = None):
            async with leases.hold(nbytes):
                order.append(name)
                if name == "a":
                    first_in.set()
                if gate is not None:
                    await gate.wait()

        a = asyncio.create_task(holder("a", 70, release_first))
        await first_in.wait()
        b = asyncio.create_task(holder("b", 50))  # does not fit next to a: waits
        c = asyncio.create_task(holder("c", 10))  # fits, but waits behind b (first come)
        await asyncio.sleep(0.01)
        assert (leases.held, order, leases.info()["leases_waiting"]) == (70, ["a"], 2)
        release_first.set()
        await asyncio.gather(a, b, c)
        assert order == ["a", "b", "c"]
        assert leases.held == 0

        async def failing():
            async with leases.hold(40):
                raise ValueError("encoder failed")

        with pytest.raises(ValueError, match="encoder failed"):
            await failing()
        assert leases.held == 0

        gate = asyncio.Event()
        running = asyncio.create_task(holder("d", 90, gate))
        await asyncio.sleep(0.01)
        queued = asyncio.create_task(holder("e", 50))  # waits for d, then is cancelled
        await asyncio.sleep(0.01)
        running.cancel()
        queued.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)
        stats = leases.info()
        assert (stats["inflight_bytes"], stats["leases_waiting"]) == (0, 0)
        assert stats["leases_granted"] == stats["leases_released"]
        assert stats["peak_inflight_bytes"] <= 100

    run(scenario())


def test_timeout_releases_and_an_oversized_lease_runs_alone():
    async def scenario():
        leases = MemoryLeases(100)

        async def slow():
            async with leases.hold(30):
                await asyncio.sleep(10)

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow(), 0.05)
        assert leases.held == 0
        async with leases.hold(500):  # larger than the budget: admitted while nothing is held
            assert leases.held == 500
        assert leases.info()["leases_oversized"] == 1
        assert leases.held == 0

    run(scenario())


def test_item_bytes_counts_input_pixels_and_features():
    import io

    out = io.BytesIO()
    Image.new("RGB", (56, 28)).save(out, "PNG")
    encoder = VisionEncoder.from_pretrained("tiny", device="cpu", dtype="float32", backend="cpu")
    item = encoder.plan(out.getvalue())
    _, h, w = item.grid
    hidden = encoder.vision.text_hidden_size
    expected = len(out.getvalue()) + h * w * 3 * 14 * 14 * 4 + (h // 2) * (w // 2) * hidden * 4
    assert item_bytes(item, encoder.vision) == expected


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_inflight_bytes must be >= 1, got 0"):
        MemoryLeases(0)
