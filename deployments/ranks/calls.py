"""What a rank call is: the one encode record, the client every call goes through, and
the error that means "not the request's doing, send it elsewhere".

Ray-free: ``deployments/handles.py`` implements ``RankClient`` over Serve's deployment
handles (tests use plain objects); ``deployments/rank.py`` receives ``EncodeCall``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kimi_encoder.items import EncoderItem


class RankUnavailableError(Exception):
    """A rank call failed for a reason that is not the request's; retry on another rank.

    ``replica`` names the rank's replica the call went to (None if it reached none). The
    error carries no time: the roster places it by when its call was sent."""

    def __init__(
        self,
        rank: int,
        cause: BaseException | str,
        replica: str | None = None,
        slow: bool = False,
    ):
        self.rank = rank
        self.cause = cause
        self.replica = replica
        self.slow = slow  # alive but late or silent: any answer brings it back
        name = type(cause).__name__ if isinstance(cause, BaseException) else "unavailable"
        first = (str(cause).splitlines() or [""])[0][:200]
        super().__init__(f"rank {rank} unavailable ({name}: {first})")


@dataclass(frozen=True)
class EncodeCall:
    """One encode call of a caller on a rank: the one record the caller builds, the rank
    client carries and the rank takes.

    ``indices`` are the request's item indices (used only to name a bad item); ``items``
    the images; ``feature_dtype`` what the features come back in; ``sent_at`` the
    caller's ``time.time()`` when it sent them (the rank's queue wait); ``caller`` the
    caller's name in the rank's load reports; ``held[k]``: the rank's cache is expected
    to hold ``items[k]``'s features, so the item may go without its file bytes;
    ``sink``: where the rank delivers the features instead of answering them
    (``sinks.EcFiles``, ``sinks.Kept``), None to answer them.
    """

    indices: Sequence[int]
    items: Sequence[EncoderItem]
    feature_dtype: str
    sent_at: float | None = None
    caller: str = ""
    held: Sequence[bool] = field(default_factory=tuple)
    sink: Any = None

    def __post_init__(self) -> None:
        assert len(self.indices) == len(self.items), (len(self.indices), len(self.items))
        assert not self.held or len(self.held) == len(self.items), (self.held, len(self.items))

    def only(self, positions: Sequence[int]) -> EncodeCall:
        """The call for ``positions`` of its items only (sent again with their bytes)."""
        sink = self.sink.only(positions) if self.sink is not None else None
        return replace(
            self,
            indices=[self.indices[k] for k in positions],
            items=[self.items[k] for k in positions],
            held=(),
            sink=sink,
        )


class Call(Protocol):
    """An awaitable rank call that can be cancelled (a no-op once it has finished).
    A Serve call also has ``routed`` and ``replica`` (``handles.RankCall``)."""

    def __await__(self) -> Any: ...

    def cancel(self) -> None: ...


class RankClient(Protocol):
    """One rank, as the wing's roster calls it (nothing else calls a rank)."""

    def encode(self, call: EncodeCall) -> Call:
        """Its ``RankReply`` to ``call``."""
        ...

    def load(self) -> Call:
        """Its ``LoadReport``; gives up routing after ``dispatch.route_timeout_s``."""
        ...

    def wake(self) -> Call:
        """Its ``LoadReport``, routed for as long as it takes: Serve starts a replica of
        a parked rank for a call that waits for one."""
        ...

    def hold(self, seconds: float) -> Call:
        """A call the rank answers (its ``LoadReport``) after ``seconds``: while one is
        open, Serve counts a call in flight and keeps the rank's replica."""
        ...

    def info(self) -> Call:
        """Its own report for ``/v1/info``."""
        ...

    def push(self, part: Any, stored: Sequence[Any]) -> Call:
        """Push an sglang part's frames (``sinks.PartPush``) from the features it keeps."""
        ...

    async def replica_alive(self, replica: Any) -> bool:
        """Whether ``replica`` (one the rank answered from) still exists; unknown: True."""
        ...
