"""The fan-out without Ray: fake rank clients, real owner assignment, real gather.

Each fake rank answers with features derived from its items' bytes, so a wrong
order or a mixed-up duplicate shows as wrong data. Timing is controlled with
asyncio events: a rank that must fail "mid-call" fails after the fan-out has
sent to every rank, a hanging rank waits on an event that is never set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
from fakes import PRESET, VISION, Clock, FakeCall, FakeRank, busy, features_of, make_roster
from images import image_bytes

from deployments.args import DispatchArgs
from deployments.dispatch import Dispatcher
from deployments.fanout import FanOut, NoRankAvailableError, RequestTimeoutError
from deployments.ranks import report
from deployments.ranks.calls import RankUnavailableError
from deployments.ranks.records import RankReply
from deployments.sinks import EcDestination, EcFiles, Written
from kimi_encoder.items import EncoderInputError, EncoderItem, plan_image


def set_rules(roster, **changes) -> None:
    """The roster's lateness settings (``ranks.health.Lateness``) with ``changes``."""
    roster.rules = dataclasses.replace(roster.rules, **changes)


def fan_out(
    ranks: list[FakeRank],
    timeout_s: float = 30.0,
    cooldown_s: float = 60.0,
    cache: bool = False,
    clock=time.monotonic,
    **dispatch,
):
    roster = make_roster(ranks, cooldown_s, clock, **dispatch)
    dispatcher = Dispatcher(
        roster,
        DispatchArgs(cost_model="patches"),
        model_name="tiny",
        dtype="float32",
        cache_enabled=cache,
    )
    fanout = FanOut(roster, dispatcher, vision=VISION, timeout_s=timeout_s)
    return fanout, roster


def items(count: int, seed: int = 0) -> list[EncoderItem]:
    sizes = [(96, 64), (64, 48), (120, 90), (80, 56), (56, 84), (70, 70)]
    return [
        plan_image(image_bytes("RGB", sizes[i % len(sizes)], seed + i), PRESET.preprocess, "cpu")
        for i in range(count)
    ]


def assert_in_order(gathered, request: list[EncoderItem]) -> None:
    assert len(gathered.features) == len(request)
    for got, item in zip(gathered.features, request, strict=True):
        np.testing.assert_array_equal(got, features_of(item))


def test_all_ranks_answer_in_request_order():
    ranks = [FakeRank(0), FakeRank(1)]
    fanout, roster = fan_out(ranks)
    request = items(6)
    gathered = asyncio.run(fanout.run(request, "float32"))
    assert_in_order(gathered, request)
    assert gathered.redispatched == 0
    assert roster.down() == set()
    assert sorted(i for r in ranks for call in r.calls for i in call) == list(range(6))
    for rank in ranks:  # each image went to the owner the gather reports
        for i in rank.calls[0]:
            assert gathered.owners[i] == rank.rank


def test_images_a_rank_answered_before_go_to_it_as_expected_hits():
    ranks = [FakeRank(0), FakeRank(1)]
    fanout, _ = fan_out(ranks, cache=True)
    first = items(4, seed=30)
    asyncio.run(fanout.run(first, "float32"))
    assert all(not any(held) for r in ranks for held in r.held)  # nothing cached yet
    owner = {i: r.rank for r in ranks for i in r.calls[0]}
    # The same images again (new item objects), with one new image and another dtype.
    again = items(4, seed=30) + items(1, seed=40)
    gathered = asyncio.run(fanout.run(again, "float32"))
    assert_in_order(gathered, again)
    for rank in ranks:
        for indices, held in zip(rank.calls[1:], rank.held[1:], strict=True):
            for i, h in zip(indices, held, strict=True):
                assert h == (i < 4 and owner[i] == rank.rank), (rank.rank, i, h)
    assert sum(h for r in ranks for held in r.held[1:] for h in held) == 4
    before = [len(r.held) for r in ranks]
    asyncio.run(fanout.run(items(4, seed=30), "bfloat16"))  # another key: nothing held
    third = [held for r, n in zip(ranks, before, strict=True) for held in r.held[n:]]
    assert sum(len(held) for held in third) == 4
    assert not any(any(h) for h in third)


