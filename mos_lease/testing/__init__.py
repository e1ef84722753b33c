"""Conformance kit for lease stores and resource guards (needs the ``testing`` extra).

To check a new store, give the kit a factory of :class:`StoreHarness` objects (your store
plus a way to move its time authority forward) and run:

* :func:`make_lease_machine` — the stateful specification; in a test module write
  ``TestMyStore = make_lease_machine(my_factory).TestCase``;
* :func:`run_store_contract` — the write-guard contract of :class:`~mos_lease.ports.LeaseStore`;
* :func:`make_supervisor_machine` — the supervisor's stateful specification: several
  bindings in one :class:`~mos_lease.supervisor.Supervisor`, with rival takeovers, releases,
  notices (:class:`ManualNoticeFeed`), store failures and time passing;
* :func:`make_fleet_machine` — the fleet's stateful specification: several supervisors
  with ``fleet=`` over the same bindings, joining, leaving, crashing, rejoining,
  disagreeing about the member set and handing bindings over.

A resource guard of your own is checked by :func:`run_guard_contract`.

An asyncio store gives an :class:`AsyncStoreHarness` instead and runs the same two through
:meth:`EventLoopThread.harness_factory`. Every shipped store passes both
(``tests/conformance/test_conformance.py``,
``tests/conformance/test_conformance_async.py``); the in-memory
store's harnesses are ``mos_lease_memory.MemoryHarness`` and
``mos_lease_memory.AsyncMemoryHarness``. See ``docs/writing-a-store.md``.
"""

from mos_lease.testing.contract import run_store_contract
from mos_lease.testing.driver import EventLoopThread
from mos_lease.testing.fleet_machine import make_fleet_machine
from mos_lease.testing.guard_contract import GuardFactory, run_guard_contract
from mos_lease.testing.harness import (
    AsyncInspectableStore,
    AsyncLeaseInspector,
    AsyncStoreHarness,
    InspectableStore,
    StoreHarness,
)
from mos_lease.testing.notice_feed import ManualNoticeFeed
from mos_lease.testing.oracle import Oracle
from mos_lease.testing.stateful import make_lease_machine
from mos_lease.testing.supervisor_machine import make_supervisor_machine

__all__ = [
    "AsyncInspectableStore",
    "AsyncLeaseInspector",
    "AsyncStoreHarness",
    "EventLoopThread",
    "GuardFactory",
    "InspectableStore",
    "ManualNoticeFeed",
    "Oracle",
    "StoreHarness",
    "make_fleet_machine",
    "make_lease_machine",
    "make_supervisor_machine",
    "run_guard_contract",
    "run_store_contract",
]
