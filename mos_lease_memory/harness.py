"""The in-memory store's conformance harnesses: the store on a manual clock, which the kit
(:mod:`mos_lease.testing`) runs its stateful specification and store contract against."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from mos_lease.clock import ManualClock
from mos_lease.identity import LeaseIdentity
from mos_lease.records import AuditRecord, LeaseRow
from mos_lease_memory.store import AsyncInMemoryLeaseStore, InMemoryLeaseStore


class MemoryHarness:
    """The in-memory store on a manual clock."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self._store = InMemoryLeaseStore(self.clock)

    @property
    def store(self) -> InMemoryLeaseStore:
        """The in-memory store on this harness's manual clock."""
        return self._store

    def advance(self, by: timedelta) -> None:
        """Advance the manual clock by ``by``."""
        self.clock.advance(by)


class InspectableAsyncMemoryStore(AsyncInMemoryLeaseStore):
    """:class:`~mos_lease_memory.AsyncInMemoryLeaseStore` with asyncio inspection reads
    (the store's writes and loads are its own, unchanged)."""

    async def leases(self, tenant_id: str | None = None) -> Sequence[LeaseRow]:
        """As :meth:`mos_lease_memory.InMemoryLeaseStore.leases`."""
        return self.sync.leases(tenant_id)

    async def audit(self, identity: LeaseIdentity | None = None, *, after_seq: int = 0,
                    limit: int = 1000) -> Sequence[AuditRecord]:
        """As :meth:`mos_lease_memory.InMemoryLeaseStore.audit`."""
        return self.sync.audit(identity, after_seq=after_seq, limit=limit)


class AsyncMemoryHarness:
    """The asyncio in-memory store on a manual clock."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self._store = InspectableAsyncMemoryStore(InMemoryLeaseStore(self.clock))

    @property
    def store(self) -> InspectableAsyncMemoryStore:
        """The asyncio in-memory store on this harness's manual clock."""
        return self._store

    async def advance(self, by: timedelta) -> None:
        """Advance the manual clock by ``by``."""
        self.clock.advance(by)
