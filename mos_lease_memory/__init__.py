"""In-memory adapter: the resource guard (``mos_lease_memory.fencing``), and the in-memory
store and its clocks under their former names (they live in ``mos_lease.memory`` and
``mos_lease.clock``, so that the core imports no sibling package)."""

from mos_lease.clock import ManualClock, SystemClock
from mos_lease.memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore

__all__ = ["AsyncInMemoryLeaseStore", "InMemoryLeaseStore", "ManualClock", "SystemClock"]