def test_a_rank_unavailable_mid_call_is_redispatched_to_the_live_rank():
    sent = asyncio.Event()

    async def die_after_send(rank, indices, items):
        await sent.wait()  # every rank has its share: the fan-out is past sending
        raise RankUnavailableError(rank, ConnectionError("actor died"))

    async def signal(rank, indices, items):
        sent.set()

    ranks = [FakeRank(0, signal), FakeRank(1, die_after_send)]
    fanout, roster = fan_out(ranks)
    request = items(6, seed=10)
    gathered = asyncio.run(fanout.run(request, "float32"))
    assert_in_order(gathered, request)
    lost = ranks[1].calls[0]
    assert lost
    assert gathered.redispatched == len(lost)
    assert all(gathered.owners[i] == 0 for i in range(6))
    assert ranks[0].calls[1] == lost  # the second round carried exactly rank 1's share
    assert roster.down() == {1}
    assert roster.failures == [0, 1]


def test_every_rank_down_is_no_rank_available_with_retry_after():
    async def unavailable(rank, indices, items):
        raise RankUnavailableError(rank, ConnectionError("no replica"))

    ranks = [FakeRank(0, unavailable), FakeRank(1, unavailable)]
    fanout, roster = fan_out(ranks, cooldown_s=30)
    with pytest.raises(NoRankAvailableError, match="retry after 30 s") as info:
        asyncio.run(fanout.run(items(4), "float32"))
    assert info.value.retry_after_s == 30
    assert roster.down() == {0, 1}


def test_an_input_error_from_a_rank_is_the_answer_and_is_never_retried():
    async def bad_image(rank, indices, items):
        raise EncoderInputError("cannot decode the image", indices[0])

    ranks = [FakeRank(0, bad_image), FakeRank(1)]
    fanout, roster = fan_out(ranks)
    request = items(4, seed=20)
    with pytest.raises(EncoderInputError, match=r"item \d: cannot decode"):
        asyncio.run(fanout.run(request, "float32"))
    assert len(ranks[0].calls) == 1
    assert len(ranks[1].calls) == 1
    assert roster.down() == set()
    assert roster.redispatched == 0


def test_timeout_cancels_every_call():
    never = asyncio.Event()

    async def hang(rank, indices, items):
        await never.wait()

    ranks = [FakeRank(0, hang), FakeRank(1, hang)]
    fanout, _ = fan_out(ranks, timeout_s=0.05)
    with pytest.raises(RequestTimeoutError, match=r"request_timeout_s=0\.05 s"):
        asyncio.run(fanout.run(items(4, seed=30), "float32"))
    assert [r.cancelled for r in ranks] == [1, 1]


def test_timeout_is_the_clients_wall_time_when_the_health_clock_stands_still():
    """Lateness is judged on the roster's clock (the ingress's ``LoopClock``, which stands
    still while its loop lags); the request's timeout is the client's and is not."""
    never = asyncio.Event()

    async def hang(rank, indices, items):
        await never.wait()

    ranks = [FakeRank(0, hang), FakeRank(1, hang)]
    fanout, roster = fan_out(ranks, timeout_s=0.05, clock=lambda: 0.0)
    with pytest.raises(RequestTimeoutError, match=r"request_timeout_s=0\.05 s"):
        asyncio.run(fanout.run(items(4, seed=30), "float32"))
    assert [r.cancelled for r in ranks] == [1, 1]
    assert roster.down() == set()  # no time passed on its clock: nobody was late


def test_duplicates_are_encoded_once_and_share_their_features():
    ranks = [FakeRank(0), FakeRank(1)]
    fanout, _ = fan_out(ranks)
    distinct = items(3, seed=40)
    request = [distinct[0], distinct[1], distinct[0], distinct[2], distinct[0]]
    gathered = asyncio.run(fanout.run(request, "float32"))
    assert_in_order(gathered, request)
    sent = sorted(i for r in ranks for call in r.calls for i in call)
    assert sent == [0, 1, 3]  # the copies at 2 and 4 were never sent
    assert gathered.owners[2] == gathered.owners[4] == gathered.owners[0]


