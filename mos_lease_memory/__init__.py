"""In-memory adapter: the lease store, fenced effects and resource guard of one process,
their conformance harnesses and the ``mos-lease demo`` command. The clocks the store reads
its time from are the core's (:mod:`mos_lease.clock`)."""

from mos_lease_memory.effects import fenced_effect, fenced_effect_async
from mos_lease_memory.fencing import AsyncInMemoryResourceGuard, InMemoryResourceGuard
from mos_lease_memory.harness import (
    AsyncMemoryHarness,
    InspectableAsyncMemoryStore,
    MemoryHarness,
)
from mos_lease_memory.store import AsyncInMemoryLeaseStore, InMemoryLeaseStore

__all__ = [
    "AsyncInMemoryLeaseStore",
    "AsyncInMemoryResourceGuard",
    "AsyncMemoryHarness",
    "InMemoryLeaseStore",
    "InMemoryResourceGuard",
    "InspectableAsyncMemoryStore",
    "MemoryHarness",
    "fenced_effect",
    "fenced_effect_async",
]
