"""How many ranks to want, from the work queued on them (pure: a rule over samples).

The rule (``Scaler``, pure): sample the work queued on the ranks taking work, in
seconds by their fitted cost model, every ``scaling.tick_s``. Want more ranks when its mean
over ``scaling.upscale_after_s`` exceeds ``scaling.target_queue_s`` per wanted rank (as
many as that work needs at the target, at least one more); one fewer when its mean
over ``scaling.downscale_after_s`` would fit one rank fewer at half the target. Each
change restarts both windows, and nothing more is added while a rank is starting:
steady load does not flap. Work answered from a cache (the ingress's
or a rank's) queues nothing, so a burst of repeats wakes no rank. Lower ranks are wanted
first and higher ones let go first, so work packs onto the lowest ranks.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from ..args import ScalingArgs
from ..timing import DOWN_SHARE


class Scaler:
    """How many ranks to want, from samples of the queued work (module doc)."""

    def __init__(self, lo: int, hi: int, config: ScalingArgs):
        self.lo, self.hi, self.config = lo, hi, config
        self._samples: deque[tuple[float, float]] = deque()
        self._since: float | None = None  # the last change (or the first sample)

    def observe(self, now: float, queued_s: float) -> None:
        """The work queued on the ranks taking work now, in seconds."""
        if self._since is None:
            self._since = now
        self._samples.append((now, queued_s))
        horizon = now - max(self.config.upscale_after_s, self.config.downscale_after_s)
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def decide(self, now: float, wanted: int, starting: bool) -> tuple[int, str]:
        """The number of ranks to want (``wanted`` now), and why it changes ('' if not).
        Nothing is added while a rank is ``starting``."""
        target, up_s, down_s = (
            self.config.target_queue_s,
            self.config.upscale_after_s,
            self.config.downscale_after_s,
        )
        if starting:
            self.restart(now)  # the new rank's share counts once it takes work
            return wanted, ""
        queued = self._mean(now, up_s)
        if queued is not None and wanted < self.hi and queued > wanted * target:
            self.restart(now)
            need = min(self.hi, max(wanted + 1, math.ceil(queued / target)))
            return need, (
                f"{queued:.3f} s of work queued on {wanted} rank(s) for {up_s:g} s, "
                f"above {target:g} s per rank"
            )
        queued = self._mean(now, down_s)
        if queued is not None and wanted > self.lo and queued < (wanted - 1) * target * DOWN_SHARE:
            self.restart(now)
            return wanted - 1, (
                f"{queued:.3f} s of work queued for {down_s:g} s fits {wanted - 1} rank(s) "
                f"under half of {target:g} s each"
            )
        return wanted, ""

    def restart(self, now: float) -> None:
        """Both windows start again at ``now``."""
        self._since = now
        self._samples.clear()

    def _mean(self, now: float, window_s: float) -> float | None:
        """Mean queued work over the last ``window_s``; None until that much time has been
        sampled since the last change."""
        if self._since is None or now - self._since < window_s:
            return None
        values = [q for t, q in self._samples if t >= now - window_s]
        return statistics.fmean(values) if values else None