def test_a_late_rank_is_hedged_and_its_call_cancelled_when_the_copy_answers():
    never = asyncio.Event()

    async def hang(rank, indices, items):
        await never.wait()

    ranks = [FakeRank(0), FakeRank(1, hang)]
    fanout, roster = fan_out(ranks)
    set_rules(roster, slow_after_s=0.05)  # the tiny model's expected time is far below it
    request = items(6, seed=50)
    gathered = asyncio.run(fanout.run(request, "float32"))
    assert_in_order(gathered, request)
    share = ranks[1].calls[0]
    assert ranks[0].calls[-1] == share  # the late call's images went to rank 0
    assert ranks[1].cancelled == 1  # the duplicate was dropped once rank 0 answered
    assert roster.hedged >= len(share)
    assert 1 in roster.down()
    assert all(gathered.owners[i] == 0 for i in share)


def test_first_answer_wins_when_the_late_call_answers_before_its_copy():
    late_go, copy_sent, copy_go = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def late(rank, indices, items):
        await late_go.wait()

    async def zero(rank, indices, items):
        if ranks[0].calls[1:]:  # the hedged copy: wait while the late call answers
            copy_sent.set()
            await copy_go.wait()

    ranks = [FakeRank(0, zero), FakeRank(1, late)]
    fanout, roster = fan_out(ranks)
    set_rules(roster, slow_after_s=0.05)

    async def run():
        task = asyncio.ensure_future(fanout.run(request, "float32"))
        await copy_sent.wait()
        late_go.set()  # rank 1 answers while its copy is still running on rank 0
        return await task

    request = items(6, seed=60)
    gathered = asyncio.run(run())
    assert_in_order(gathered, request)
    share = ranks[1].calls[0]
    assert all(gathered.owners[i] == 1 for i in share)
    assert ranks[0].cancelled == 1  # the copy was the duplicate
    assert roster.down() == set()  # rank 1 answered: slow, not dead


def test_slow_ranks_still_take_work_when_no_rank_is_up():
    async def scenario():
        ranks = [FakeRank(0), FakeRank(1)]
        fanout, roster = fan_out(ranks)
        for rank in (0, 1):
            roster.mark_down(RankUnavailableError(rank, "late", slow=True), roster.clock())
        request = items(4, seed=70)
        return request, await fanout.run(request, "float32"), roster

    request, gathered, roster = asyncio.run(scenario())
    assert_in_order(gathered, request)  # answered, not 503
    assert roster.down() == set()


def test_a_silent_rank_gets_no_new_work():
    never = asyncio.Event()

    class Silent(FakeRank):
        def load(self) -> FakeCall:
            return FakeCall(never.wait())

    ranks = [FakeRank(0), Silent(1)]
    clock = Clock()
    fanout, roster = fan_out(ranks, clock=clock)

    async def miss() -> set[int]:
        await fanout.roster.refresh()  # waits briefly, the poll goes on
        await fanout.roster._poll  # until rank 1 misses its report deadline
        return roster.down()

    async def scenario():
        once = await miss()  # one miss may be a busy queue
        clock.now += roster.slow_after_s
        return once, await miss(), await fanout.run(items(4, seed=80), "float32")

    once, twice, gathered = asyncio.run(scenario())
    assert once == set()
    assert twice == {1}  # still missing slow_after_s later, with no progress between
    assert roster.down() == {1}
    assert set(gathered.owners) == {0}
    assert not ranks[1].calls


class Unrouted(FakeRank):
    """A rank whose calls no replica takes until ``route`` is set (a dead rank waiting
    for its replacement, or a machine too starved to route); then they run."""

    def __init__(self, rank: int, route: asyncio.Event):
        super().__init__(rank, self._wait_for_route)
        self.route = route
        self.pending: list[FakeCall] = []

    def encode(self, call):
        call = super().encode(call)
        call.routed = False
        self.pending.append(call)
        return call

    async def _wait_for_route(self, rank, indices, items):
        await self.route.wait()
        for call in self.pending:
            call.routed = True


def test_an_unrouted_call_is_hedged_after_the_route_timeout_and_keeps_routing():
    async def scenario():
        route = asyncio.Event()
        ranks = [FakeRank(0), Unrouted(1, route)]
        fanout, roster = fan_out(ranks)
        set_rules(roster, route_timeout_s=0.02)
        request = items(6, seed=90)
        gathered = await fanout.run(request, "float32")
        return ranks, roster, request, gathered

    ranks, roster, request, gathered = asyncio.run(scenario())
    assert_in_order(gathered, request)
    share = ranks[1].calls[0]
    assert share
    assert ranks[0].calls[-1] == share  # its images went to rank 0 while it routed
    assert ranks[1].cancelled == 1  # the unrouted call was dropped once rank 0 answered
    assert roster.down() == {1}
    assert "no replica took the call in " in report.failover(roster)["down"][1]
    assert roster.failed() == set()  # slow, not failed: it gets work when no rank is up


