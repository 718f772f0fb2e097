"""``dispatch``: owner assignment and failover at the ingress."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class DispatchArgs(Section):
    """How the ingress sends images to ranks: owner assignment (``Dispatcher``) and what
    it does about a slow or failed rank (``FanOut``, ``RankHealth``)."""

    cost_model: Literal["fitted", "patches"] = Field(
        "fitted",
        description="Cost of an image in owner assignment: 'fitted' (a*p^2 + b*p + c, timed by "
        "each rank at start-up over ranks.calibration_grids) or 'patches' (its patch count, "
        "the reference rule).",
    )
    affinity_tolerance: float = Field(
        0.25,
        ge=0,
        description="A repeated image goes to the rank caching it while that rank's load is at "
        "most (1 + tolerance) x the finish of encoding it on the least-loaded rank.",
    )
    load_report_interval_ms: float = Field(
        50.0,
        ge=0,
        description="Longest age of the ranks' load reports (other ingress replicas' work and "
        "the cost model) used in owner assignment; a request polls when they are older (in "
        "the background once a rank has reported). 0: every request waits for fresh reports "
        "(exact loads across ingress replicas, one poll's latency per request).",
    )
    route_timeout_s: float = Field(
        0.3,
        gt=0,
        description="How long an encode call may wait for Serve to route it to a replica of "
        "its rank, when the rank has shown no progress for slow_after_s, before the rank "
        "counts as slow (dead, restarting or starved) and the call's images go to the other "
        "ranks too, while it goes on routing; also the longest a load poll waits to be routed.",
    )
    slow_after_s: float = Field(
        1.0,
        gt=0,
        description="A rank call with no answer after max(this, slow_factor x the time the "
        "fitted cost model expects), counted from the rank's last progress (an answer, or a "
        "load report of more calls answered), makes the rank slow: no new work, and the "
        "call's images are sent to the other ranks too (first answer wins). A rank that keeps "
        "answering is busy, not slow.",
    )
    slow_factor: float = Field(
        3.0, ge=1, description="Slack over the expected time before a call counts as late."
    )
    cooldown_s: float = Field(
        2.0,
        gt=0,
        description="After an unavailable error (rank died, being replaced, queue full) the "
        "ingress sends a rank no work for this long, then tries it again.",
    )
    probe_timeout_s: float = Field(
        5.0,
        gt=0,
        description="A down rank's probe (its load report, every cooldown_s) waits this long "
        "for an answer before the rank stays down another cooldown_s; a replacement loading a "
        "real checkpoint may need longer to answer its first call.",
    )
    report_answer_s: float = Field(
        0.2,
        gt=0,
        description="A load poll that a replica has taken must answer within this (after "
        "up to route_timeout_s of routing), or its rank counts as silent for that poll.",
    )
    report_outdated_s: float = Field(
        1.0,
        gt=0,
        description="A rank's load report older than this is no view of it at all: a request "
        "then waits (at most route_timeout_s + report_answer_s) for a fresh one before it "
        "assigns its images; younger ones are used as they are while a poll runs behind.",
    )
