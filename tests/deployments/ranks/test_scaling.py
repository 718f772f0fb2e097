"""One decision of the elastic ranks (deployments/ranks/scaler.py, decision.py),
without Ray: the scaler's view of the queued work (ranks' reports and ingress replicas'
views, weighed by their age on a clock the test moves by hand), what a successor scaler
wants, how a decision is asked for, and an ingress replica's roster following it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fakes import Clock, FakeRank, make_roster

from deployments.args import DispatchArgs, ScalingArgs
from deployments.ranks.decision import IngressView, Seen, queued_seconds, weight
from deployments.ranks.follower import Follower
from deployments.ranks.records import LoadReport, Progress
from deployments.ranks.roster import Roster
from deployments.ranks.scaler import Elastic, NotReady, Replicas
from kimi_encoder.cost import CostModel
from kimi_encoder.load import Work

MS = CostModel(0.0, 1e-3, 0.0)  # a patch costs a millisecond
SCALING = ScalingArgs(target_queue_s=0.1, upscale_after_s=2.0, downscale_after_s=10.0)
TICK_S, REPORT_FRESH_S, REPORT_STALE_S = (
    SCALING.tick_s,
    SCALING.report_fresh_s,
    SCALING.report_stale_s,
)


def report(by_caller: dict[str, Work]) -> LoadReport:
    return LoadReport(by_caller, MS, Progress("rank", 0))


def scaler(count: int = 3, lo: int = 1, ranks=None):
    """An app scaler's loop over fake ranks (``ranks``, or new ones), both clocks the
    test's."""
    clock = Clock()
    ranks = ranks or [FakeRank(r) for r in range(count)]
    settings = DispatchArgs(load_report_interval_ms=0)
    roster = Roster(ranks, settings, clock=clock, fixed=lo, monotonic=clock)
    return Elastic(roster, lo, SCALING, lambda: MS, by="scaler-1"), roster, clock


# ----------------------------------------------------------------------------- ageing


@pytest.mark.parametrize(
    ("age", "want"),
    [(0.0, 1.0), (REPORT_FRESH_S, 1.0), ((REPORT_FRESH_S + REPORT_STALE_S) / 2, 0.5),
     (REPORT_STALE_S, 0.0), (240.0, 0.0)],
)  # fmt: skip
def test_weight_falls_from_whole_to_nothing(age, want):
    assert weight(age, REPORT_FRESH_S, REPORT_STALE_S) == pytest.approx(want)


def test_a_report_counts_less_as_it_ages_and_not_at_all_when_stale():
    """A report that 400 patches (0.4 s) are queued on rank 0, then no other report: the
    queue the scaler sees falls with the report's age, to nothing."""
    elastic, roster, clock = scaler()
    roster.observe(0, report({"ingress-a": Work.of([100] * 4)}))
    seen = []
    for age in (0.0, REPORT_FRESH_S, (REPORT_FRESH_S + REPORT_STALE_S) / 2, REPORT_STALE_S, 240):
        clock.now = 1000.0 + age
        seen.append(elastic.queued(MS)[0])
    assert seen == pytest.approx([0.4, 0.4, 0.2, 0.0, 0.0])


def test_two_views_that_disagree():
    """Rank 0 reports 200 patches of ingress a's and 100 of ingress b's. Ingress a says it
    has 300 on its way there (calls the rank has not queued yet: the larger counts); ingress
    b says it has none (answered since the report: the report's 100 still counts while
    fresh); ingress c, which died, said 500 long ago (stale: nothing)."""
    elastic, roster, clock = scaler()
    elastic.view(IngressView("ingress-c", [Work.of([500]), Work(), Work()]))
    clock.now += REPORT_STALE_S + 1
    roster.observe(0, report({"ingress-a": Work.of([200]), "ingress-b": Work.of([100])}))
    elastic.view(IngressView("ingress-a", [Work.of([300]), Work(), Work()]))
    elastic.view(IngressView("ingress-b", [Work(), Work(), Work()]))
    assert elastic.queued(MS) == {0: pytest.approx(0.4)}
    clock.now += REPORT_STALE_S  # nobody refreshed anything: nothing is queued any more
    assert elastic.queued(MS) == {0: 0.0}


def test_queued_seconds_takes_the_larger_count_per_caller_and_adds_the_callers():
    m, w = CostModel.patches(), Work.of([10])
    reports = {0: {"a": Seen(w, 0.0), "b": Seen(w + w, 0.0)}, 1: {"a": Seen(w, 0.0)}}
    views = {0: {"a": Seen(w + w + w, 0.0)}, 1: {"c": Seen(w, 0.0)}}
    assert queued_seconds(reports, views, m, 0.0, 1.0, 2.0) == {0: 50.0, 1: 20.0}


def test_an_idle_ingress_replica_holds_no_rank():
    """Three ranks wanted; the last view of an ingress replica that then went quiet said it
    had work on them (the report its last request left behind). It ages out, and the
    scaler lets ranks go once the queue has been empty for downscale_after_s."""

    async def scenario():
        elastic, roster, clock = scaler()
        for rank in (1, 2):
            roster.adopt(rank, "test")
            roster.want(rank, "test")
        elastic.view(IngressView("ingress-idle", [Work.of([30])] * 3))
        for _ in range(round((REPORT_STALE_S + SCALING.downscale_after_s + 1) / TICK_S)):
            clock.now += TICK_S
            elastic.step()
        return elastic

    elastic = asyncio.run(scenario())
    assert elastic.queued(MS) == {0: 0.0, 1: 0.0}  # rank 2 drains: not counted
    assert [d["scale"] for d in elastic.decisions] == ["down"]
    assert elastic.phases() == ("live", "live", "draining")


