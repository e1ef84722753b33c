"""What a store must offer to be run through the conformance kit (sync or asyncio)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

from mos_lease.identity import LeaseIdentity
from mos_lease.ports import AsyncLeaseStore, LeaseInspector, LeaseStore
from mos_lease.records import AuditRecord, LeaseRow


class InspectableStore(LeaseStore, LeaseInspector, Protocol):
    """A store that can also be inspected (every shipped store is)."""


class AsyncLeaseInspector(Protocol):
    """The asyncio twin of :class:`~mos_lease.ports.LeaseInspector`: the reads the kit checks
    audit rows with."""

    async def leases(self, tenant_id: str | None = None) -> Sequence[LeaseRow]:
        """As :meth:`mos_lease.ports.LeaseInspector.leases`."""

    async def audit(self, identity: LeaseIdentity | None = None, *, after_seq: int = 0,
                    limit: int = 1000) -> Sequence[AuditRecord]:
        """As :meth:`mos_lease.ports.LeaseInspector.audit`."""


class AsyncInspectableStore(AsyncLeaseStore, AsyncLeaseInspector, Protocol):
    """An asyncio store that can also be inspected."""


class StoreHarness(Protocol):
    """A store under test plus a way to move its time authority forward.

    ``advance`` must move the time the store reports (and judges expiry by) forward by
    exactly ``by``. For the in-memory store that is its manual clock; for PostgreSQL it is a
    test-only offset added to ``clock_timestamp()``.

    Optional: ``hold_row(identity)``, a context manager holding ``identity``'s row from
    another transaction (PostgreSQL: ``FOR SHARE`` on another session) while its block
    runs, for a store with row locks; the kit then checks that a batch of renewals reports
    that row not reached and renews the others. A store without row locks leaves it out.
    """

    @property
    def store(self) -> InspectableStore:
        """The store under test (the same object every time)."""

    def advance(self, by: timedelta) -> None:
        """Move the store's time authority forward by exactly ``by``."""


class AsyncStoreHarness(Protocol):
    """:class:`StoreHarness` for an asyncio store; run it through
    :class:`~mos_lease.testing.EventLoopThread`."""

    @property
    def store(self) -> AsyncInspectableStore:
        """The asyncio store under test (the same object every time)."""

    async def advance(self, by: timedelta) -> None:
        """Move the store's time authority forward by exactly ``by``."""
