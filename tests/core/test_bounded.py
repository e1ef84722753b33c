"""A blocking call given a time limit from outside (mos_lease.bounded): its result, its
exception, or OVERDUE at the limit with a late result handed to ``late``, never to the
caller; and a call that finished leaves no thread of its own behind."""

from __future__ import annotations

import threading
import time

import pytest

from mos_lease.bounded import OVERDUE, bounded, start


def test_a_call_that_finishes_in_time_gives_its_result() -> None:
    assert bounded(lambda: 42, 5.0, name="t-result") == 42


def test_a_call_that_raises_gives_its_exception_back_not_raised() -> None:
    def boom() -> int:
        raise ValueError("boom")

    outcome = bounded(boom, 5.0, name="t-raises")
    assert isinstance(outcome, ValueError) and str(outcome) == "boom"


def test_a_call_past_its_limit_is_overdue_and_its_late_result_goes_to_late() -> None:
    release = threading.Event()
    late: list[int] = []
    handed = threading.Event()

    def slow() -> int:
        release.wait(5.0)
        return 7

    def on_late(value: int) -> None:
        late.append(value)
        handed.set()

    assert bounded(slow, 0.05, name="t-late", late=on_late) is OVERDUE
    release.set()
    assert handed.wait(5.0)
    assert late == [7]


@pytest.mark.parametrize("kind", ["result", "exception"])
def test_a_finished_call_leaves_no_thread_running_once_waited_for(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A driver that starts its next call as soon as one returns (the thread supervisor's
    # renewal batches) must never run two call threads at once: the thread of a finished
    # call has ended by the time wait() hands its outcome over, even when ending takes it a
    # while (here: 20 ms after the call returned, as a thread census or a profiler would).
    original = threading.Thread.run

    def run_then_linger(thread: threading.Thread) -> None:
        try:
            original(thread)
        finally:
            time.sleep(0.02)

    monkeypatch.setattr(threading.Thread, "run", run_then_linger)

    def call() -> int:
        if kind == "exception":
            raise RuntimeError("x")
        return 1

    for _ in range(5):
        running = start(call, name="t-ends")
        outcome = running.wait(5.0)
        assert outcome == 1 if kind == "result" else isinstance(outcome, RuntimeError)
        assert [t for t in threading.enumerate() if t.name == "t-ends"] == []
