"""One rank as a roster sees it: the row every rule of the wing reads and writes.

A row holds four kinds of facts, each kept by its own rules: its lifecycle
(``lifecycle.py``: live, draining, starting, parked, and who may call it), its health
(``health.py``: down or up, late or failed, which replica answered), its load
(``loads.py``: this roster's own work on it and the rank's last report) and the
progress both read (when it last showed any). Times are on the roster's clock, but a
report's age, which is on its ``monotonic`` clock (``Roster``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kimi_encoder.load import Work

from .records import LoadReport

Clock = Callable[[], float]

LIVE, DRAINING, STARTING, PARKED, DOWN = "live", "draining", "starting", "parked", "down"


@dataclass
class Row:
    """One rank as a roster sees it."""

    # Lifecycle.
    phase: str = LIVE  # LIVE, STARTING or PARKED: whether a replica exists and answers
    wanted: bool = True  # live and wanted: takes work; live and not wanted: draining
    fixed: bool = True  # always there (not elastic): never parks
    why: str = ""  # the last scaling reason
    note: str = ""  # Serve's status message while it starts
    generation: int = 0  # +1 each time its replica is released: its cache with it
    # Health: None is up; else when the next probe may go.
    down_until: float | None = None
    down_at: float = -math.inf  # when it was last marked down
    reason: str = ""
    slow: bool = False  # down for being late or silent, not for failing
    failed: str | None = None  # the replica whose failure marked it down, if known
    replica: str | None = None  # the replica that last answered a call sent after down_at
    replica_since: float = -math.inf  # that call's send time
    # Load and progress.
    own: Work = field(default_factory=Work)  # dispatched by this roster, not answered yet
    calls: int = 0  # calls of this roster in flight on it
    report: LoadReport | None = None
    reported_at: float = -math.inf  # the report's time on the roster's monotonic clock
    heard: float = -math.inf  # last progress seen
    progress: tuple | None = None  # (instance, answered) of the last report
    missed: float | None = None  # first missed poll since its last progress

    @property
    def is_down(self) -> bool:
        return self.down_until is not None

    @property
    def state(self) -> str:
        """LIVE, DRAINING, STARTING, PARKED, or DOWN (live, but unavailable for now)."""
        if self.phase != LIVE:
            return self.phase
        if self.down_until is not None:
            return DOWN
        return LIVE if self.wanted else DRAINING
