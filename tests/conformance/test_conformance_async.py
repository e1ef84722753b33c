"""The conformance kit against asyncio stores, driven on one private event loop thread.

The same contract and stateful specification as ``test_conformance.py``, through
:meth:`EventLoopThread.harness_factory`; and proof that the kit catches an async store
with a planted flaw.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from uuid import UUID, uuid4

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings

from examples.store_kit import DictHarness, DictLeaseStore
from mos_lease import StoreUnavailable
from mos_lease.machine import Renew, Rotate, Write, write_outcome
from mos_lease.records import LeaseRow
from mos_lease.testing import (
    AsyncStoreHarness,
    EventLoopThread,
    StoreHarness,
    make_lease_machine,
    run_store_contract,
)
from mos_lease_memory import AsyncMemoryHarness
from mos_lease_pg import ConnectionSettings
from tests.pg_clock import ShiftedAsyncPostgresLeaseStore
from tests.pg_fixtures import PgSchema

AsyncFactory = Callable[[], AsyncStoreHarness]


@pytest.fixture(scope="module")
def loop() -> Iterator[EventLoopThread]:
    with EventLoopThread() as running:
        yield running


class PostgresAsyncHarness:
    """The asyncio PostgreSQL store; its clock moves by the store's test-only offset."""

    def __init__(self, store: ShiftedAsyncPostgresLeaseStore) -> None:
        self._store = store

    @property
    def store(self) -> ShiftedAsyncPostgresLeaseStore:
        return self._store

    async def advance(self, by: timedelta) -> None:
        self._store.advance(by)


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.pg)])
def async_factory(request: pytest.FixtureRequest, loop: EventLoopThread) -> Iterator[AsyncFactory]:
    if request.param == "memory":
        yield AsyncMemoryHarness
        return
    schema: PgSchema = request.getfixturevalue("pg_migrated_schema_dsn")

    async def opened() -> ShiftedAsyncPostgresLeaseStore:  # made on the loop that uses it
        return ShiftedAsyncPostgresLeaseStore(schema.dsn, settings=ConnectionSettings(
            schema=schema.schema))

    store = loop.run(opened())
    try:
        yield lambda: PostgresAsyncHarness(store)
    finally:
        loop.run(store.aclose())


def _machine(factory: Callable[[], StoreHarness], examples: int, *,
             shrink: bool = True) -> None:
    machine = make_lease_machine(factory)
    machine.TestCase.settings = settings(
        max_examples=examples, stateful_step_count=40, deadline=None, database=None,
        # A planted flaw is looked for in a fixed sequence of examples: found every run.
        phases=list(Phase) if shrink else [Phase.generate], derandomize=not shrink,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()


def test_async_store_contract(loop: EventLoopThread, async_factory: AsyncFactory) -> None:
    run_store_contract(loop.harness_factory(async_factory), steps=400)


def test_async_lease_state_machine(loop: EventLoopThread, async_factory: AsyncFactory) -> None:
    _machine(loop.harness_factory(async_factory), 40)


# -- the kit catches a broken async store --------------------------------------------------


def _renews_expired(write: Write, row: LeaseRow | None, new: LeaseRow | None,
                    ) -> LeaseRow | None:
    """The flaw: a heartbeat on an expired lease is judged as if just before expiry."""
    if new is None and isinstance(write, Renew) and row is not None:
        late = write_outcome(write, row, row.expires_at - timedelta(microseconds=1))
        if late is not None:
            return attrs.evolve(late, expires_at=late.heartbeat_at + write.ttl)
    return new


def _keeps_epoch(write: Write, row: LeaseRow | None, new: LeaseRow | None,
                 ) -> LeaseRow | None:
    """The flaw: a takeover rotates the lease UUID but leaves the epoch where it was."""
    if new is not None and isinstance(write, Rotate):
        return attrs.evolve(new, epoch=new.epoch - 1)
    return new


FLAWS = {"renews_expired": _renews_expired, "keeps_epoch": _keeps_epoch}


def _flawed(flaw: str) -> AsyncFactory:
    class Flawed(DictLeaseStore):
        def decide(self, write: Write, row: LeaseRow | None, now: datetime) -> LeaseRow | None:
            return FLAWS[flaw](write, row, super().decide(write, row, now))

    return lambda: DictHarness(Flawed)


@pytest.mark.parametrize("flaw", sorted(FLAWS))
def test_kit_catches_a_flawed_async_store(loop: EventLoopThread, flaw: str) -> None:
    with pytest.raises(AssertionError):
        run_store_contract(loop.harness_factory(_flawed(flaw)), steps=400)
    with pytest.raises(AssertionError):
        _machine(loop.harness_factory(_flawed(flaw)), 300, shrink=False)


def test_unflawed_example_store_passes(loop: EventLoopThread) -> None:
    """The flawed stores above differ from a passing one by their flaw alone."""
    run_store_contract(loop.harness_factory(DictHarness), steps=400)
    _machine(loop.harness_factory(DictHarness), 20)


# -- the driver itself ---------------------------------------------------------------------


def test_driver_makes_harnesses_on_its_loop_and_passes_errors_through(
        loop: EventLoopThread) -> None:
    seen: list[asyncio.AbstractEventLoop] = []

    class Recording(DictHarness):
        def __init__(self) -> None:
            seen.append(asyncio.get_running_loop())  # raises unless made on a running loop
            super().__init__(Refusing)

    class Refusing(DictLeaseStore):
        async def event_committed(self, event_id: UUID) -> bool:
            raise StoreUnavailable("down")

    harness = loop.harness_factory(Recording)()
    assert seen == [loop.run(_running())]
    with pytest.raises(StoreUnavailable, match="down"):
        harness.store.event_committed(uuid4())

    async def reentrant() -> None:
        loop.run(_running())

    with pytest.raises(RuntimeError, match="its own loop"):
        loop.run(reentrant())


async def _running() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()
