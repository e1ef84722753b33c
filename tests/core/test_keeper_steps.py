"""The steps keepers and holders yield, and the clock they keep their deadlines on.

The thread and asyncio keepers (and holders) are one source: every coordinator call is made
by the step itself (``call.on(coordinator)``), so the drivers hold no rule and no call of
their own. These tests pin that: the same steps make the same calls on a sync and an asyncio
coordinator; both keepers, given the same scenario, make the same calls; no step is named
like a machine command; and a keeper or holder keeps its deadline on the coordinator's
monotonic clock unless told otherwise.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

import mos_lease
from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    hold,
    machine,
)
from mos_lease import holder as holder_module
from mos_lease.holder import HoldTiming
from mos_lease.keep import keeper_calls as calls
from mos_lease.keep import timing as schedule
from mos_lease.keeper import AsyncLeaseKeeper, LeaseKeeper
from mos_lease.records import LeaseHandle
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.core.test_keeper import IDENT, SCOPES, FakeTime

Call = tuple[str, tuple[Any, ...], dict[str, Any]]


def handle(epoch: int = 1) -> LeaseHandle:
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    lease = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=30).lease
    assert lease is not None
    return lease


class Recording:
    """A coordinator that records every method called on it and answers ``answer``."""

    def __init__(self, answer: object) -> None:
        self.calls: list[Call] = []
        self.answer = answer

    def __getattr__(self, name: str) -> Callable[..., object]:
        def method(*args: object, **kwargs: object) -> object:
            self.calls.append((name, args, kwargs))
            return self.answer
        return method


class AsyncRecording(Recording):
    def __getattr__(self, name: str) -> Callable[..., object]:
        record = super().__getattr__(name)

        async def method(*args: object, **kwargs: object) -> object:
            return record(*args, **kwargs)
        return method


def every_call() -> list[calls.CoordinatorCall]:
    lease = handle()
    return [
        calls.AcquireCall(IDENT, "conn-b", SCOPES, 30.0, "corr-1"),
        calls.TakeoverCall(IDENT, "conn-b", SCOPES, 30.0, 4),
        calls.IssueGrantCall(lease, SCOPES, 5.0, "corr-2"),
    ]


def test_a_step_makes_the_same_call_on_a_sync_and_an_asyncio_coordinator() -> None:
    for call in every_call():
        sync: Any = Recording("answer")
        asynchronous: Any = AsyncRecording("answer")
        assert call.on(sync) == "answer"
        assert asyncio.run(call.on(asynchronous)) == "answer"
        assert sync.calls == asynchronous.calls and len(sync.calls) == 1, call


def test_each_step_calls_the_coordinator_method_of_its_name() -> None:
    names: dict[type, Any] = {type(call): Recording(None) for call in every_call()}
    for call in every_call():
        call.on(names[type(call)])
    called = {kind.__name__: recording.calls[0][0] for kind, recording in names.items()}
    assert called == {"AcquireCall": "acquire", "TakeoverCall": "takeover",
                      "IssueGrantCall": "issue_grant"}
    # Every call the union lists is one of these.
    assert set(typing.get_args(calls.CoordinatorCall)) == set(names)


KEEPER_CALLS = ("acquire", "heartbeat_many", "issue_grant", "release")


class Recorded(ConnectorLeaseCoordinator):
    """A coordinator on the in-memory store that records the keeper's calls (a renewal
    batch primed on the supervisor engine's thread is its ``heartbeat_many``)."""

    def __init__(self, time_: FakeTime) -> None:
        super().__init__(InMemoryLeaseStore(time_.store_clock), AllowAllPolicy(),
                         monotonic_clock=time_.clock)
        self.calls: list[Call] = []

    def __getattribute__(self, name: str) -> Any:
        found = super().__getattribute__(name)
        if name in (*KEEPER_CALLS, "prime_heartbeat_many"):
            calls = super().__getattribute__("calls")

            def method(*args: Any, **kwargs: Any) -> Any:
                calls.append(("heartbeat_many" if name.startswith("prime") else name,
                              _plain(args), kwargs))
                return found(*args, **kwargs)
            return method
        return found


