"""The clock-step margin is kept only where a failover can step the store's time, and a ttl
too short for it is refused naming options that every entry point accepts.

A store says whether its time can step (``clock_can_step``): the in-memory store's is this
process's clock, which no failover replaces, so keepers, ``hold()`` and the supervisor add
no clock step over it (a short ttl such as 3 s works); over a store that can step (or does
not say), the default margin ``ttl / 10 + 2 s`` refuses a ttl of 4 s or less, with an error
naming ``safety_margin`` and ``clock_step``, which the keepers, ``Supervisor.add()`` and
``hold()`` (through ``HoldTiming``) all take.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    InvalidInput,
    Supervisor,
    hold,
)
from mos_lease.holder import HoldTiming
from mos_lease.keeper import (
    DEFAULT_CLOCK_STEP,
    AsyncLeaseKeeper,
    KeeperTiming,
    LeaseKeeper,
    default_clock_step,
)
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.core.test_keeper import IDENT, SCOPES


class SteppingStore(InMemoryLeaseStore):
    """An in-memory store that says its time can step, as a store with failover does."""

    clock_can_step: ClassVar[bool] = True


class SilentStore(InMemoryLeaseStore):
    """A custom store that does not say: it is taken to step."""

    def __getattribute__(self, name: str) -> object:
        if name == "clock_can_step":
            raise AttributeError(name)
        return super().__getattribute__(name)


def coordinator(store: InMemoryLeaseStore | None = None) -> ConnectorLeaseCoordinator:
    return ConnectorLeaseCoordinator(store if store is not None else InMemoryLeaseStore(),
                                     AllowAllPolicy())


def test_default_clock_step_follows_what_the_store_says() -> None:
    assert default_clock_step(InMemoryLeaseStore()) == 0
    assert default_clock_step(AsyncInMemoryLeaseStore()) == 0
    assert default_clock_step(SteppingStore()) == DEFAULT_CLOCK_STEP
    assert default_clock_step(SilentStore()) == DEFAULT_CLOCK_STEP
    assert default_clock_step(object()) == DEFAULT_CLOCK_STEP


def test_the_refusal_names_the_options_that_fix_it_and_where_they_go() -> None:
    with pytest.raises(ConfigurationError) as refused:
        KeeperTiming(3)
    message = str(refused.value)
    for named in ("ttl 3 s", "a ttl above 4 s", "safety_margin=", "clock_step=0",
                  "LeaseKeeper", "Supervisor.add()", "HoldTiming", "hold(timing=...)"):
        assert named in message, named
    # What it suggests works.
    assert KeeperTiming(4.5).margin == pytest.approx(2.45)
    assert KeeperTiming(3, safety_margin=0.5).margin == 0.5
    assert KeeperTiming(3, clock_step=0).margin == pytest.approx(0.3)


def test_hold_with_a_short_ttl_works_on_the_in_memory_store() -> None:
    with hold(coordinator(), IDENT, "conn-a", scopes=SCOPES, ttl=3, wait=0) as held:
        assert held.lease.epoch == 1
        assert held.options.timing.clock_step == 0
        assert held.options.timing.margin == pytest.approx(0.3)


def test_an_asyncio_hold_with_a_short_ttl_works_on_the_in_memory_store() -> None:
    async def main() -> float:
        gateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
        async with hold(gateway, IDENT, "conn-a", scopes=SCOPES, ttl=3, wait=0) as held:
            return held.options.timing.margin

    assert asyncio.run(main()) == pytest.approx(0.3)


@pytest.mark.parametrize("store", [SteppingStore, SilentStore])
def test_hold_over_a_store_that_can_step_refuses_a_short_ttl_naming_its_options(
        store: type[InMemoryLeaseStore]) -> None:
    gateway = coordinator(store())
    with pytest.raises(ConfigurationError, match=r"safety_margin=.*clock_step=0"):
        hold(gateway, IDENT, "conn-a", scopes=SCOPES, ttl=3, wait=0)
    assert gateway.current_holder(IDENT) is None  # refused before anything was written
    with hold(gateway, IDENT, "conn-a", scopes=SCOPES, ttl=3, wait=0,
              timing=HoldTiming(safety_margin=0.5)) as held:
        assert held.options.timing.margin == 0.5
        assert held._engine is not None  # the engine that renews is given it too
        assert held._engine._core.schedule.slots[IDENT].binding.timing.margin == 0.5
    with hold(gateway, IDENT, "conn-a", scopes=SCOPES, ttl=3, wait=0,
              timing=HoldTiming(clock_step=0)) as held:
        assert held.options.timing.margin == pytest.approx(0.3)


def test_hold_checks_safety_margin() -> None:
    gateway = coordinator()
    with pytest.raises(InvalidInput, match="safety_margin"):
        hold(gateway, IDENT, "conn-a", scopes=SCOPES, ttl=3,
             timing=HoldTiming(safety_margin=-1))
    with pytest.raises(InvalidInput, match="safety_margin"):
        hold(gateway, IDENT, "conn-a", scopes=SCOPES, ttl=3,
             timing=HoldTiming(safety_margin="1"))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"safety_margin must be in \[0, ttl\)"):
        hold(gateway, IDENT, "conn-a", scopes=SCOPES, ttl=3, timing=HoldTiming(safety_margin=3))
    assert gateway.current_holder(IDENT) is None


@pytest.mark.parametrize(("keyword", "group"), [("safety_margin", "timing=HoldTiming"),
                                                ("clock_step", "timing=HoldTiming"),
                                                ("on_lost", "callbacks=HoldCallbacks")])
def test_a_grouped_option_given_as_a_keyword_names_its_group(keyword: str, group: str) -> None:
    with pytest.raises(TypeError, match=rf"'{keyword}'.*{group}\({keyword}=\.\.\.\)"):
        hold(coordinator(), IDENT, "conn-a", scopes=SCOPES, ttl=3,
             **{keyword: 1})  # type: ignore[call-overload]


def test_keepers_take_the_store_default_and_the_named_options() -> None:
    keeper = LeaseKeeper(coordinator(), ttl=3)
    assert keeper.timing.clock_step == 0
    stepping = coordinator(SteppingStore())
    with pytest.raises(ConfigurationError, match="safety_margin="):
        LeaseKeeper(stepping, ttl=3)
    assert LeaseKeeper(stepping, ttl=3, safety_margin=0.5).timing.margin == 0.5
    assert LeaseKeeper(stepping, ttl=3, clock_step=0).timing.margin == pytest.approx(0.3)
    assert LeaseKeeper(stepping, ttl=30).timing.clock_step == DEFAULT_CLOCK_STEP
    gateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
    assert AsyncLeaseKeeper(gateway, ttl=3).timing.clock_step == 0


def test_supervisor_takes_the_store_default_and_the_named_options() -> None:
    with Supervisor(coordinator(), background=False) as supervisor:
        supervisor.add(IDENT, "conn-a", scopes=SCOPES, ttl=3)
    with Supervisor(coordinator(SteppingStore()), background=False) as supervisor:
        with pytest.raises(ConfigurationError, match=r"safety_margin=.*Supervisor\.add"):
            supervisor.add(IDENT, "conn-a", scopes=SCOPES, ttl=3)
        assert supervisor.bindings == []
        supervisor.add(IDENT, "conn-a", scopes=SCOPES, ttl=3, safety_margin=0.5)
        assert supervisor.bindings == [IDENT]
