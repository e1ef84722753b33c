"""Events name the PostgreSQL store's system as OpenTelemetry's ``db.system`` does (the
in-memory and declared systems: ``tests/core/test_events.py``)."""

from __future__ import annotations

from mos_lease.events import store_system
from mos_lease_pg import PostgresLeaseStore


def test_store_system_names_the_postgresql_store() -> None:
    assert store_system(object.__new__(PostgresLeaseStore)) == "postgresql"
