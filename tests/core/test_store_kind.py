"""A coordinator refuses a store of the other kind when it is built, naming the class that
takes it, instead of failing at its first call (a synchronous coordinator over an asyncio
store got a coroutine where a snapshot was due: ``AttributeError: 'coroutine' object has no
attribute 'row'``; the reverse awaited a snapshot: a ``TypeError``). The kind is read from
the store's ``load``, so a store of one's own is judged like the library's."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from uuid import UUID

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConfigurationError,
    ConnectorLeaseCoordinator,
)
from mos_lease.identity import LeaseIdentity
from mos_lease.machine import Renew, Write
from mos_lease.records import AuditEntry, Snapshot, WriteOutcome
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.core.test_keeper import IDENT


class OwnAsyncStore:
    """An asyncio store of one's own, delegating to the in-memory one."""

    def __init__(self) -> None:
        self.inner = AsyncInMemoryLeaseStore()

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        return await self.inner.load(identity)

    async def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        return await self.inner.apply(write, entry)

    async def renew_many(self, renewals: Sequence[tuple[Renew, AuditEntry]]
                         ) -> Sequence[WriteOutcome]:
        return await self.inner.renew_many(renewals)

    async def record(self, entry: AuditEntry) -> None:
        await self.inner.record(entry)

    async def record_many(self, entries: Sequence[AuditEntry]) -> None:
        await self.inner.record_many(entries)

    async def event_committed(self, event_id: UUID) -> bool:
        return await self.inner.event_committed(event_id)


class OwnSyncStore:
    """A synchronous store of one's own, delegating to the in-memory one."""

    def __init__(self) -> None:
        self.inner = InMemoryLeaseStore()

    def load(self, identity: LeaseIdentity) -> Snapshot:
        return self.inner.load(identity)

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        return self.inner.apply(write, entry)

    def renew_many(self, renewals: Sequence[tuple[Renew, AuditEntry]]
                   ) -> Sequence[WriteOutcome]:
        return self.inner.renew_many(renewals)

    def record(self, entry: AuditEntry) -> None:
        self.inner.record(entry)

    def record_many(self, entries: Sequence[AuditEntry]) -> None:
        self.inner.record_many(entries)

    def event_committed(self, event_id: UUID) -> bool:
        return self.inner.event_committed(event_id)


@pytest.mark.parametrize("store", [AsyncInMemoryLeaseStore, OwnAsyncStore])
def test_a_synchronous_coordinator_refuses_an_asyncio_store_naming_the_right_class(
        store: type[object]) -> None:
    with pytest.raises(ConfigurationError) as refused:
        ConnectorLeaseCoordinator(store(), AllowAllPolicy())  # type: ignore[arg-type]
    message = str(refused.value)
    assert f"{store.__name__} is an asyncio store" in message
    assert "use AsyncConnectorLeaseCoordinator" in message


@pytest.mark.parametrize("store", [InMemoryLeaseStore, OwnSyncStore])
def test_an_asyncio_coordinator_refuses_a_synchronous_store_naming_the_right_class(
        store: type[object]) -> None:
    with pytest.raises(ConfigurationError) as refused:
        AsyncConnectorLeaseCoordinator(store(), AllowAllPolicy())  # type: ignore[arg-type]
    message = str(refused.value)
    assert f"{store.__name__} is a synchronous store" in message
    assert "use ConnectorLeaseCoordinator" in message


@pytest.mark.parametrize("kind", [ConnectorLeaseCoordinator, AsyncConnectorLeaseCoordinator])
@pytest.mark.parametrize("store", [None, "postgresql://x", object()])
def test_something_that_is_no_store_is_refused(kind: type[object], store: object) -> None:
    with pytest.raises(ConfigurationError, match="needs a lease store"):
        kind(store, AllowAllPolicy())  # type: ignore[call-arg]


def test_stores_of_the_right_kind_are_taken_and_work() -> None:
    for sync_store in (InMemoryLeaseStore(), OwnSyncStore()):
        gateway = ConnectorLeaseCoordinator(sync_store, AllowAllPolicy())
        assert gateway.acquire(IDENT, "conn-a", scopes=["tool:run"], ttl=30).ok

    async def main() -> None:
        for async_store in (AsyncInMemoryLeaseStore(), OwnAsyncStore()):
            gateway = AsyncConnectorLeaseCoordinator(async_store, AllowAllPolicy())
            assert (await gateway.acquire(IDENT, "conn-a", scopes=["tool:run"], ttl=30)).ok

    asyncio.run(main())


def test_keepers_refuse_a_coordinator_of_the_other_kind_naming_the_right_keeper() -> None:
    from mos_lease.keeper import AsyncLeaseKeeper, LeaseKeeper

    sync = ConnectorLeaseCoordinator(InMemoryLeaseStore(), AllowAllPolicy())
    asynchronous = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
    with pytest.raises(ConfigurationError, match="use AsyncLeaseKeeper with it"):
        LeaseKeeper(asynchronous, ttl=30)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="use LeaseKeeper with it"):
        AsyncLeaseKeeper(sync, ttl=30)  # type: ignore[arg-type]