def test_when_no_rank_routes_in_time_the_request_waits_for_routing_not_503():
    """A machine so starved that no rank routes within the route timeout: every call is
    late and there is nowhere to hedge, so the calls go on and the request is answered."""

    async def scenario():
        route = asyncio.Event()
        ranks = [Unrouted(0, route), Unrouted(1, route)]
        fanout, roster = fan_out(ranks)
        set_rules(roster, route_timeout_s=0.01)
        request = items(6, seed=100)
        task = asyncio.ensure_future(fanout.run(request, "float32"))
        while roster.down() != {0, 1}:  # both calls late: both ranks down as slow
            await asyncio.sleep(0)
        route.set()
        return ranks, request, await task

    ranks, request, gathered = asyncio.run(scenario())
    assert_in_order(gathered, request)
    assert [len(r.calls) for r in ranks] == [1, 1]  # nothing re-sent, nothing cancelled
    assert [r.cancelled for r in ranks] == [0, 0]


def test_unrouted_calls_of_ranks_that_then_fail_give_503_not_a_wait():
    """Both ranks' calls wait for a replica past the route timeout (late, nowhere to
    hedge), then both ranks fail (their replicas died): the calls are dropped and the
    request is refused with Retry-After instead of waiting for the replacements."""

    async def scenario():
        route = asyncio.Event()  # never set: the replacements are still starting
        ranks = [Unrouted(0, route), Unrouted(1, route)]
        fanout, roster = fan_out(ranks)
        set_rules(roster, route_timeout_s=0.01)
        task = asyncio.ensure_future(fanout.run(items(4, seed=110), "float32"))
        while roster.down() != {0, 1}:  # both calls late: both ranks down as slow
            await asyncio.sleep(0)
        for rank in (0, 1):
            roster.mark_down(
                RankUnavailableError(rank, ConnectionError("actor died")), roster.clock()
            )
        with pytest.raises(NoRankAvailableError) as raised:
            await task
        return ranks, raised.value

    ranks, error = asyncio.run(scenario())
    assert [r.cancelled for r in ranks] == [1, 1]
    assert error.retry_after_s >= 1


def test_a_refilled_answer_puts_each_resent_image_back_in_its_place():
    from deployments.handles import _refilled

    def reply(features, missing, encode_ms, load=None) -> RankReply:
        return RankReply(1, features, "float32", encode_ms, {}, 0.0, load, missing)

    first = reply(["a", None, "c", None], [1, 3], 1.0)
    again = reply(["B", "D"], [], 2.0, load=busy(7))
    merged = _refilled(first, [1, 3], again)
    assert merged.features == ["a", "B", "c", "D"]
    assert merged.missing == []
    assert merged.encode_ms == 3.0
    assert merged.load == busy(7)  # the later load report
    with pytest.raises(AssertionError, match="came back missing"):
        _refilled(first, [1, 3], again.replace(missing=[0]))


# --- load is not failure: lateness counts from the rank's last progress ---------------


class Held(FakeRank):
    """A rank whose encode calls wait until ``go`` is set; ``sent`` is set by the first."""

    def __init__(self, rank: int):
        super().__init__(rank, self._hold)
        self.go, self.sent = asyncio.Event(), asyncio.Event()

    async def _hold(self, rank, indices, items):
        self.sent.set()
        await self.go.wait()


