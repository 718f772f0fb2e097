"""``RankScaler``: the one process that decides how many elastic ranks the app wants.

Bound by ``build_app`` with ``dp_size: {min, max}`` only, one replica, no CPU reserved.
It runs ``scaling.Elastic`` over a roster of its own (it polls the wanted ranks' load
reports, holds them, wakes the ones it wants and lets go the others), and answers the
ingress replicas' ``decision`` asks: each waits until the decision changes, or about a
second, and carries the asking replica's view of its dispatched work. It publishes the
live-rank gauge, so the app has one series of it. Serve replaces it when it dies (its
health check is a look at its loop); the successor wants every rank that runs
(``Elastic.begin``), and the ingress replicas follow the last decision meanwhile.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from .args import DispatchArgs, ScalingArgs
from .dispatch import seconds_model
from .handles import RankHandle, ServeDirectory
from .heap import start_trimming
from .metrics import ScalerMetrics
from .ranks.clock import LoopClock
from .ranks.decision import Decision, IngressView
from .ranks.roster import Roster
from .ranks.row import LIVE
from .ranks.scaler import Elastic


class RankScaler:
    """The elastic ranks' decision (module doc)."""

    def __init__(
        self,
        ranks: list[DeploymentHandle],
        dispatch: DispatchArgs,
        scaling: ScalingArgs,
        dp_min: int,
    ):
        start_trimming()
        clients = [RankHandle(r, h, dispatch.route_timeout_s) for r, h in enumerate(ranks)]
        self.roster = Roster(
            clients, dispatch, clock=LoopClock(), fixed=dp_min, hold_s=scaling.hold_s
        )
        by = serve.get_replica_context().replica_id.unique_id
        models = self.roster.fitted_models
        self.elastic = Elastic(
            self.roster, dp_min, scaling, lambda: seconds_model(models()), ServeDirectory(ranks), by
        )
        self.metrics = ScalerMetrics()

    async def decision(
        self, instance: str, seen: int, view: IngressView, wait_s: float
    ) -> Decision:
        """The decision once it differs from the caller's last (``instance``, ``seen``), or
        after ``wait_s``; ``view`` is the caller's dispatched work."""
        self.elastic.view(view)
        decision = await self.elastic.next_decision(instance, seen, wait_s)
        self._publish(decision)
        return decision

    async def check_health(self) -> None:
        """Serve's periodic health check: the loop runs (started here if no ingress replica
        has asked yet), and the gauge is current."""
        self.elastic.start()
        self._publish(self.elastic.decision())

    async def info(self) -> dict[str, Any]:
        return {**self.elastic.info(), "roster": self.roster.info()}

    def _publish(self, decision: Decision) -> None:
        self.metrics.ranks_live(sum(phase == LIVE for phase in decision.phases))
