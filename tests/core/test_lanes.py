"""The health of a supervisor's renewal lanes (``mos_lease.keep.lanes``), judged on a clock
moved by hand: when a lane is avoided, for how long, and when a batch on it is forsaken."""

from __future__ import annotations

import logging
import uuid

import pytest

from mos_lease.bounded import OVERDUE
from mos_lease.errors import CommitOutcomeUnknown, InvalidInput, StoreUnavailable
from mos_lease.keep.lanes import AVOID, AVOID_CAP, PATIENCE, Lanes
from mos_lease.keep.turn import Ended

HUNG, HEALTHY = 1, 2  # two lanes, by id


class Call:
    """A call given up on, which ends when the test says."""

    def __init__(self) -> None:
        self.ended = False

    def done(self) -> bool:
        return self.ended


class Rig:
    def __init__(self, count: int = 2) -> None:
        self.now = 100.0
        self.lanes = Lanes(lambda: self.now, count)


def test_a_lane_whose_batch_was_given_up_on_is_avoided_while_it_runs_and_a_pause_after() -> None:
    rig = Rig()
    call = Call()
    rig.lanes.judge(HUNG, OVERDUE, call, rig.now - PATIENCE)
    rig.now += 1000  # however long it runs
    assert rig.lanes.avoided(HUNG) and not rig.lanes.avoided(HEALTHY)
    call.ended = True
    assert rig.lanes.avoided(HUNG)  # the pause counts from the end seen now
    rig.now += AVOID - 0.01
    assert rig.lanes.avoided(HUNG)
    rig.now += 0.02
    assert not rig.lanes.avoided(HUNG)


def test_the_pause_doubles_with_each_failure_in_a_row_up_to_its_cap_and_a_return_clears_it(
        ) -> None:
    rig = Rig()
    pauses = []
    for _ in range(6):
        rig.lanes.judge(HUNG, StoreUnavailable("down"), None, rig.now - 0.01)
        began = rig.now
        while rig.lanes.avoided(HUNG):
            rig.now += 1.0
        pauses.append(rig.now - began)
    assert pauses == [AVOID, 2 * AVOID, 4 * AVOID, 8 * AVOID, AVOID_CAP, AVOID_CAP]
    rig.lanes.judge(HUNG, Ended([], rig.now), None, rig.now - 0.01)  # a batch that returned
    rig.lanes.judge(HUNG, StoreUnavailable("down"), None, rig.now - 0.01)
    began = rig.now
    while rig.lanes.avoided(HUNG):
        rig.now += 1.0
    assert rig.now - began == AVOID


def test_a_batch_given_less_than_the_patience_is_no_verdict_on_its_lane() -> None:
    """Given up on after less than PATIENCE (its limit was near when it started), it earns no
    pause: its lane is avoided only while it still runs."""
    rig = Rig()
    call = Call()
    rig.lanes.judge(HEALTHY, OVERDUE, call, rig.now - PATIENCE / 2)
    assert rig.lanes.avoided(HEALTHY)
    call.ended = True
    assert not rig.lanes.avoided(HEALTHY)


@pytest.mark.parametrize("count", [1, 2])
def test_a_batch_on_a_failing_lane_is_forsaken_only_while_another_lane_is_not_avoided(
        count: int) -> None:
    """With a second lane to retry on, the batches on a failing lane are given up on at their
    collection; with one lane (or both failing) they are waited for as before."""
    rig = Rig(count)
    rig.lanes.judge(HUNG, OVERDUE, Call(), rig.now - PATIENCE)
    assert rig.lanes.forsaken(HUNG) is (count == 2)
    assert not rig.lanes.forsaken(HEALTHY)
    rig.lanes.judge(HEALTHY, StoreUnavailable("down"), None, rig.now - 0.01)
    assert not rig.lanes.forsaken(HUNG) and not rig.lanes.forsaken(HEALTHY)


@pytest.mark.parametrize("error", [StoreUnavailable("down"),
                                   CommitOutcomeUnknown(uuid.uuid4(), "lost reply")])
def test_a_connections_error_fails_its_lane(error: Exception) -> None:
    rig = Rig()
    rig.lanes.judge(HUNG, error, None, rig.now - 0.01)
    assert rig.lanes.avoided(HUNG)


@pytest.mark.parametrize("error", [InvalidInput("leases", "bad"), RuntimeError("a bug")])
def test_bad_input_or_a_bug_says_nothing_of_the_lane(error: Exception) -> None:
    """A batch that raised what no connection raises neither fails its lane nor clears a
    failure it had."""
    rig = Rig()
    rig.lanes.judge(HEALTHY, error, None, rig.now - 0.01)
    assert not rig.lanes.avoided(HEALTHY)
    rig.lanes.judge(HUNG, StoreUnavailable("down"), None, rig.now - 0.01)
    rig.lanes.judge(HUNG, error, None, rig.now - 0.01)
    assert rig.lanes.avoided(HUNG)