@pytest.mark.parametrize("progress", [True, False], ids=["answering", "hung"])
def test_a_rank_that_keeps_answering_is_busy_not_late(progress):
    """Rank 1's call waits far past its lateness window (the clock jumps 10 s at a time),
    while its load reports show it answering other calls: busy, not late, nothing is sent
    twice. Without that progress the same wait makes it slow and its images are hedged."""

    async def scenario():
        clock = Clock()
        ranks = [FakeRank(0), Held(1)]
        fanout, roster = fan_out(ranks, timeout_s=1e6, clock=clock)
        set_rules(roster, slow_after_s=0.05)  # the fan-out wakes at least this often
        request = items(6, seed=120)
        task = asyncio.ensure_future(fanout.run(request, "float32"))
        await ranks[1].sent.wait()
        for answered in range(1, 6 if progress else 2):
            clock.now += 10.0
            if progress:
                roster.observe(1, busy(answered))  # as a poll or another answer brings it
                await clock.seen()
        gathered = await task if not progress else None  # hung: the hedge answers
        ranks[1].go.set()
        return ranks, roster, request, gathered or await task

    ranks, roster, request, gathered = asyncio.run(scenario())
    assert_in_order(gathered, request)
    share = ranks[1].calls[0]
    if progress:
        assert [len(r.calls) for r in ranks] == [1, 1]  # nothing re-sent
        assert roster.failures == [0, 0]
        assert (roster.hedged, roster.redispatched, gathered.redispatched) == (0, 0, 0)
        assert roster.down() == set()
        assert all(gathered.owners[i] == 1 for i in share)
    else:
        assert ranks[0].calls[-1] == share  # hedged to rank 0
        assert roster.hedged == roster.redispatched == len(share)
        assert roster.failures == [0, 1]


def test_a_late_call_is_never_hedged_to_its_own_rank():
    """One rank (dp 1): its call waits for a replica with no progress, so it is late and
    the rank slow; when the rank answers another call and is up again, the late call's
    images stay with the late call instead of going to the same rank a second time."""

    async def scenario():
        clock = Clock()
        route = asyncio.Event()
        ranks = [Unrouted(0, route)]
        fanout, roster = fan_out(ranks, timeout_s=1e6, clock=clock)
        set_rules(roster, route_timeout_s=0.01, slow_after_s=0.05)
        task = asyncio.ensure_future(fanout.run(items(3, seed=130), "float32"))
        while not ranks[0].calls:
            await asyncio.sleep(0)
        clock.now += 10.0
        while roster.down() != {0}:
            await clock.seen(1)
        roster.heard(0)
        roster.mark_up(0, None, clock.now)  # another request's call answered
        await clock.seen()  # an unrouted late call: the fan-out looks again every 0.1 s
        up_again = roster.down()
        route.set()
        return ranks, roster, up_again, await task

    ranks, roster, up_again, gathered = asyncio.run(scenario())
    assert up_again == set()
    assert len(ranks[0].calls) == 1
    assert (roster.hedged, roster.redispatched, gathered.redispatched) == (0, 0, 0)
    assert gathered.owners == [0, 0, 0]


def test_an_unrouted_call_of_a_rank_that_answers_is_queued_not_late():
    """A call no replica has taken for longer than the route timeout waits in a queue
    while its rank shows progress (a busy rank, or a busy ingress's router); once the rank
    goes quiet for ``slow_after_s`` it is late and hedged as before."""

    async def scenario():
        clock = Clock()
        route = asyncio.Event()
        ranks = [FakeRank(0), Unrouted(1, route)]
        fanout, roster = fan_out(ranks, timeout_s=1e6, clock=clock)
        set_rules(roster, route_timeout_s=0.01, slow_after_s=0.05)
        task = asyncio.ensure_future(fanout.run(items(6, seed=140), "float32"))
        while not ranks[1].calls:
            await asyncio.sleep(0)
        for answered in range(1, 6):
            clock.now += 0.04  # past the route timeout, within slow_after_s of progress
            roster.observe(1, busy(answered))
            await clock.seen()
        queued = (roster.down(), len(ranks[0].calls))
        clock.now += 10.0  # no progress for longer than slow_after_s
        while roster.down() != {1}:
            await clock.seen(1)
        return ranks, queued, await task

    ranks, queued, gathered = asyncio.run(scenario())
    assert queued == (set(), 1)
    share = ranks[1].calls[0]
    assert ranks[0].calls[-1] == share
    assert all(gathered.owners[i] == 0 for i in share)


