"""The in-memory store, importable from its former place; it lives in :mod:`mos_lease.memory`."""

from mos_lease.clock import Clock
from mos_lease.memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from mos_lease.ports import MAX_AUDIT_PAGE

__all__ = ["MAX_AUDIT_PAGE", "AsyncInMemoryLeaseStore", "Clock", "InMemoryLeaseStore"]
