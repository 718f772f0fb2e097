"""The ranks wing's pure rules (deployments/ranks/lifecycle.py, health.py, loads.py) as
tables over rows, no event loop; and its gate: a rank that may not be called gets no
call, whoever asks."""

from __future__ import annotations

import asyncio
import math

import pytest
from fakes import FakeCall, FakeRank, make_roster

from deployments.ranks import health, lifecycle, loads, tasks
from deployments.ranks.calls import RankUnavailableError
from deployments.ranks.lifecycle import ENCODE, HEALTH, HOLD, INFO, POLL, PROBE, PUSH, WAKE
from deployments.ranks.records import LoadReport, Progress
from deployments.ranks.roster import CallRefused
from deployments.ranks.row import DRAINING, LIVE, PARKED, STARTING, Row
from kimi_encoder.cost import CostModel
from kimi_encoder.load import Work

RULES = health.Lateness(cooldown_s=2.0, route_timeout_s=0.3, slow_after_s=1.0, slow_factor=3.0)

LIVE_ROW = Row(fixed=False)
FIXED = Row()
DRAINING_ROW = Row(wanted=False, fixed=False)
STARTING_ROW = Row(phase=STARTING, fixed=False)
PARKED_ROW = Row(phase=PARKED, wanted=False, fixed=False)
DOWN_ROW = Row(fixed=False, down_until=5.0)
FAILED = Row(down_until=1.0)
SLOW = Row(down_until=1.0, slow=True)


# ----------------------------------------------------------------------------- lifecycle


@pytest.mark.parametrize(
    ("row", "state"),
    [(FIXED, LIVE), (LIVE_ROW, LIVE), (DRAINING_ROW, DRAINING), (STARTING_ROW, STARTING),
     (PARKED_ROW, PARKED), (DOWN_ROW, "down")],
    ids=["fixed", "live", "draining", "starting", "parked", "down"],
)  # fmt: skip
def test_state(row, state):
    assert row.state == state


# (rows, ranks taking work, excluded, up)
SETS = {
    "all live": ([FIXED, LIVE_ROW], {0, 1}, set(), {0, 1}),
    "one draining": ([FIXED, DRAINING_ROW], {0}, {1}, {0}),
    "starting and parked": ([FIXED, STARTING_ROW, PARKED_ROW], {0}, {1, 2}, {0}),
    "wanted one down: the draining one serves": ([FAILED, DRAINING_ROW], set(), {0}, {1}),
    "every live one down: the slow ones work": ([SLOW], set(), set(), set()),
    "every live one failed": ([FAILED], set(), {0}, set()),
}  # fmt: skip


@pytest.mark.parametrize(("rows", "takes", "excluded", "up"), SETS.values(), ids=SETS)
def test_who_takes_work(rows, takes, excluded, up):
    assert lifecycle.takes_work(rows) == takes
    assert lifecycle.excluded(rows) == excluded
    assert lifecycle.up(rows) == up


# (the rank's row, the purpose, the caller holds elastic ranks, allowed)
GATE = [
    (FIXED, ENCODE, False, True),
    (FIXED, INFO, False, True),
    (FIXED, HOLD, True, False),  # a fixed rank needs no hold
    (LIVE_ROW, ENCODE, False, True),
    (LIVE_ROW, POLL, False, True),
    (LIVE_ROW, HOLD, False, False),  # only the scaler holds
    (LIVE_ROW, HOLD, True, True),
    (LIVE_ROW, WAKE, True, False),
    (DOWN_ROW, PROBE, False, True),
    (DRAINING_ROW, ENCODE, False, False),
    (DRAINING_ROW, POLL, False, False),
    (DRAINING_ROW, INFO, False, False),
    (DRAINING_ROW, PUSH, False, False),
    (DRAINING_ROW, HEALTH, False, False),
    (DRAINING_ROW, HOLD, True, False),
    (STARTING_ROW, WAKE, True, True),
    (STARTING_ROW, WAKE, False, False),  # a follower never wakes
    (STARTING_ROW, ENCODE, False, False),
    (STARTING_ROW, INFO, False, False),
    (PARKED_ROW, WAKE, True, False),
    (PARKED_ROW, INFO, False, False),
    (PARKED_ROW, POLL, True, False),
]


@pytest.mark.parametrize(("row", "purpose", "holder", "allowed"), GATE)
def test_the_gate(row, purpose, holder, allowed):
    """Rank 1 of a live fixed rank 0 and ``row``: may it be called for ``purpose``?"""
    why = lifecycle.may_call([FIXED, row], 1, purpose, holder)
    assert (why is None) == allowed, why
    if why is not None:
        assert why.startswith("rank 1 is ")


def test_a_draining_rank_is_called_while_no_wanted_rank_is_up():
    rows = [Row(down_until=1.0), DRAINING_ROW]
    assert lifecycle.may_call(rows, 1, ENCODE, False) is None


def test_leaving_live_is_a_new_generation_and_released_forgets():
    row = Row(fixed=False, report=_report(3), progress=("p", 3), replica="A", down_until=9.0)
    lifecycle.set_phase(row, LIVE, False, "not wanted")
    assert (row.generation, row.state) == (0, "down")
    lifecycle.released(row, "parked")
    assert (row.generation, row.phase, row.why) == (1, PARKED, "parked")
    assert (row.report, row.progress, row.replica, row.down_until) == (None, None, None, None)
    assert row.heard == -math.inf


# ----------------------------------------------------------------------------- health