def test_a_missed_report_of_a_rank_with_calls_in_flight_is_theirs_to_judge():
    """A poll that waits in a busy queue says nothing while this replica has calls on the
    rank: their lateness (from the rank's progress) judges it. With none in flight,
    polls that go on missing for slow_after_s make the rank slow."""

    async def scenario():
        clock = Clock()
        ranks = [FakeRank(0), Held(1)]
        fanout, roster = fan_out(ranks, timeout_s=1e6, clock=clock)
        set_rules(roster, slow_after_s=1e3)  # the call itself is never late here
        task = asyncio.ensure_future(fanout.run(items(6, seed=160), "float32"))
        await ranks[1].sent.wait()
        clock.now += 2e3  # quiet for twice slow_after_s
        roster.missed_report(1, TimeoutError())
        with_a_call = roster.down()
        ranks[1].go.set()
        await task
        clock.now += 2e3
        roster.missed_report(1, TimeoutError())
        one_miss = roster.down()
        clock.now += roster.slow_after_s
        roster.missed_report(1, TimeoutError())
        return with_a_call, one_miss, roster.down()

    with_a_call, one_miss, without = asyncio.run(scenario())
    assert with_a_call == set()
    assert one_miss == set()
    assert without == {1}


def test_a_destination_goes_to_each_call_as_the_entries_of_its_images():
    """vLLM entries written by the ranks: each call's sink names, per image it carries,
    the uuids of every request item that image stands for (a duplicate's too); the
    answers are what was written, and every item gets its image's record."""
    ranks = [FakeRank(0), FakeRank(1)]
    fanout, _ = fan_out(ranks)
    request = items(4, seed=150)
    request = [request[0], request[1], request[0], request[2], request[3], request[1]]
    uuids = [f"u{i}" for i in range(len(request))]
    to = EcDestination("/ec", uuids)
    gathered = asyncio.run(fanout.run(request, "bfloat16", to))
    sent = [s for r in ranks for s in r.sinks]
    assert all(isinstance(s, EcFiles) and s.root == "/ec" for s in sent)
    for rank in ranks:
        for indices, sink in zip(rank.calls, rank.sinks, strict=True):
            for index, names in zip(indices, sink.uuids, strict=True):
                twins = [i for i, item in enumerate(request) if item.image == request[index].image]
                assert names == tuple(uuids[i] for i in twins)
    assert sorted(u for s in sent for names in s.uuids for u in names) == sorted(uuids)
    for i, written in enumerate(gathered.features):
        assert isinstance(written, Written)
        assert uuids[i] in written.sizes
        assert written.shape == features_of(request[i]).shape
        assert written.dtype == "bfloat16"
    assert gathered.features[0] is gathered.features[2]  # one image, written for both
    assert gathered.destination is to


# --- one clock: a failure is placed by when its call was sent, on the roster's clock ----


class Replaced(FakeRank):
    """One rank whose first call went to replica A, which dies once ``fail`` is set; every
    later call is answered by its replacement, replica B (as Serve's client names them)."""

    def __init__(self):
        super().__init__(0)
        self.fail, self.first_sent = asyncio.Event(), asyncio.Event()

    def encode(self, record):
        if self.calls:
            call = super().encode(record)
            call.replica = "B"
            return call
        self.calls.append(list(record.indices))

        async def dies() -> dict:
            self.first_sent.set()
            await self.fail.wait()
            raise RankUnavailableError(0, ConnectionError("actor died"), replica="A")

        call = FakeCall(dies())
        call.replica = "A"
        return call


def test_an_old_replicas_late_failure_spares_its_replacement_on_a_lagging_clock():
    """The ingress judges by a loop clock that runs behind ``time.monotonic()`` once its
    loop has lagged (here 10 s). Replica A takes a call, replica B (its replacement)
    answers a call sent after it, then A's call fails: an old replica's failure, ignored,
    and A's images go to B. Compared on two clocks, the failure looked newer than B's
    answer and marked the rank down: with one rank, a 503 instead of the features."""

    async def scenario():
        rank = Replaced()
        fanout, roster = fan_out([rank], clock=lambda: time.monotonic() - 10.0)
        first_request, second_request = items(2, seed=160), items(2, seed=170)
        first = asyncio.ensure_future(fanout.run(first_request, "float32"))
        await rank.first_sent.wait()
        second = await fanout.run(second_request, "float32")  # replica B answers
        rank.fail.set()
        return first_request, await first, second_request, second, roster

    first_request, first, second_request, second, roster = asyncio.run(scenario())
    assert_in_order(second, second_request)
    assert_in_order(first, first_request)  # re-dispatched to replica B
    assert first.redispatched == 2
    assert roster.down() == set()
    assert roster.ignored == 1