class AsyncRecorded(AsyncConnectorLeaseCoordinator):
    def __init__(self, time_: FakeTime) -> None:
        super().__init__(AsyncInMemoryLeaseStore(InMemoryLeaseStore(time_.store_clock)),
                         AllowAllPolicy(),
                         monotonic_clock=time_.clock)
        self.calls: list[Call] = []

    def __getattribute__(self, name: str) -> Any:
        found = super().__getattribute__(name)
        if name in KEEPER_CALLS:
            calls = super().__getattribute__("calls")

            async def method(*args: Any, **kwargs: Any) -> Any:
                calls.append((name, _plain(args), kwargs))
                return await found(*args, **kwargs)
            return method
        return found


def _plain(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A call's arguments, each lease by what is the same in both runs (its lease id is
    random)."""
    def plain(value: Any) -> Any:
        if isinstance(value, LeaseHandle):
            return (value.identity, value.connector_id, value.epoch, value.scopes)
        if isinstance(value, list | tuple):
            return tuple(plain(v) for v in value)
        return value
    return tuple(plain(a) for a in args)


def test_the_two_keepers_make_the_same_calls() -> None:
    """One scenario (acquire, a due heartbeat, a grant, stop) through the thread keeper and
    the asyncio keeper, each on a recording coordinator: the same calls, in order (both run
    on the supervisor engine, whose thread and asyncio drivers perform the same turns)."""

    def scenario_sync() -> list[Call]:
        time_ = FakeTime()
        coordinator = Recorded(time_)
        keeper = LeaseKeeper(coordinator, ttl=9, clock_step=0, clock=time_.clock,
                             sleep=time_.advance, random=lambda: 0.5, background=False)
        keeper.acquire(IDENT, "conn-a", scopes=SCOPES, correlation_id="corr")
        keeper.step()  # a wait: sleeps to the renewal
        keeper.step()  # the heartbeat
        keeper.issue_grant(scopes=SCOPES, ttl=5, correlation_id="grant")
        keeper.stop()
        return coordinator.calls

    async def scenario_async() -> list[Call]:
        time_ = FakeTime()
        coordinator = AsyncRecorded(time_)
        keeper = AsyncLeaseKeeper(coordinator, ttl=9, clock_step=0, clock=time_.clock,
                                  sleep=time_.async_sleep, random=lambda: 0.5,
                                  background=False)
        await keeper.acquire(IDENT, "conn-a", scopes=SCOPES, correlation_id="corr")
        await keeper.step()
        await keeper.step()
        await keeper.issue_grant(scopes=SCOPES, ttl=5, correlation_id="grant")
        await keeper.stop()
        return coordinator.calls

    sync, asynchronous = scenario_sync(), asyncio.run(scenario_async())
    assert [name for name, _, _ in sync] == list(KEEPER_CALLS)
    assert sync == asynchronous


COORDINATOR_METHODS = {"acquire", "takeover", "heartbeat", "heartbeat_many", "release",
                       "issue_grant", "validate", "current_holder", "load"}


@pytest.mark.parametrize("module", ["keep/keeper.py", "keep/thread_keeper.py",
                                    "keep/asyncio_keeper.py", "keep/holding.py"])
def test_the_drivers_make_no_coordinator_call_of_their_own(module: str) -> None:
    """What the keeper and holder ask of the coordinator is in the steps (written once);
    a thread or asyncio driver only performs them (``step.on(...)``)."""
    source = (Path(mos_lease.__file__).parent / module).read_text()
    direct = [node.attr for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Attribute) and node.attr in COORDINATOR_METHODS
              and "coordinator" in ast.unparse(node.value)]
    assert direct == []


def test_no_step_or_decision_is_named_like_a_machine_command() -> None:
    def classes(*modules: object) -> set[str]:
        return {name for module in modules for name, value in vars(module).items()
                if inspect.isclass(value) and value.__module__.startswith("mos_lease.")
                and value.__module__ == getattr(module, "__name__", None)}

    from mos_lease.keep import hold_options as options
    from mos_lease.keep import holding
    ours = classes(calls, schedule, holding, options)
    assert {"AcquireCall", "HeartbeatDue", "ReportLoss", "Holder"} <= ours
    assert classes(machine) & ours == set()
    assert {"Acquire", "Heartbeat", "Release"} <= classes(machine)


def test_hold_declares_its_keywords_once() -> None:
    """The kind-independent keywords are declared once, in ``HoldKeywords``: hold() and
    check_options() take them as ``**options``; hold() names only what depends on the
    coordinator's kind (the overloads differ in nothing else)."""
    for function in (holder_module.hold, holder_module.check_options):
        parameters = inspect.signature(function).parameters
        assert parameters["options"].kind is inspect.Parameter.VAR_KEYWORD
        assert "HoldKeywords" in str(parameters["options"].annotation)
    named = set(inspect.signature(holder_module.hold).parameters) - {"options"}
    assert named == {"coordinator", "identity", "connector_id", "scopes", "ttl",
                     "heartbeat_coordinator", "sleep"}
    assert holder_module.HoldKeywords.__optional_keys__ == {
        "wait", "takeover", "timing", "callbacks", "cancel_on_loss", "notices", "clock",
        "random", "metadata"}


