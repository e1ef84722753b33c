"""What a store must offer to be run through the conformance kit."""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

from mos_lease.clock import ManualClock
from mos_lease.memory import InMemoryLeaseStore
from mos_lease.ports import LeaseInspector, LeaseStore


class InspectableStore(LeaseStore, LeaseInspector, Protocol):
    """A store that can also be inspected (every shipped store is)."""


class StoreHarness(Protocol):
    """A store under test plus a way to move its time authority forward.

    ``advance`` must move the time the store reports (and judges expiry by) forward by
    exactly ``by``. For the in-memory store that is its manual clock; for PostgreSQL it is a
    test-only offset added to ``clock_timestamp()``.
    """

    @property
    def store(self) -> InspectableStore: ...

    def advance(self, by: timedelta) -> None: ...


class MemoryHarness:
    """The in-memory store on a manual clock."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self._store = InMemoryLeaseStore(self.clock)

    @property
    def store(self) -> InMemoryLeaseStore:
        return self._store

    def advance(self, by: timedelta) -> None:
        self.clock.advance(by)
