"""Notices are rate-bounded hints: the pure gate (coalescing per key, one token bucket, the
one warning of a flood) and the confirmer's thread that runs the turns it allows."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mos_lease import ConfigurationError
from mos_lease.notice_confirmer import Done, NoticeConfirmer, shared_confirmer
from mos_lease.notice_gate import NoticeGate, NoticeStats, Turn


def keys(turns: tuple[Turn[str], ...]) -> list[str]:
    return [turn.key for turn in turns]


def test_notices_for_a_key_are_coalesced_into_one_turn_and_one_more() -> None:
    gate: NoticeGate[str] = NoticeGate(rate=1, burst=5)
    for _ in range(1000):
        gate.notice("a")
    due = gate.due(0.0)
    assert keys(due.turns) == ["a"] and due.wait is None and not due.warn
    for _ in range(1000):
        gate.notice("a")  # while its turn runs: one more turn, after it
    assert gate.due(0.0).turns == ()  # never two in flight for one key
    gate.done(due.turns[0])
    again = gate.due(0.0)
    assert keys(again.turns) == ["a"]
    gate.done(again.turns[0])
    assert gate.due(0.0).turns == () and not gate.pending("a")
    assert gate.stats == NoticeStats(notices=2000, coalesced=1998, confirmations=2,
                                     held_back=0)


def test_the_bucket_bounds_turns_for_all_keys_together_in_queue_order() -> None:
    gate: NoticeGate[str] = NoticeGate(rate=10, burst=2)
    for key in "abcde":
        gate.notice(key)
    first = gate.due(0.0)
    assert keys(first.turns) == ["a", "b"]  # the burst
    assert first.wait == pytest.approx(0.1) and first.warn
    assert gate.due(0.05).turns == ()  # half a token
    assert keys(gate.due(0.1).turns) == ["c"]
    gate.notice("a")  # still running: it goes behind d and e, once
    gate.done(first.turns[0])
    assert keys(gate.due(0.3).turns) == ["d", "e"]  # two tokens refilled, oldest first
    assert keys(gate.due(0.4).turns) == ["a"]
    assert gate.stats.held_back == 3  # c, d and a each waited at the head


def test_the_warning_comes_once_per_flood_and_again_after_a_quiet_spell() -> None:
    gate: NoticeGate[str] = NoticeGate(rate=1, burst=1, quiet=60)
    warned = []
    now = 0.0
    for _ in range(300):  # 300 s of notices faster than one turn a second
        for key in ("a", "b"):
            gate.notice(key)
        due = gate.due(now)
        warned += [now] * due.warn
        for turn in due.turns:
            gate.done(turn)
        now += 0.5
    assert warned == [0.0]
    while gate.pending("a") or gate.pending("b"):  # the flood is over: drain it
        due = gate.due(now)
        assert not due.warn
        for turn in due.turns:
            gate.done(turn)
        now += 1.0
    for key in ("a", "b", "c"):
        gate.notice(key)
    assert not gate.due(now + 30).warn  # held back again within the quiet minute
    assert gate.due(now + 30 + 60).warn  # and again after a quiet minute: warned again


def test_a_forgotten_key_drops_its_turns_and_an_old_turn_ending_changes_nothing() -> None:
    gate: NoticeGate[str] = NoticeGate(rate=100, burst=10)
    gate.notice("a")
    (old,) = gate.due(0.0).turns
    gate.forget("a")
    assert not gate.pending("a")
    gate.notice("a")
    (new,) = gate.due(0.0).turns
    gate.done(old)  # the forgotten turn ends late: the new one still runs
    assert gate.pending("a")
    gate.notice("a")
    assert gate.due(0.0).turns == ()
    gate.done(new)
    assert keys(gate.due(0.0).turns) == ["a"]


def test_a_clock_that_steps_back_refills_nothing() -> None:
    gate: NoticeGate[str] = NoticeGate(rate=1, burst=1)
    gate.notice("a")
    gate.done(gate.due(100.0).turns[0])
    gate.notice("a")
    assert gate.due(50.0).turns == () and gate.due(100.5).turns == ()
    assert keys(gate.due(101.0).turns) == ["a"]


@pytest.mark.parametrize("options", [{"rate": 0}, {"rate": -1.0}, {"rate": float("inf")},
                                     {"rate": True}, {"rate": "5"}, {"burst": 0},
                                     {"burst": 1.5}, {"burst": True}, {"quiet": -1},
                                     {"quiet": float("nan")}])
def test_a_bound_that_is_no_bound_is_refused(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        NoticeGate(**options)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        NoticeConfirmer(**options)  # type: ignore[arg-type]


Program = list[tuple[str, int, float]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["notice", "done", "wait"]),
                          st.integers(0, 3), st.floats(0, 0.5)), max_size=200),
       st.floats(0.5, 50), st.integers(1, 8))
def test_whatever_arrives_turns_stay_within_the_bound_one_per_key_and_none_is_lost(
        program: Program, rate: float, burst: int) -> None:
    gate: NoticeGate[int] = NoticeGate(rate, burst)
    now = 0.0
    started: list[float] = []
    running: dict[int, Turn[int]] = {}
    waiting_since: dict[int, int] = {}  # key -> index of a notice no turn has answered yet

    def step() -> None:
        for turn in gate.due(now).turns:
            assert turn.key not in running  # at most one in flight per key
            running[turn.key] = turn
            started.append(now)
            waiting_since.pop(turn.key, None)

    for index, (action, key, seconds) in enumerate(program):
        if action == "notice":
            gate.notice(key)
            waiting_since.setdefault(key, index)
        elif action == "done" and key in running:
            gate.done(running.pop(key))
        else:
            now += seconds
        step()
    # Over every stretch of time, no more turns started than the bucket allows.
    for i, begin in enumerate(started):
        for j in range(i, len(started)):
            assert j - i + 1 <= burst + rate * (started[j] - begin) + 1e-6
    # No notice is lost: with every turn let finish and time enough, each is answered.
    for _ in range(20):
        for key in list(running):
            gate.done(running.pop(key))
        now += burst / rate
        step()
    assert waiting_since == {} and not running


# --- the confirmer's thread ------------------------------------------------------------------


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition()


def test_the_confirmer_runs_one_turn_per_key_at_a_time_and_warns_once(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mos_lease.notices")
    confirmer = NoticeConfirmer(rate=20, burst=2)
    started: list[str] = []
    pending: list[Done] = []

    def slow(done: Done) -> None:  # an asyncio holder's job: done later, elsewhere
        started.append("slow")
        pending.append(done)

    def quick(done: Done) -> None:  # a thread holder's job: done before it returns
        started.append("quick")
        done()

    def failing(done: Done) -> None:
        raise RuntimeError("job bug")

    confirmer.register("a", slow)
    confirmer.register("b", quick)
    confirmer.register("b", failing)
    confirmer.notice("nobody")  # no job for it: nothing at all
    for _ in range(10_000):
        confirmer.notice("a")
        confirmer.notice("b")
    wait_until(lambda: started.count("slow") == 1 and started.count("quick") >= 2)
    time.sleep(0.2)
    assert started.count("slow") == 1  # its turn is not over: no second one
    pending.pop()()
    wait_until(lambda: started.count("slow") == 2)  # the one more, after it
    pending.pop()()
    stats = confirmer.stats()
    assert stats.notices == 20_000 and stats.confirmations <= 2 + 20 * 2
    flood = [r for r in caplog.records if r.name == "mos_lease.notices"
             and r.levelno == logging.WARNING]
    assert len(flood) == 1 and "faster than the 20 confirming reads" in flood[0].getMessage()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and all("confirmation failed" in r.getMessage() for r in errors)
    thread = confirmer._thread
    assert thread is not None
    for key, job in (("a", slow), ("b", quick), ("b", failing)):
        confirmer.unregister(key, job)
    thread.join(5)
    assert not thread.is_alive() and confirmer._thread is None  # nothing registered: ended
    confirmer.unregister("a", slow)  # twice: nothing


def test_the_process_shares_one_confirmer() -> None:
    assert shared_confirmer() is shared_confirmer()
    assert shared_confirmer().rate == 20 and shared_confirmer().burst == 10
    with pytest.raises(ConfigurationError):
        NoticeConfirmer(clock="now")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        shared_confirmer().register("a", "job")  # type: ignore[arg-type]
