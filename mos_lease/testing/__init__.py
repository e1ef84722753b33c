"""Conformance kit for lease stores (needs the ``dev`` extra: Hypothesis and pytest).

To check a new store, give the kit a factory of :class:`StoreHarness` objects (your store
plus a way to move its time authority forward) and run:

* :func:`make_lease_machine` — the stateful specification; in a test module write
  ``TestMyStore = make_lease_machine(my_factory).TestCase``;
* :func:`run_store_contract` — the write-guard contract of :class:`~mos_lease.LeaseStore`.

Both shipped stores pass both (``tests/test_conformance.py``).
"""

from mos_lease.testing.contract import run_store_contract
from mos_lease.testing.harness import InspectableStore, MemoryHarness, StoreHarness
from mos_lease.testing.oracle import Oracle
from mos_lease.testing.stateful import make_lease_machine

__all__ = [
    "InspectableStore",
    "MemoryHarness",
    "Oracle",
    "StoreHarness",
    "make_lease_machine",
    "run_store_contract",
]
