"""A real encoder that a test can hold, fail or break, through a switchboard actor.

``bind_app(args, controlled_factory(board))`` gives every rank a ``ControlledEncoder``:
the library's own ``VisionEncoder`` whose ``forward`` first asks the test's
``Switchboard`` what to do. The default is to run normally; a test can make one
rank's forwards wait until it releases them (and wait itself until a forward is
held), raise, or return NaN features (a broken device: health checks fail).
Actions are tied to the rank's process id, so a replacement process runs normally.
A health-check probe is never held (``fail`` and ``nan`` still reach it): Serve probes
a replica as soon as it runs and then every period, and a held probe would stand in for
the request forward a test means to hold (``wait_held`` would return before that
request reached the rank).
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from collections import defaultdict

import ray
import torch
from ray import cloudpickle, serve

from deployments.rank import _probe_image
from kimi_encoder.encoder import VisionEncoder

# Replicas cannot import the tests' modules: ship this one's classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROBE = _probe_image()  # the rank's health-check image


@ray.remote(num_cpus=0)
class Switchboard:
    """What each rank's forwards do: ``run``, ``hold`` (until released), ``fail``, ``nan``."""

    def __init__(self):
        self.modes: dict[int, tuple[str, int | None]] = {}  # rank -> (mode, pid or None)
        self.released: dict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.holding: dict[int, int] = defaultdict(int)  # rank -> forwards waiting now
        self.held: dict[int, asyncio.Event] = defaultdict(asyncio.Event)

    def set(self, rank: int, mode: str, pid: int | None = None) -> None:
        """Rank ``rank``'s forwards (of process ``pid`` only, when given) do ``mode``."""
        assert mode in ("run", "hold", "fail", "nan"), mode
        self.modes[rank] = (mode, pid)
        if mode == "hold":
            self.released[rank] = asyncio.Event()
            self.held[rank] = asyncio.Event()
        else:
            self.released[rank].set()

    async def wait_held(self, rank: int) -> int:
        """Until a forward of ``rank`` is held; how many are."""
        await self.held[rank].wait()
        return self.holding[rank]

    async def enter(self, rank: int, pid: int, probe: bool = False) -> str:
        """Called by each forward: what it must do (after waiting, when held)."""
        mode, for_pid = self.modes.get(rank, ("run", None))
        if for_pid is not None and for_pid != pid:
            return "run"
        if mode == "hold" and probe:
            return "run"
        if mode == "hold":
            self.holding[rank] += 1
            self.held[rank].set()
            try:
                await self.released[rank].wait()
            finally:
                self.holding[rank] -= 1
            return "run"
        return mode


class ControlledEncoder(VisionEncoder):
    board: ray.actor.ActorHandle
    rank: int

    @classmethod
    def build(cls, board: ray.actor.ActorHandle, checkpoint, **kwargs) -> ControlledEncoder:
        encoder = cls.from_pretrained(checkpoint, **kwargs)
        encoder.board = board
        name = serve.get_replica_context().deployment  # "EncoderRank_<r>"
        encoder.rank = int(name.rsplit("_", 1)[1])
        return encoder

    def forward(self, pixels, items):
        probe = len(items) == 1 and items[0].image == PROBE
        action = ray.get(self.board.enter.remote(self.rank, os.getpid(), probe))
        if action == "fail":
            raise RuntimeError(f"rank {self.rank}: the device failed (test)")
        features = super().forward(pixels, items)
        if action == "nan":
            return [torch.full_like(f, float("nan")) for f in features]
        return features


def controlled_factory(board: ray.actor.ActorHandle):
    """The ``encoder_factory`` for ``bind_app``: every rank asks ``board``."""
    return functools.partial(ControlledEncoder.build, board)
