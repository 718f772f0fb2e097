"""The roster without Ray: which ranks take work, their health, progress and lateness,
on a clock the tests move by hand, over fake rank clients (tests/fakes.py); and elastic
ranks (deployments/ranks/scaler.py): when the ingress wants more or fewer, how a rank starts,
drains and parks, and what Serve's view of the replicas changes."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from fakes import Clock, FakeCall, FakeRank, busy, make_roster

from deployments.args import ScalingArgs
from deployments.ranks import report
from deployments.ranks.calls import RankUnavailableError
from deployments.ranks.clock import LoopClock
from deployments.ranks.records import LoadReport, Progress
from deployments.ranks.rule import Scaler
from deployments.ranks.scaler import Elastic, Replicas
from kimi_encoder.cost import CostModel
from kimi_encoder.load import Work


def test_loop_clock_stands_still_while_the_loop_lags():
    """Wall time is the test's: the loop "stalls" 3 s (no tick runs), and the clock holds
    at the tick that was due, across the late tick, then runs on from there."""
    wall = [100.0]
    clock = LoopClock(tick_s=0.01, wall=lambda: wall[0])
    assert clock() == 100.0  # no running loop: plain wall time

    async def scenario() -> list[float]:
        seen = [clock()]  # starts the ticker
        await asyncio.sleep(0)  # its first step: the next tick is due at 100.01
        wall[0] = 100.005
        seen.append(clock())  # not due yet: runs with the wall
        wall[0] = 103.0  # three seconds in which the loop ran nothing
        seen.append(clock())  # stands at the due tick
        await asyncio.wait_for(_until(lambda: clock.lag > 0), 10)  # the late tick runs
        seen.append(clock())  # the lag is counted now: still the same
        wall[0] = 103.004
        seen.append(clock())  # and it runs on
        return seen

    seen = asyncio.run(scenario())
    assert seen == pytest.approx([100.0, 100.005, 100.01, 100.01, 100.014])
    assert clock.lag == pytest.approx(2.99)


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def test_a_rank_that_answers_its_probe_takes_work_again():
    async def scenario():
        ranks = [FakeRank(0), FakeRank(1)]
        roster = make_roster(ranks, cooldown_s=1e-3)
        roster.mark_down(RankUnavailableError(1, ConnectionError("replaced")), roster.clock())
        assert roster.down() == {1}
        await roster._tasks["probe", 1]  # the background probe: cool-down, then rank 1's load()
        return roster

    roster = asyncio.run(scenario())
    assert roster.down() == set()
    assert roster.recoveries == [0, 1]


def test_health_is_ordered_by_time_and_replica():
    async def scenario():
        roster = make_roster([FakeRank(0)])
        t0 = time.monotonic()
        roster.mark_down(RankUnavailableError(0, "died", replica="A"), t0)
        roster.mark_up(0, "A", started=t0 - 1)  # began before the failure, same replica
        stale = roster.down()
        roster.mark_up(0, "B", started=t0 - 1)  # its replacement answered
        replaced = roster.down()
        roster.mark_down(RankUnavailableError(0, "late error", replica="A"), t0 - 2)
        return stale, replaced, roster.down(), roster.ignored

    stale, replaced, after_old_error, ignored = asyncio.run(scenario())
    assert stale == {0}
    assert replaced == set()
    assert after_old_error == set()
    assert ignored == 1


def test_lateness_does_not_soften_a_failure():
    """A rank marked down for failing stays failed when a later call of it is merely late
    (with every rank failed, requests are refused at once instead of waiting on it)."""

    async def scenario():
        roster = make_roster([FakeRank(0)])
        roster.mark_down(RankUnavailableError(0, ConnectionError("actor died")), roster.clock())
        roster.mark_down(
            RankUnavailableError(0, "no replica took the call", slow=True), roster.clock()
        )
        return roster

    roster = asyncio.run(scenario())
    assert roster.failed() == {0}
    assert roster.excluded() == {0}
    assert "actor died" in report.failover(roster)["down"][0]


class Registry(FakeRank):
    """A rank client whose replicas ``gone`` no longer exist (Ray's named-actor registry)."""

    def __init__(self, rank: int, gone: set[str]):
        super().__init__(rank)
        self.gone = gone

    async def replica_alive(self, replica) -> bool:
        return replica not in self.gone


@pytest.mark.parametrize(("gone", "failed"), [(set(), set()), ({"r0"}, {0})], ids=["alive", "gone"])
def test_a_slow_rank_whose_replica_is_gone_has_failed(gone, failed):
    """Late routing looks the same for a starved machine and a dead rank; the rank's last
    replica, looked up, tells them apart: gone makes the rank failed (its unrouted calls
    are dropped, see the 503 test above), alive leaves it slow (it still gets work when
    no rank is up)."""

    async def scenario():
        roster = make_roster([Registry(0, gone)])
        roster.mark_up(0, "r0", time.monotonic())
        roster.mark_down(
            RankUnavailableError(0, "no replica took the call", slow=True), roster.clock()
        )
        await asyncio.wait_for(roster._tasks["look-up", 0], 5)
        return roster

    roster = asyncio.run(scenario())
    assert roster.down() == {0}
    assert roster.failed() == failed
    if failed:
        assert "its replica r0 is gone" in report.failover(roster)["down"][0]


def test_a_missed_report_of_a_rank_that_answers_is_not_silence():
    async def scenario():
        clock = Clock()
        ranks = [FakeRank(0), FakeRank(1)]
        roster = make_roster(ranks, clock=clock)
        roster.observe(1, busy(1))
        roster.missed_report(1, TimeoutError())  # its poll waited in the queue of a busy rank
        busy_rank = roster.down()
        clock.now += roster.slow_after_s
        roster.missed_report(1, TimeoutError())  # and now it has been quiet for slow_after_s
        return busy_rank, roster.down()

    busy_rank, quiet = asyncio.run(scenario())
    assert busy_rank == set()
    assert quiet == {1}


def test_progress_is_an_answered_count_that_moves_or_an_idle_rank():
    roster = make_roster([FakeRank(0)], clock=(clock := Clock()))
    assert roster.quiet_from(0, 5.0) == 5.0  # never heard from
    roster.observe(0, busy(3))
    assert roster.quiet_from(0, 5.0) == 1000.0  # a first report is progress
    clock.now = 1010.0
    roster.observe(0, busy(3))  # the same count, work outstanding: no progress
    assert roster.quiet_from(0, 5.0) == 1000.0
    roster.observe(0, busy(0, instance="y"))
    assert roster.quiet_from(0, 5.0) == 1010.0  # another process (a replacement)
    clock.now = 1020.0
    roster.observe(0, LoadReport({}, CostModel.patches(), Progress("y", 0)))
    assert roster.quiet_from(0, 5.0) == 1020.0  # idle: nothing to make progress on
    clock.now = 1030.0
    roster.heard(0)  # an encode answer
    assert roster.quiet_from(0, 5.0) == 1030.0


# --- elastic ranks: the scaler's decisions, on a hand-moved clock ---------------------

SCALING = ScalingArgs(
    target_queue_s=0.1, upscale_after_s=2.0, downscale_after_s=10.0, start_timeout_s=0.05
)


def decisions(scaler: Scaler, queued: list[float], wanted: int, every_s: float = 0.25):
    """Feed ``queued`` samples ``every_s`` apart and apply each decision: the wanted count
    after every sample."""
    seen, now = [], 0.0
    for q in queued:
        scaler.observe(now, q)
        wanted, _ = scaler.decide(now, wanted, starting=False)
        seen.append(wanted)
        now += every_s
    return seen


@pytest.mark.parametrize(
    ("queued", "wanted", "after"),
    [
        ([0.5] * 7, 1, 1),  # above target, but for less than upscale_after_s: not yet
        ([0.25] * 10, 1, 3),  # 0.25 s over 1 rank for 2 s: as many as it needs at 0.1 each
        ([5.0] * 10, 1, 4),  # far more than 4 ranks' worth: at most dp_max
        ([0.15] * 10, 2, 2),  # 0.075 per rank: under the target
        ([0.15] * 50, 2, 2),  # for long: above half the target on one rank fewer: kept
        ([0.04] * 45, 2, 1),  # 10 s of work that fits one rank at half the target: one fewer
        ([0.0] * 45, 1, 1),  # never below dp_min
        ([0.0] * 85, 4, 2),  # one rank fewer per downscale_after_s, no more
    ],
    ids=["too-soon", "up-as-needed", "capped", "under", "steady", "down", "min", "stepwise"],
)
def test_the_scaler_follows_the_queued_work_with_hysteresis(queued, wanted, after):
    assert decisions(Scaler(1, 4, SCALING), queued, wanted)[-1] == after


def test_the_scaler_adds_nothing_while_a_rank_starts_and_then_waits_a_full_window():
    scaler = Scaler(1, 4, SCALING)
    for step in range(12):
        scaler.observe(step * 0.25, 1.0)
    assert scaler.decide(3.0, 2, starting=True) == (2, "")
    scaler.observe(3.25, 1.0)
    assert scaler.decide(3.25, 2, starting=False) == (2, "")  # its window starts again
    for step in range(14, 23):
        scaler.observe(step * 0.25, 1.0)
    wanted, why = scaler.decide(5.5, 2, starting=False)
    assert wanted == 4
    assert why.startswith("1.000 s of work queued on 2 rank(s) for 2 s, above 0.1 s per rank")


def test_steady_load_near_the_target_does_not_flap():
    """A queue that swings around the target, for minutes: one decision up, none back."""
    queued = [0.3 if i % 4 else 0.05 for i in range(1200)]  # mean 0.24 s, 5 minutes
    seen = decisions(Scaler(1, 4, SCALING), queued, 1)
    changes = [b for a, b in itertools.pairwise(seen) if a != b]
    assert changes == [3]


# --- elastic ranks: how the roster's ranks start, drain and park ----------------------


class Starting(FakeRank):
    """A rank whose start (its wake call) waits for ``started``; its calls are counted."""

    def __init__(self, rank: int):
        super().__init__(rank)
        self.started = asyncio.Event()
        self.wakes = self.loads = 0

    def wake(self) -> FakeCall:
        self.wakes += 1

        async def report():
            await self.started.wait()
            return LoadReport({}, CostModel.patches(), Progress(f"rank-{self.rank}", 0))

        return FakeCall(report())

    def load(self) -> FakeCall:
        self.loads += 1
        return super().load()


class Directory:
    """Serve's view of the replicas, as a test sets it."""

    def __init__(self):
        self.seen: dict[int, Replicas] = {}

    async def replicas(self) -> dict[int, Replicas]:
        return dict(self.seen)


def elastic(count: int = 3, lo: int = 1, **scaling):
    clock = Clock()
    ranks = [Starting(r) for r in range(count)]
    roster = make_roster(ranks, clock=clock, fixed=lo)
    config = SCALING.model_copy(update=scaling)
    seconds = CostModel(0.0, 1e-3, 0.0)  # a patch costs a millisecond
    driver = Elastic(roster, lo, config, lambda: seconds, Directory())
    return driver, roster, ranks, clock


def run_for(driver: Elastic, clock: Clock, seconds: float) -> None:
    """Scaling steps every ``scaling.tick_s`` of the test's clock for ``seconds``."""
    tick = driver.config.tick_s
    for _ in range(round(seconds / tick)):
        clock.now += tick
        driver.step()


async def started(roster, ranks: list[Starting], rank: int) -> None:
    """``rank`` wanted, woken and answering: live and held."""
    roster.want(rank, "test")
    roster.wake(rank, 5.0, lambda rank: None)
    ranks[rank].started.set()
    await roster._tasks["wake", rank]


def test_elastic_ranks_start_parked_and_only_the_fixed_ones_take_work():
    driver, roster, _, _ = elastic()
    assert [roster.state(r) for r in range(3)] == ["live", "parked", "parked"]
    assert roster.takes_work() == {0}
    assert roster.excluded() == {1, 2}
    assert driver.info()["wanted"] == [0]


def test_queued_work_starts_parked_ranks_which_take_work_once_they_answer():
    async def scenario():
        driver, roster, ranks, clock = elastic()
        with roster.dispatched(0, Work.of([100] * 4)):  # 0.4 s of work on rank 0
            run_for(driver, clock, 2.25)
            starting = [roster.state(r) for r in range(3)]
            excluded = roster.excluded()
            for rank in ranks[1:]:
                rank.started.set()
            await asyncio.wait_for(_until(lambda: roster.takes_work() == {0, 1, 2}), 5)
        return driver, roster, ranks, starting, excluded

    driver, roster, ranks, starting, excluded = asyncio.run(scenario())
    assert starting == ["live", "starting", "starting"]
    assert excluded == {1, 2}  # no work for a starting rank
    assert [r.wakes for r in ranks] == [0, 1, 1]
    assert [d["scale"] for d in driver.decisions] == ["up", "up"]
    assert roster.rows[1].why.startswith("started in ")


def test_a_rank_that_cannot_start_leaves_the_live_ones_serving_with_the_reason():
    async def scenario():
        driver, roster, ranks, clock = elastic(count=2)
        with roster.dispatched(0, Work.of([100] * 4)):
            run_for(driver, clock, 2.25)
            driver.sync({1: Replicas(0, "1 replica has taken more than 30s to be scheduled")})
            await roster._tasks["wake", 1]  # start_timeout_s: 0.05 s
        return roster, ranks

    roster, ranks = asyncio.run(scenario())
    assert roster.state(1) == "parked"
    assert roster.takes_work() == {0}
    reason = roster.rows[1].why
    assert reason.startswith("could not start: no replica answered within start_timeout_s=")
    assert "Serve: 1 replica has taken more than 30s to be scheduled" in reason
    assert ranks[1].wakes == 1


class Failing(Starting):
    """A rank whose start fails (its constructor raises, say)."""

    def wake(self) -> FakeCall:
        self.wakes += 1

        async def fail():
            raise RankUnavailableError(self.rank, RuntimeError("the constructor raised"))

        return FakeCall(fail())


def test_a_failed_start_is_tried_again_only_after_start_timeout_s():
    async def scenario():
        clock = Clock()
        ranks = [Starting(0), Failing(1)]
        roster = make_roster(ranks, clock=clock, fixed=1)
        config = SCALING.model_copy(update={"start_timeout_s": 30.0})
        driver = Elastic(roster, 1, config, lambda: CostModel(0.0, 1e-3, 0.0), Directory())
        seen = []
        with roster.dispatched(0, Work.of([100] * 4)):
            run_for(driver, clock, 2.25)
            await roster._tasks["wake", 1]
            seen.append((roster.state(1), ranks[1].wakes))
            run_for(driver, clock, 20.0)  # still queued, but within start_timeout_s
            seen.append((roster.state(1), ranks[1].wakes))
            run_for(driver, clock, 12.0)
            await roster._tasks["wake", 1]
            seen.append((roster.state(1), ranks[1].wakes))
        return roster, seen

    roster, seen = asyncio.run(scenario())
    assert seen == [("parked", 1), ("parked", 1), ("parked", 2)]
    assert "its start failed" in roster.rows[1].why
    assert "the constructor raised" in roster.rows[1].why


def test_a_rank_not_wanted_drains_gets_no_call_and_parks_when_serve_releases_it():
    async def scenario():
        driver, roster, ranks, clock = elastic(count=2)
        await started(roster, ranks, 1)
        generation = roster.generation(1)
        loads = ranks[1].loads
        with roster.dispatched(1, Work.of([10])):  # a call in flight when it is let go
            run_for(driver, clock, 10.25)  # nothing queued for downscale_after_s
            draining = (roster.state(1), roster.excluded())
            await roster.refresh()  # polls only the ranks taking work
        driver.sync({1: Replicas(1)})  # its replica still runs: stays draining
        still = roster.state(1)
        driver.sync({1: Replicas(0)})
        return driver, roster, ranks, draining, still, loads, generation

    driver, roster, ranks, draining, still, loads, generation = asyncio.run(scenario())
    assert draining == ("draining", {1})
    assert still == "draining"
    assert ranks[1].loads == loads  # no poll, no call: Serve can release it
    assert roster.state(1) == "parked"
    assert roster.generation(1) == generation + 1  # what its cache held is forgotten
    assert [d["scale"] for d in driver.decisions] == ["down"]


def test_a_draining_rank_takes_work_again_at_once_when_the_load_comes_back():
    async def scenario():
        driver, roster, ranks, clock = elastic(count=2)
        await started(roster, ranks, 1)
        run_for(driver, clock, 10.25)
        draining = roster.state(1)
        with roster.dispatched(0, Work.of([100] * 4)):
            run_for(driver, clock, 2.25)
        return roster, ranks, draining

    roster, ranks, draining = asyncio.run(scenario())
    assert draining == "draining"
    assert roster.state(1) == "live"
    assert ranks[1].wakes == 1  # taken back without a new start


def test_a_wanted_elastic_rank_is_held_by_one_open_call_until_it_is_not_wanted():
    async def scenario():
        _, roster, ranks, _ = elastic(count=2)
        await started(roster, ranks, 1)
        await asyncio.sleep(0)
        held = (ranks[1].holds, ranks[1].released)
        roster.unwant(1, "test")
        await asyncio.sleep(0)
        return ranks, held

    ranks, held = asyncio.run(scenario())
    assert held == (1, 0)  # one call open while wanted
    assert (ranks[1].holds, ranks[1].released) == (1, 1)  # taken back: no call is left
    assert ranks[0].holds == 0  # a fixed rank runs whatever its calls


def test_a_rank_another_ingress_replica_started_is_live_but_gets_no_work_until_wanted():
    driver, roster, _, _ = elastic()
    driver.sync({1: Replicas(1), 2: Replicas(0)})
    assert [roster.state(r) for r in range(3)] == ["live", "draining", "parked"]
    assert roster.takes_work() == {0}


def test_draining_ranks_take_work_when_no_wanted_rank_is_up():
    driver, roster, _, _ = elastic(count=2)
    driver.sync({1: Replicas(1)})  # live, not wanted
    asyncio.run(_mark_down(roster, 0))
    assert roster.excluded() == {0}  # rank 0 down: the draining rank serves
    assert roster.up() == {1}


async def _mark_down(roster, rank: int) -> None:
    roster.mark_down(RankUnavailableError(rank, ConnectionError("died")), roster.clock())


def test_cache_hits_queue_no_work_and_wake_no_rank():
    """Repeats the ranks' caches hold are dispatched with no work (``Plan.work`` counts
    misses only): however many, the queue stays empty and no rank is started."""
    driver, roster, ranks, clock = elastic()
    with roster.dispatched(0, Work()):
        run_for(driver, clock, 30.0)
    assert roster.takes_work() == {0}
    assert [r.wakes for r in ranks] == [0, 0, 0]
    assert not driver.decisions


def test_a_rank_wanted_again_right_after_it_was_let_go_is_held_again():
    async def scenario():
        _, roster, ranks, _ = elastic(count=2)
        await started(roster, ranks, 1)
        await asyncio.sleep(0)
        roster.unwant(1, "test")
        roster.want(1, "test")  # before the cancelled hold has ended
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return ranks[1].holds, ranks[1].released

    assert asyncio.run(scenario()) == (2, 1)  # a new call open, the old one taken back
