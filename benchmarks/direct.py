"""The same requests encoded without a server: worker processes holding one encoder each.

Each worker is a fresh process (one torch thread, the preset's encoder, warmed
up) that encodes the request stream back to back for the seconds it is asked
to; running one worker or two at once gives the machine's own ceiling for one
and two ranks, with nothing else of ours running.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Sequence

from . import cpu
from .serving import Window


def _worker(conn, preset: str, stream: Sequence[Sequence[bytes]]) -> None:
    import torch

    from kimi_encoder.encoder import VisionEncoder

    torch.set_num_threads(1)
    encoder = VisionEncoder.from_pretrained(preset, device="cpu", backend="cpu")
    encoder.encode([encoder.plan(data) for data in stream[0]])  # warm-up
    conn.send("ready")
    k = 0
    while (seconds := conn.recv()) is not None:
        images, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            request = stream[k % len(stream)]
            encoder.encode([encoder.plan(data) for data in request])
            images += len(request)
            k += 1
        conn.send((images, time.perf_counter() - start))


class DirectWorkers:
    """``count`` encoder processes for ``preset`` over ``stream`` (a context manager)."""

    def __init__(self, preset: str, stream: Sequence[Sequence[bytes]], count: int = 2):
        context = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(child, preset, stream), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.recv() == "ready"
        self.labels = {p.pid: f"direct worker {i}" for i, p in enumerate(self.procs)}

    def run(self, workers: int, seconds: float) -> Window:
        """The first ``workers`` encode at once for about ``seconds``; their summed rate."""
        before = cpu.snapshot(self.labels)
        for conn in self.conns[:workers]:
            conn.send(seconds)
        answers = [conn.recv() for conn in self.conns[:workers]]
        after = cpu.snapshot(self.labels)
        images_per_s = sum(images / elapsed for images, elapsed in answers)
        return Window(0.0, images_per_s, 0.0, cpu.usage(before, after))

    def __enter__(self) -> DirectWorkers:
        return self

    def __exit__(self, *exc) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
