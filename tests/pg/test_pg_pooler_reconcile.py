"""Reconcile behind a transaction pooler is truthful (client -> proxy -> PgBouncer in
transaction mode -> PostgreSQL).

Behind PgBouncer the backend pid of a connection's startup is the pooler's own (a negative
number), and the backend that ran a write may serve another client next. A store must never
"end" the lost write's session by that pid: it would find it gone at once, look for the
write's audit row before the write committed, answer "not committed", and the coordinator
would send the write again. So behind a pooler (the settings made for one) no pid is noted,
and reconcile waits out the role's transactions instead; the database refuses an event id
applied twice in any case. Here a session holds the lease row ``FOR UPDATE``, the write
waits for it, only the client side is cut, and the row lock is released while reconcile
decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    CommitOutcomeUnknown,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    LeaseResult,
)
from mos_lease_pg import AsyncPostgresLeaseStore, ConnectionSettings
from mos_lease_pg.reconcile import IN_DOUBT
from tests.pg.test_pg_reconcile import AUDIT, LEASES, in_background
from tests.pg_fixtures import StoreFactory
from tests.pg_support import FaultProxy
from tests.pgbouncer import PgBouncer

pytestmark = pytest.mark.pg

POOLED = ConnectionSettings(session_options=False, prepare=False)


def lock_waiter(admin: psycopg.Connection[Any]) -> int:
    """The pid of the one backend of this database waiting for a lock."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = admin.execute("SELECT pid FROM pg_stat_activity WHERE datname ="
                              " current_database() AND wait_event_type = 'Lock'").fetchone()
        if found is not None:
            return int(found[0])
        time.sleep(0.01)
    raise AssertionError("the write never waited for the row lock")


@pytest.mark.parametrize("operation", ["heartbeat", "release"])
def test_a_write_lost_behind_a_pooler_is_applied_once_and_reconciled_truthfully(
        operation: str, pgbouncer: PgBouncer, pg_dsn: str, pg_stores: StoreFactory,
        pg_admin: psycopg.Connection[Any], pg_tenant: str,
        caplog: pytest.LogCaptureFixture) -> None:
    proxy = FaultProxy(pgbouncer.dsn(pg_dsn))
    try:
        store = pg_stores(proxy.dsn, settings=POOLED)
        coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        identity = LeaseIdentity(pg_tenant, "agent", "b1")
        acquired = coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
        assert acquired.lease is not None
        lease = acquired.lease
        holder = psycopg.connect(pg_dsn)
        holder.execute(f"SELECT 1 FROM {LEASES} WHERE tenant_id = %s FOR UPDATE", (pg_tenant,))
        try:
            worker, out = in_background(
                (lambda: coordinator.release(lease)) if operation == "release"
                else (lambda: coordinator.heartbeat(lease, ttl=60)))
            lock_waiter(pg_admin)
            with caplog.at_level(logging.WARNING, logger="mos_lease"):
                proxy.cut_client()
                time.sleep(0.3)  # reconcile is deciding meanwhile
                holder.commit()  # the lost write now commits
                worker.join(timeout=30)
        finally:
            holder.close()
        assert not worker.is_alive()
        [result] = out
    finally:
        proxy.close()
    rows = pg_admin.execute(f"SELECT event_id, event, outcome FROM {AUDIT} WHERE tenant_id = %s"
                            f" AND event = %s", (pg_tenant, operation)).fetchall()
    # Applied once, whatever happened: one audit row, one event id.
    assert len(rows) == 1, rows
    [(event_id, _event, outcome)] = rows
    # Truthful or unknown, never wrong: the caller is told what the database holds.
    assert isinstance(result, LeaseResult | CommitOutcomeUnknown), result
    if isinstance(result, LeaseResult):
        assert result.ok and result.outcome.value == outcome
    assert "committed=False" not in caplog.text, caplog.text
    assert IN_DOUBT.get(event_id) is None


def test_behind_pooler_settings_no_startup_pid_is_trusted(pgbouncer: PgBouncer, pg_dsn: str,
                                                          pg_stores: StoreFactory) -> None:
    store = pg_stores(pgbouncer.dsn(pg_dsn), settings=POOLED)
    with store._source.checkout() as wire:
        # libpq was told the pooler's own key, which names no backend of the server.
        answered = wire.conn.execute("SELECT pg_backend_pid()", prepare=False).fetchone()
        assert answered is not None and answered[0] != wire.conn.info.backend_pid
        assert wire.backend_pid is None
    direct = pg_stores(pg_dsn)
    with direct._source.checkout() as wire:  # checked at first use to be the backend's
        assert wire.backend_pid == wire.conn.info.backend_pid > 0

    async def asyncio_store() -> int | None:
        async with (AsyncPostgresLeaseStore(pgbouncer.dsn(pg_dsn), settings=POOLED) as store,
                    store._source.checkout() as wire):
            return wire.backend_pid

    assert asyncio.run(asyncio_store()) is None