def test_hold_refuses_a_keyword_it_does_not_take() -> None:
    """As Python refuses an unknown keyword of a signature: a flat option that moved into a
    group (``clock_step`` is HoldTiming's now) is a TypeError naming it."""
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    with pytest.raises(TypeError, match="unexpected keyword argument 'clock_step'"):
        hold(coordinator, IDENT, "conn-a", scopes=SCOPES, ttl=10,
             clock_step=0)  # type: ignore[call-overload]
    assert coordinator.current_holder(IDENT) is None  # nothing written


# --- one clock: the coordinator's -----------------------------------------------------------


class Ticking:
    """A monotonic clock far from any real one, so a deadline on it is unmistakable."""

    def __init__(self) -> None:
        self.now = 5_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_keeper_keeps_its_deadline_on_the_coordinators_clock() -> None:
    clock = Ticking()
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy(),
                                            monotonic_clock=clock)
    keeper = LeaseKeeper(coordinator, ttl=10, clock_step=0, background=False)
    assert keeper.acquire(IDENT, "conn-a", scopes=SCOPES).ok
    assert keeper.deadline == pytest.approx(clock.now + 9.0)
    # Told otherwise, it uses the clock it is given.
    other = LeaseKeeper(coordinator, ttl=10, clock_step=0, background=False,
                        clock=lambda: 7.0)
    other.adopt(keeper.lease, obtained_at=7.0)  # type: ignore[arg-type]
    assert other.deadline == pytest.approx(16.0)


def test_an_asyncio_keeper_keeps_its_deadline_on_the_coordinators_clock() -> None:
    async def scenario() -> None:
        clock = Ticking()
        coordinator = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(),
                                                     AllowAllPolicy(), monotonic_clock=clock)
        keeper = AsyncLeaseKeeper(coordinator, ttl=10, clock_step=0, background=False)
        assert (await keeper.acquire(IDENT, "conn-a", scopes=SCOPES)).ok
        assert keeper.deadline == pytest.approx(clock.now + 9.0)
        await keeper.stop()

    asyncio.run(scenario())


def test_hold_keeps_its_wait_and_deadline_on_the_coordinators_clock() -> None:
    clock = Ticking()
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy(),
                                            monotonic_clock=clock)
    with hold(coordinator, IDENT, "conn-a", scopes=SCOPES, ttl=10, wait=0,
              timing=HoldTiming(clock_step=0)) as held:
        assert held._engine is not None  # the engine that renews it keeps the deadline
        assert held._engine.deadline(IDENT) == pytest.approx(clock.now + 9.0)


def test_steps_are_values() -> None:
    # Frozen: a step handed to a driver cannot be changed on its way.
    call = calls.AcquireCall(IDENT, "conn-b", SCOPES, 30.0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        call.identity = IDENT  # type: ignore[misc]
