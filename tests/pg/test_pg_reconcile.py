"""Reconciliation is truthful.

A write whose connection is lost while it waits behind a lock on the audit table has not
reached its row yet. If reconcile looks for its audit event before that session is over,
it can answer "not committed" and the write commits a moment later: the caller gets a
denial whose audit row is silently dropped, or ``InternalInconsistency`` for a renewal that
succeeded. Here the write is blocked by ``LOCK TABLE ... IN ACCESS EXCLUSIVE MODE`` in a
second session, only the client side of the proxy is cut (the server's session runs on),
and the table lock is released while reconcile is deciding: whatever it answers must be
what the database finally holds, and every attempt's audit row must be there exactly once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    CommitOutcomeUnknown,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    LeaseResult,
)
from mos_lease.ids import uuid7
from mos_lease.machine import Renew
from mos_lease.records import AuditEntry
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from tests.pg_fixtures import StoreFactory
from tests.pg_support import FaultProxy, unique_name

pytestmark = pytest.mark.pg

AUDIT = "mos_lease.connector_lease_audit_log"
LEASES = "mos_lease.logical_agent_connector_leases"


def waiting_backend(admin: psycopg.Connection[Any], application: str) -> int:
    """The pid of ``application``'s backend once it waits for a lock."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = admin.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s"
                              " AND wait_event_type = 'Lock'", (application,)).fetchone()
        if found is not None:
            return int(found[0])
        time.sleep(0.01)
    raise AssertionError(f"{application} never waited for a lock")


def audit_rows(admin: psycopg.Connection[Any], **where: object) -> list[tuple[Any, ...]]:
    column, value = next(iter(where.items()))
    return admin.execute(f"SELECT event, outcome, reason FROM {AUDIT} WHERE {column} = %s",
                         (value,)).fetchall()


