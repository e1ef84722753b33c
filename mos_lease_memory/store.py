"""The in-memory store, importable from its former place; it lives in :mod:`mos_lease.memory`."""

from mos_lease.clock import Clock
from mos_lease.memory import MAX_AUDIT_PAGE, AsyncInMemoryLeaseStore, InMemoryLeaseStore

__all__ = ["MAX_AUDIT_PAGE", "AsyncInMemoryLeaseStore", "Clock", "InMemoryLeaseStore"]