def test_a_lane_is_outpaced_by_another_that_returned_a_batch_started_after_its_own() -> None:
    """Only a batch of another lane that started no earlier than the one waited for, and
    returned its results, shows that lane to be slow (not the database): one that raised,
    one that started earlier, or one of the same lane shows nothing."""
    rig = Rig()
    begun = rig.now
    assert not rig.lanes.outpaced(HUNG, begun)
    assert not rig.lanes.outpaced(HUNG, begun, [(HEALTHY, begun - 0.1, Ended([], rig.now))])
    assert not rig.lanes.outpaced(HUNG, begun, [(HEALTHY, begun + 0.1, Ended(
        StoreUnavailable("down"), rig.now))])
    assert not rig.lanes.outpaced(HUNG, begun, [(HUNG, begun + 0.1, Ended([], rig.now))])
    assert rig.lanes.outpaced(HUNG, begun, [(HEALTHY, begun + 0.1, Ended([], rig.now))])
    assert rig.lanes.outpaced(HUNG, begun)  # remembered
    assert not rig.lanes.outpaced(HUNG, begun + 0.2)


def test_a_batch_collected_with_its_results_counts_for_outpacing() -> None:
    rig = Rig()
    begun = rig.now
    rig.now += 0.05
    rig.lanes.judge(HEALTHY, Ended([], rig.now), None, rig.now - 0.04)  # started at begun + 0.01
    assert rig.lanes.outpaced(HUNG, begun)
    assert not rig.lanes.outpaced(HUNG, begun + 0.02)


def test_a_lane_failing_is_logged_once_a_run_of_failures_by_its_name_and_so_is_its_return(
        caplog: pytest.LogCaptureFixture) -> None:
    """An operator learns that one of two renewal connections fails (the other renews every
    batch meanwhile, so no lease may be lost to tell it): one WARNING when a run of failures
    starts, naming the lane and what it did, none for the failures that follow, an INFO when
    a batch returns on it again."""
    caplog.set_level(logging.INFO, logger="mos_lease.supervisor")
    lanes = Lanes(lambda: 100.0, 2, {HUNG: "renewal coordinator 2 of 2"})
    lanes.judge(HUNG, StoreUnavailable("connection reset"), None, 99.0)
    lanes.judge(HUNG, StoreUnavailable("connection reset"), None, 99.0)
    lanes.judge(HUNG, OVERDUE, Call(), 98.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["mos_lease: renewal coordinator 2 of 2 failing (StoreUnavailable: "
                        "connection reset); the other renews every batch while the call runs "
                        "and for 30 s after"]
    lanes.judge(HUNG, Ended([], 100.0), None, 99.9)
    lanes.judge(HEALTHY, Ended([], 100.0), None, 99.9)  # never failed: nothing to say
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["mos_lease: renewal coordinator 2 of 2 renews again"]
    caplog.clear()
    lanes.judge(HUNG, OVERDUE, Call(), 100.0 - PATIENCE)
    assert [r.getMessage() for r in caplog.records] == [
        "mos_lease: renewal coordinator 2 of 2 failing (given up on after 0.25 s); the other "
        "renews every batch while the call runs and for 30 s after"]


def test_a_hedge_goes_to_a_coordinator_with_no_batch_on_it_that_is_not_avoided(
        caplog: pytest.LogCaptureFixture) -> None:
    """``idle`` is where a batch still running elsewhere may be sent again: the first
    coordinator with no batch in flight or queued on it, passing over one avoided; none if
    every other is busy or avoided. ``of`` names each by its place in the log."""
    first, second, third = object(), object(), object()
    now = [100.0]
    lanes = Lanes.of(lambda: now[0], [first, second, third])
    assert lanes.idle([first, second, third], [id(first)]) is second
    assert lanes.idle([first, second, third], [id(first), id(second)]) is third
    lanes.judge(id(second), StoreUnavailable("down"), None, 99.0)
    assert lanes.idle([first, second, third], [id(first)]) is third
    assert lanes.idle([first, second, third], [id(first), id(third)]) is None
    assert [r.getMessage().split(" failing")[0] for r in caplog.records] == [
        "mos_lease: renewal coordinator 2 of 3"]


def test_a_hedge_that_lost_holds_back_hedges_until_a_batch_is_prompt_and_its_lane_lingers(
        ) -> None:
    """A hedge that lost to the call it hedged (``wasted``): no coordinator is idle for
    another hedge until a batch returns within its patience (``prompt``), and its lane is
    avoided while the hedge still runs (a batch sent there would wait behind it), with no
    pause once it has ended and no failure counted."""
    first, second = object(), object()
    rig = Rig()
    hedge = Call()
    rig.lanes.wasted()
    rig.lanes.lingers(id(second), hedge)
    assert rig.lanes.idle([first, second], [id(first)]) is None
    assert rig.lanes.avoided(id(second)) and not rig.lanes.avoided(id(first))
    hedge.ended = True
    assert not rig.lanes.avoided(id(second))
    assert rig.lanes.idle([first, second], [id(first)]) is None  # still held back
    rig.lanes.prompt()
    assert rig.lanes.idle([first, second], [id(first)]) is second