def in_background(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``call`` in a thread; its result (or exception) lands in the returned list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


class TableLock:
    """A second session holding the audit table in ACCESS EXCLUSIVE mode until released."""

    def __init__(self, dsn: str) -> None:
        self._conn = psycopg.connect(dsn)
        self._conn.execute(f"LOCK TABLE {AUDIT} IN ACCESS EXCLUSIVE MODE")

    def release(self, after: float = 0.0) -> None:
        time.sleep(after)
        self._conn.commit()
        self._conn.close()


def through_proxy(proxy: FaultProxy, pg_stores: StoreFactory) -> tuple[PostgresLeaseStore, str]:
    """A store through the proxy, named so that its backend can be found. Unprepared: a
    statement prepared on first use would be blocked (and lost) in its Parse, before the
    write itself was ever sent."""
    application = unique_name("lost")
    settings = ConnectionSettings(application_name=application, prepare=False)
    return pg_stores(proxy.dsn, settings=settings), application


@pytest.mark.parametrize("operation", ["release", "heartbeat"])
@pytest.mark.parametrize("unlock_after", [0.0, 0.3])
def test_a_write_lost_behind_a_table_lock_is_reconciled_truthfully(
        operation: str, unlock_after: float, proxy: FaultProxy, pg_dsn: str,
        pg_stores: StoreFactory, pg_admin: psycopg.Connection[Any], pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    store, application = through_proxy(proxy, pg_stores)
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    acquired = coordinator.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
    assert acquired.lease is not None
    lease = acquired.lease
    before = pg_admin.execute(f"SELECT heartbeat_at FROM {LEASES} WHERE tenant_id = %s",
                              (pg_tenant,)).fetchone()
    lock = TableLock(pg_dsn)
    try:
        worker, out = in_background(
            (lambda: coordinator.release(lease)) if operation == "release"
            else (lambda: coordinator.heartbeat(lease, ttl=60)))
        waiting_backend(pg_admin, application)
        proxy.cut_client()
    finally:
        lock.release(after=unlock_after)
    worker.join(timeout=20)
    assert not worker.is_alive()
    [result] = out
    # Never an error for a write that the database settled one way or the other.
    assert isinstance(result, LeaseResult), result
    row = pg_admin.execute(f"SELECT released_at, heartbeat_at FROM {LEASES}"
                           " WHERE tenant_id = %s", (pg_tenant,)).fetchone()
    assert row is not None and before is not None
    rows = audit_rows(pg_admin, correlation_id=result.correlation_id)
    # Exactly one audit row for the attempt, and it says what the caller was told.
    assert rows == [(operation, result.outcome.value,
                     None if result.reason is None else result.reason.value)]
    if operation == "release":
        assert result.ok == (row[0] is not None)
    else:
        assert result.ok == (row[1] > before[0])
    # The lost write was ended before the event was looked for, then written again.
    assert result.ok


def _blocked_renewal(proxy: FaultProxy, pg_stores: StoreFactory, pg_admin: psycopg.Connection[Any],
                     pg_dsn: str, identity: LeaseIdentity) -> tuple[UUID, TableLock]:
    """A renewal sent through the proxy, blocked behind a table lock, its client side cut:
    returns its audit event id (the store raised CommitOutcomeUnknown) and the lock."""
    store, application = through_proxy(proxy, pg_stores)
    acquired = ConnectorLeaseCoordinator(store, AllowAllPolicy()).acquire(
        identity, "c1", scopes=["tool:run"], ttl=30)
    assert acquired.lease is not None
    lease = acquired.lease
    entry = AuditEntry(uuid7(), LifecycleEvent.HEARTBEAT, Outcome.RENEWED, None, identity,
                       "c1", lease.epoch, "reconcile-test")
    write = Renew(identity, "c1", lease.lease_id, lease.epoch, timedelta(seconds=60))
    lock = TableLock(pg_dsn)
    worker, out = in_background(lambda: store.apply(write, entry))
    waiting_backend(pg_admin, application)
    proxy.cut_client()
    worker.join(timeout=20)
    [raised] = out
    assert isinstance(raised, CommitOutcomeUnknown)
    assert raised.event_id == entry.event_id
    return entry.event_id, lock


def test_public_reconcile_from_a_new_store_ends_the_remembered_backend(
        proxy: FaultProxy, pg_dsn: str, pg_stores: StoreFactory,
        pg_admin: psycopg.Connection[Any], pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    event_id, lock = _blocked_renewal(proxy, pg_stores, pg_admin, pg_dsn, identity)
    # A new store through the same proxy (the same server as far as it can tell).
    later = ConnectorLeaseCoordinator(pg_stores(proxy.dsn), AllowAllPolicy())
    worker, out = in_background(lambda: later.reconcile(identity, event_id))
    lock.release(after=0.3)
    worker.join(timeout=20)
    [answer] = out
    assert answer is False
    time.sleep(0.3)  # give a write that could still commit every chance to
    assert audit_rows(pg_admin, event_id=event_id) == []


def test_public_reconcile_of_an_event_this_process_does_not_remember(
        proxy: FaultProxy, pg_dsn: str, pg_stores: StoreFactory,
        pg_admin: psycopg.Connection[Any], pg_tenant: str) -> None:
    from mos_lease_pg.reconcile import IN_DOUBT

    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    event_id, lock = _blocked_renewal(proxy, pg_stores, pg_admin, pg_dsn, identity)
    IN_DOUBT.clear()  # what another process knows
    later = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    worker, out = in_background(lambda: later.reconcile(identity, event_id))
    lock.release(after=0.3)
    worker.join(timeout=20)
    [answer] = out
    # The blocked write was still running when reconcile began: reconcile waited for it.
    assert answer is True
    assert audit_rows(pg_admin, event_id=event_id) == [("heartbeat", "renewed", None)]


def test_a_record_whose_event_id_another_attempt_holds_is_an_error(
        pg_store: PostgresLeaseStore, pg_admin: psycopg.Connection[Any], pg_tenant: str) -> None:
    from mos_lease.errors import InternalInconsistency
    from mos_lease.vocabulary import Reason

    identity = LeaseIdentity(pg_tenant, "agent", "b1")
    denial = AuditEntry(uuid7(), LifecycleEvent.RELEASE, Outcome.DENIED, Reason.LEASE_EXPIRED,
                        identity, "c1", 1, "first")
    pg_store.record(denial)
    pg_store.record(denial)  # the same record again (a resend): logged once, no error
    assert len(audit_rows(pg_admin, event_id=denial.event_id)) == 1
    other = AuditEntry(denial.event_id, LifecycleEvent.RELEASE, Outcome.DENIED,
                       Reason.LEASE_RELEASED, identity, "c1", 1, "second")
    with pytest.raises(InternalInconsistency, match=str(denial.event_id)):
        pg_store.record(other)
    assert audit_rows(pg_admin, event_id=denial.event_id) == [
        ("release", "denied", Reason.LEASE_EXPIRED.value)]
