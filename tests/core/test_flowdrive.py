"""The one flow driver every sync and asyncio shell uses (mos_lease/flowdrive.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import pytest

from mos_lease.errors import MosLeaseError, StoreUnavailable
from mos_lease.flowdrive import Drive, Failed, outcome_of, outcome_of_async


def _adding(calls: list[int]) -> Generator[int, Any, str]:
    total = 0
    for n in calls:
        try:
            total += yield n
        except StoreUnavailable:
            total += 1000  # a failure the flow handles
    return f"total {total}"


def _perform(n: int) -> int:
    if n < 0:
        raise StoreUnavailable("down")
    if n == 0:
        raise ZeroDivisionError("a bug")
    return n * 10


def _run(flow: Generator[int, Any, str]) -> tuple[str, list[int]]:
    seen = []
    drive = Drive(flow)
    for call in drive:
        seen.append(call)
        drive.send(outcome_of(_perform, call))
    return drive.result, seen


def test_each_call_is_performed_once_and_the_flow_value_comes_back() -> None:
    assert _run(_adding([1, 2, 3])) == ("total 60", [1, 2, 3])


def test_a_flow_that_yields_nothing_returns_at_once() -> None:
    assert _run(_adding([])) == ("total 0", [])


def test_a_library_failure_is_thrown_into_the_flow() -> None:
    assert _run(_adding([1, -1, 2])) == ("total 1030", [1, -1, 2])


def test_any_other_failure_is_raised_at_once_and_the_flow_goes_no_further() -> None:
    caught: list[BaseException] = []

    def flow() -> Generator[int, Any, str]:
        try:
            yield 0
        except BaseException as failure:  # would swallow the bug, were it thrown in
            caught.append(failure)
        return "swallowed"

    with pytest.raises(ZeroDivisionError, match="a bug"):
        _run(flow())
    assert caught == []


def test_thrown_names_which_failures_the_flow_handles() -> None:
    drive = Drive(_adding([-1]), thrown=())
    with pytest.raises(StoreUnavailable):
        for call in drive:
            drive.send(outcome_of(_perform, call))
    everything = Drive(_adding([0]), thrown=BaseException)
    with pytest.raises(ZeroDivisionError):  # thrown in, and the flow does not handle it
        for call in everything:
            everything.send(outcome_of(_perform, call))


def test_a_failure_the_flow_lets_through_propagates_from_the_flow() -> None:
    def flow() -> Generator[int, Any, str]:
        yield -1
        return "unreachable"

    with pytest.raises(StoreUnavailable, match="down"):
        _run(flow())


def test_the_end_is_observed_once_with_the_value() -> None:
    ends: list[str] = []

    class Observed(Drive[int, str]):
        def _finished(self, value: str) -> None:
            ends.append(value)

    drive = Observed(_adding([1]))
    for call in drive:
        drive.send(outcome_of(_perform, call))
    assert list(drive) == []  # exhausted: iterating again yields nothing
    assert ends == ["total 10"]


def test_the_asyncio_outcome_is_the_same() -> None:
    async def perform(n: int) -> int:
        return _perform(n)

    async def run() -> str:
        drive = Drive(_adding([1, -1]))
        for call in drive:
            drive.send(await outcome_of_async(perform, call))
        return drive.result

    assert asyncio.run(run()) == "total 1010"


def test_an_outcome_that_failed_is_marked_as_such() -> None:
    failed = outcome_of(_perform, -1)
    assert isinstance(failed, Failed) and isinstance(failed.error, MosLeaseError)
    assert outcome_of(_perform, 2) == 20