# ----------------------------------------------------------------------------- the decision


def test_a_successor_scaler_wants_every_rank_that_runs():
    """A scaler replacing a dead one: ranks with a replica are wanted (held, given work), a
    parked one stays parked; nothing is let go before downscale_after_s."""

    ranks = [FakeRank(r) for r in range(3)]

    async def scenario():
        elastic, _, clock = scaler(ranks=ranks)
        elastic.begin({0: Replicas(1), 1: Replicas(1), 2: Replicas(0)})
        await asyncio.sleep(0)
        for _ in range(round(5.0 / TICK_S)):  # idle, but for less than downscale_after_s
            clock.now += TICK_S
            elastic.step()
        return elastic

    elastic = asyncio.run(scenario())
    assert elastic.phases() == ("live", "live", "parked")
    assert ranks[1].holds == 1  # the scaler keeps it
    assert not elastic.decisions
    assert elastic.decision().wanted == [0, 1]


def test_a_decision_is_answered_when_it_changes_or_at_once_for_another_scaler():
    async def scenario():
        elastic, roster, _ = scaler(count=2)
        first = elastic.publish()
        other = await elastic.next_decision("another-scaler", first.seq, 30.0)
        asked = asyncio.ensure_future(elastic.next_decision(first.instance, first.seq, 30.0))
        await asyncio.sleep(0.01)
        waiting = not asked.done()
        roster.adopt(1, "test")  # a change a follower must see
        roster.want(1, "test")
        elastic.publish()
        changed = await asyncio.wait_for(asked, 5)
        timed_out = await elastic.next_decision(changed.instance, changed.seq, 0.01)
        return first, other, waiting, changed, timed_out

    first, other, waiting, changed, timed_out = asyncio.run(scenario())
    assert other.seq == first.seq  # another scaler's follower: answered at once
    assert waiting
    assert (changed.seq, changed.phases) == (first.seq + 1, ("live", "live"))
    assert timed_out.seq == changed.seq  # no change: answered after its wait


class Scaler:
    """The app scaler as a follower calls it: answers the decisions it is given, in turn,
    and records the views it was sent."""

    def __init__(self, decisions):
        self.decisions = list(decisions)
        self.views: list[IngressView] = []
        self.asked = asyncio.Event()

    async def decision(self, instance, seen, view, wait_s):
        self.views.append(view)
        self.asked.set()
        if not self.decisions:
            await asyncio.Event().wait()  # no change any more
        return self.decisions.pop(0)


class Counting(FakeRank):
    """A fake rank that counts its load polls."""

    def __init__(self, rank: int):
        super().__init__(rank)
        self.loads = 0

    def load(self):
        self.loads += 1
        return super().load()


def test_an_ingress_replica_follows_the_decision_and_calls_no_unwanted_rank():
    """Its roster takes each rank's phase from the decision; it holds no rank itself (the
    scaler does), its view of its dispatched work travels with each ask, and a rank the
    decision lets go gets no call from it: no work, no load poll."""

    async def scenario():
        elastic, _, _ = scaler()
        base = elastic.decision()
        decisions = [
            dataclasses.replace(base, seq=1, phases=("live", "live", "starting")),
            dataclasses.replace(base, seq=2, phases=("live", "draining", "live")),
        ]
        ranks = [Counting(r) for r in range(3)]
        roster = make_roster(ranks, fixed=1)
        roster.holds = False
        scaler_ = Scaler(decisions)
        follower = Follower(roster, 1, scaler_)
        with roster.dispatched(0, Work.of([7])):
            follower.start()
            await asyncio.wait_for(_until(lambda: follower.last is decisions[-1]), 5)
        before = [r.loads for r in ranks]
        await roster.refresh()  # exact reports: polls every rank it may call
        return roster, ranks, scaler_.views[0], before

    roster, ranks, first_view, before = asyncio.run(scenario())
    assert [roster.state(r) for r in range(3)] == ["live", "draining", "live"]
    assert roster.takes_work() == {0, 2}
    assert first_view.own[0] == Work.of([7])
    assert [r.holds for r in ranks] == [0, 0, 0]
    assert [r.loads - b for r, b in zip(ranks, before, strict=True)] == [1, 0, 1]


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


class Directory:
    """Serve's view of the replicas, given once the test opens ``answer``."""

    def __init__(self, seen):
        self.seen = seen
        self.answer = asyncio.Event()

    async def replicas(self):
        await self.answer.wait()
        return dict(self.seen)


def test_a_new_scaler_gives_no_decision_before_it_has_read_serves_view():
    """Its roster starts with every elastic rank parked: handing that out would drop the
    ranks the followers give work to. It answers NotReady until it has read Serve's view,
    then wants every rank that runs."""

    async def scenario():
        roster = Roster([FakeRank(r) for r in range(2)], DispatchArgs(), fixed=1)
        directory = Directory({1: Replicas(1)})
        elastic = Elastic(roster, 1, SCALING, lambda: MS, directory)
        with pytest.raises(NotReady, match="has not read Serve's view of the ranks yet"):
            await elastic.next_decision("", -1, 0.05)
        directory.answer.set()
        decision = await elastic.next_decision("", -1, 5.0)
        elastic._task.cancel()
        return decision

    decision = asyncio.run(scenario())
    assert decision.phases == ("live", "live")
    assert decision.wanted == [0, 1]
