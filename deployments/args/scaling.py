"""``dp_size`` and ``scaling``: the ranks there are, and how elastic ones follow the load."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from ..timing import LOOK_BACK_S, METRICS_INTERVAL_S
from .base import Section


class DpRange(Section):
    """Elastic vision DP: between ``min`` and ``max`` ranks take work, as the load asks."""

    min: int = Field(ge=1, description="Ranks that always run (never parked).")
    max: int = Field(ge=1, description="Most ranks running at once (one GPU each).")

    @model_validator(mode="after")
    def _ordered(self) -> DpRange:
        if self.max < self.min:
            raise ValueError(
                f"max ({self.max}) must be at least min ({self.min}), e.g. "
                f"{{min: {self.min}, max: {2 * self.min}}}"
            )
        return self


class ScalingArgs(Section):
    """How elastic ranks (``dp_size: {min, max}``) follow the load (deployments/ranks/scaler.py).
    The app's scaler decides how many ranks it wants; Serve starts and releases their replicas.
    Ignored with a fixed ``dp_size``."""

    # One rank's queue of this many seconds of work is what a closed loop of a few clients
    # keeps on a busy rank; more means requests wait behind each other.
    target_queue_s: float = Field(
        0.05,
        gt=0,
        description="Work queued per rank (seconds, by the ranks' fitted cost model) above "
        "which the ingress wants one rank more.",
    )
    upscale_after_s: float = Field(
        2.0,
        gt=0,
        description="How long the queue must stay above target_queue_s per rank (on average) "
        "before another rank is started.",
    )
    downscale_after_s: float = Field(
        15.0,
        gt=0,
        description="How long the queued work must fit one rank fewer at half of "
        "target_queue_s before a rank is given no new work (then parked: park_after_s). "
        "A GPU config may wait longer: a real checkpoint takes minutes to load again.",
    )
    park_after_s: float = Field(
        10.0,
        ge=0,
        description="A rank given no new work releases its replica (process, GPU, CPUs) once "
        "it has had no call for this long (Serve's downscale_to_zero_delay_s, after its "
        "look-back window).",
    )
    tick_s: float = Field(
        0.25,
        gt=0,
        description="How often the app's scaler samples the queued work (polling the wanted "
        "ranks' load reports) and decides.",
    )
    hold_s: float = Field(
        5.0,
        gt=0,
        description="Each wanted elastic rank has one call of the scaler open at all times, "
        "answered after this long and sent again, so Serve never parks a rank the app "
        "counts on; after a failed one the next waits dispatch.cooldown_s.",
    )
    report_fresh_s: float = Field(
        2.0,
        gt=0,
        description="A rank's load report or an ingress replica's view of its dispatched work "
        "counts whole for the scaler this long, then less and less (report_stale_s).",
    )
    report_stale_s: float = Field(
        6.0,
        gt=0,
        description="... and not at all from this age on: a count nobody refreshed (a rank that "
        "stopped answering, an ingress replica that died) holds no rank alive. More than "
        "report_fresh_s.",
    )
    start_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A rank started for the load that has not answered within this long (no "
        "GPU free, a failing start) is reported with Serve's reason and left parked; the "
        "service goes on with the live ranks and tries it again after as long. With ranks "
        "on CUDA it must cover a start: model.auto_budget_s (none with execution 'eager') "
        "+ 60 s + the checkpoint's vision weights read at 100 MB/s, + their fetch at 50 MB/s "
        "for a hub checkpoint not yet fetched where the config is checked.",
    )

    @model_validator(mode="after")
    def _ages_ordered(self) -> ScalingArgs:
        if self.report_stale_s <= self.report_fresh_s:
            raise ValueError(
                f"scaling.report_stale_s ({self.report_stale_s:g}) must be more than "
                f"scaling.report_fresh_s ({self.report_fresh_s:g}): a count is whole until it "
                "is fresh_s old and worth nothing from stale_s on. Raise report_stale_s."
            )
        return self

    def autoscaling_config(self) -> dict[str, Any]:
        """Serve's autoscaling of an elastic rank: 0 or 1 replica, Serve's default policy.
        A call waiting at a handle starts a replica at once (its router tells the
        controller as soon as a call queues for a deployment with none); a rank with no
        call for its look-back window and ``park_after_s`` is released, after its calls
        finish. The ingress sends an unwanted rank no call at all, so that is when it
        parks (deployments/ranks/scaler.py)."""
        return {
            "min_replicas": 0,
            "initial_replicas": 0,
            "max_replicas": 1,
            "target_ongoing_requests": 1,
            "upscale_delay_s": 0,
            "downscale_delay_s": self.park_after_s,
            "downscale_to_zero_delay_s": self.park_after_s,
            "metrics_interval_s": METRICS_INTERVAL_S,
            "look_back_period_s": LOOK_BACK_S,
        }
