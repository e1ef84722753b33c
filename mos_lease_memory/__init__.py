"""In-memory lease store: the embedded default and the test double."""

from mos_lease_memory.clock import ManualClock, SystemClock
from mos_lease_memory.store import AsyncInMemoryLeaseStore, InMemoryLeaseStore

__all__ = ["AsyncInMemoryLeaseStore", "InMemoryLeaseStore", "ManualClock", "SystemClock"]
