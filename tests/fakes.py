"""Fake rank clients for the fan-out and hand-off tests without Ray: each answers with
features derived from its items' bytes (so a wrong order or a mixed-up duplicate shows
as wrong data), runs a test's ``behaviour`` first, and records its calls."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable

import numpy as np

from deployments.args import DispatchArgs
from deployments.ranks.records import LoadReport, Progress, RankReply
from deployments.ranks.roster import Roster
from deployments.sinks import EcFiles, Written
from kimi_encoder.config import get_preset
from kimi_encoder.cost import CostModel
from kimi_encoder.items import EncoderItem
from kimi_encoder.load import Work

PRESET = get_preset("tiny")
VISION = PRESET.vision


def features_of(item: EncoderItem) -> np.ndarray:
    """What a fake rank returns for ``item``: rows derived from its bytes and grid."""
    seed = int.from_bytes(hashlib.sha256(item.image).digest()[:4], "little")
    rows = VISION.num_tokens(item.grid)
    return np.random.default_rng(seed).random((rows, VISION.text_hidden_size), dtype=np.float32)


class FakeCall:
    def __init__(self, coro):
        self.task = asyncio.ensure_future(coro)

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        self.task.cancel()


Behaviour = Callable[[int, list[int], list[EncoderItem]], object]


class FakeRank:
    """A rank client whose encode runs ``behaviour`` (a coroutine function) or answers."""

    def __init__(self, rank: int, behaviour=None):
        self.rank = rank
        self.behaviour = behaviour
        self.calls: list[list[int]] = []  # request indices of each encode call
        self.held: list[list[bool]] = []  # which of them the fan-out expected cached
        self.sinks: list = []  # each call's sink (None: features come back)
        self.cancelled = 0
        self.pushes: list = []  # (part, features) of each push
        self.holds = self.released = 0  # hold calls sent, and cancelled
        self.push_behaviour = None

    def encode(self, call):
        """``call``: the ``ranks.calls.EncodeCall`` the roster sends."""
        self.calls.append(list(call.indices))
        self.held.append(list(call.held))
        self.sinks.append(call.sink)
        return FakeCall(
            self._encode(list(call.indices), list(call.items), call.feature_dtype, call.sink)
        )

    async def _encode(self, indices, items, feature_dtype, sink=None):
        try:
            if self.behaviour is not None:
                await self.behaviour(self.rank, indices, items)
            features = [features_of(item) for item in items]
            # Kept (sglang parts): the arrays themselves stand for the ranks' refs.
            if isinstance(sink, EcFiles):  # delivered there: what was written, in their place
                features = [
                    Written(f.shape, feature_dtype, {u: f.nbytes for u in uuids})
                    for f, uuids in zip(features, sink.uuids, strict=True)
                ]
            return RankReply(  # the rank's contract: one array per item, in the call's order
                rank=self.rank,
                features=features,
                dtype=feature_dtype,
                encode_ms=1.0,
                stages_ms={"queue_wait": 0.0, "preprocess": 0.5, "forward": 0.5},
                done_at=0.0,
            )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def push(self, part, stored) -> FakeCall:
        """Records the part and the features it was given; ``push_behaviour`` runs first."""

        async def push():
            if self.push_behaviour is not None:
                await self.push_behaviour(self.rank, part, stored)
            self.pushes.append((part, list(stored)))
            return {"rank": self.rank}

        return FakeCall(push())

    def load(self) -> FakeCall:
        async def report():
            return LoadReport({}, CostModel.patches(), Progress(f"rank-{self.rank}", 0))

        return FakeCall(report())

    def wake(self) -> FakeCall:
        return self.load()

    def hold(self, seconds: float) -> FakeCall:
        """Open until cancelled (the test's time is not the hold's)."""
        self.holds += 1

        async def held():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.released += 1
                raise

        return FakeCall(held())


def make_roster(
    ranks, cooldown_s: float = 60.0, clock=time.monotonic, fixed=None, **dispatch
) -> Roster:
    """A roster of ``ranks`` with the default dispatch settings but exact load reports
    (every request polls) and ``cooldown_s``; ``dispatch`` overrides others; ``fixed``:
    how many ranks always run (None: all)."""
    settings = {"load_report_interval_ms": 0, "cooldown_s": cooldown_s, **dispatch}
    return Roster(ranks, DispatchArgs(**settings), clock=clock, fixed=fixed)


class Clock:
    """A clock the test moves by hand (the ``Roster``'s ``clock``); counts its reads, so a
    test can wait until the fan-out has looked at the time it set."""

    def __init__(self):
        self.now = 1000.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    async def seen(self, reads: int = 3) -> None:
        """Until the fan-out has read the clock ``reads`` more times (a full wake and check)."""
        until = self.reads + reads

        async def reading() -> None:
            while self.reads < until:
                await asyncio.sleep(0.001)

        # A fan-out that stopped reading the clock has ended (or hangs): fail, do not wait.
        await asyncio.wait_for(reading(), 30)


def busy(answered: int, instance: str = "x") -> LoadReport:
    """A load report of a rank that holds work and has answered ``answered`` calls."""
    work = {"ingress-other": Work(3, 300, 30000)}
    return LoadReport(work, CostModel.patches(), Progress(instance, answered))