def test_late_at_counts_from_the_later_of_sending_and_progress():
    row = Row(heard=10.0)
    assert health.late_at(RULES, row, 9.0, routed=True, after_s=2.0) == 12.0
    assert health.late_at(RULES, row, 11.0, routed=True, after_s=2.0) == 13.0
    # Unrouted: the route timeout, unless the rank showed progress within slow_after_s.
    assert health.late_at(RULES, Row(), 9.0, routed=False, after_s=2.0) == 9.3
    assert health.late_at(RULES, row, 9.0, routed=False, after_s=2.0) == 11.0


@pytest.mark.parametrize(
    ("expected_s", "after_s"), [(None, 1.0), (0.1, 1.0), (2.0, 6.0)], ids=["none", "small", "large"]
)
def test_late_after_s(expected_s, after_s):
    assert health.late_after_s(RULES, expected_s) == after_s


def test_down_and_up_in_the_order_things_happened():
    row = Row()
    died = RankUnavailableError(0, "died", replica="A")
    assert health.mark_down(RULES, row, died, started=10.0, now=11.0) == health.DOWN_NOW
    assert (row.down_until, row.down_at, row.failed) == (13.0, 11.0, "A")
    assert not health.mark_up(row, "A", started=10.5)  # sent before the failure, same replica
    assert health.mark_up(row, "B", started=10.5)  # its replacement answered
    assert (row.is_down, row.replica) == (False, "B")
    old = RankUnavailableError(0, "late error", replica="A")
    assert health.mark_down(RULES, row, old, started=10.0, now=12.0) == health.IGNORED


def test_being_late_says_less_than_failing():
    row = Row()
    health.mark_down(RULES, row, RankUnavailableError(0, "died"), 1.0, 1.0)
    late = RankUnavailableError(0, "late", slow=True)
    assert health.mark_down(RULES, row, late, 2.0, 2.0) == health.STILL_DOWN
    assert "died" in row.reason
    assert not row.slow
    assert row.down_until == 4.0  # the cool-down starts again


def test_missed_reports_make_a_rank_slow_only_after_slow_after_s_without_progress():
    row, miss = Row(), TimeoutError("no report")
    assert health.missed_report(RULES, 0, row, miss, now=10.0) is None  # the first miss
    assert health.missed_report(RULES, 0, row, miss, now=10.5) is None
    error, since = health.missed_report(RULES, 0, row, miss, now=11.0)
    assert (error.slow, since) == (True, 10.0)
    assert "no load report for 1.00 s" in str(error)
    dead = RankUnavailableError(0, "died")
    assert health.missed_report(RULES, 0, Row(), dead, now=3.0) == (dead, 3.0)  # at once
    assert health.missed_report(RULES, 0, Row(calls=1), miss, now=3.0) is None  # calls judge


# ----------------------------------------------------------------------------- loads


def _report(answered: int, work: dict | None = None) -> LoadReport:
    by_caller = {"b": Work.of([10])} if work is None else work
    return LoadReport(by_caller, CostModel.patches(), Progress("p", answered))


def test_progress_is_a_report_with_more_answers_or_no_work():
    row = Row()
    assert loads.observe(row, _report(1), now=1.0, at=1.0)
    assert not loads.observe(row, _report(1), now=2.0, at=2.0)  # the same count, work held
    assert row.heard == 1.0
    assert loads.observe(row, _report(1, work={}), now=3.0, at=3.0)  # idle: nothing to do
    assert loads.observe(row, _report(2), now=4.0, at=4.0)
    assert (row.heard, row.reported_at) == (4.0, 4.0)


def test_loads_add_the_other_callers_reports_to_ones_own_work():
    rows = [Row(own=Work.of([8]), report=_report(0, {"me": Work.of([8]), "b": Work.of([4])}))]
    rows.append(Row())
    assert loads.loads(rows, "me", CostModel.patches()) == [12.0, 0.0]
    assert loads.stale(rows, {0, 1}, at=5.0, interval_s=1.0) == [0, 1]


# ----------------------------------------------------------------------------- the gate


class Counting(FakeRank):
    def __init__(self, rank: int):
        super().__init__(rank)
        self.asked: list[str] = []

    def load(self) -> FakeCall:
        self.asked.append("load")
        return super().load()

    def info(self) -> FakeCall:
        self.asked.append("info")

        async def answer():
            return {"pid": 1}

        return FakeCall(answer())


def test_a_new_caller_asking_for_a_parked_rank_is_refused():
    """Whatever a new piece of code asks of a parked elastic rank (its info for a metrics
    scrape, a load poll, work), the roster refuses before any call leaves, naming why;
    the rank is asked nothing."""
    ranks = [Counting(0), Counting(1)]
    roster = make_roster(ranks, fixed=1)

    async def scenario():
        for purpose in (INFO, POLL, ENCODE, HEALTH):
            with pytest.raises(CallRefused, match="rank 1 is parked: it gets no call"):
                roster.call(1, purpose)
        await roster.refresh()  # polls only the ranks it may call
        return await roster.ask(0, INFO, 5.0)

    assert asyncio.run(scenario()) == {"pid": 1}
    assert ranks[1].asked == []
    assert ranks[0].asked == ["load", "info"]


class Failing(Counting):
    def load(self) -> FakeCall:
        self.asked.append("load")

        async def fail():
            raise RankUnavailableError(self.rank, ConnectionError("died"))

        return FakeCall(fail())


def test_the_health_poll_moves_the_rosters_state():
    """The hand-off's health poll goes through the roster: a rank that fails it is down
    (no work until it answers), and the poll still finds the rank that answers."""
    ranks = [Failing(0), Counting(1)]
    roster = make_roster(ranks)
    answered = asyncio.run(tasks.any_answers(roster, 5.0))
    assert answered
    assert roster.down() == {0}
    assert roster.takes_work() == {1}
