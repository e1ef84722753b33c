"""Batched heartbeats on PostgreSQL: one statement, each lease fenced and audited on its own,
a row another transaction holds locked costs the others nothing, and overlapping batches from
several gateways never deadlock."""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    LeaseHandle,
    LeaseIdentity,
    StoreUnavailable,
)
from mos_lease.fencing import ValidUntil
from mos_lease.ids import uuid7
from mos_lease.machine import Renew
from mos_lease.records import AuditEntry
from mos_lease.vocabulary import LifecycleEvent, Outcome, Reason
from mos_lease_pg import ConnectionSettings, sql_files
from mos_lease_pg.effects import fenced_transaction
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

# A plain share lock on one lease row, as a fenced_transaction takes it (the tables live in
# the library's schema, named explicitly).
SHARE_ROW = sql.SQL("SELECT 1 FROM {}.logical_agent_connector_leases WHERE tenant_id = %s "
                    "AND logical_agent_id = %s AND binding_id = %s FOR SHARE").format(
                        sql.Identifier(sql_files.DEFAULT_SCHEMA))


def test_a_batch_renews_the_live_and_refuses_the_stale(pg_stores: StoreFactory,
                                                       pg_tenant: str) -> None:
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    leases = []
    for i in range(20):
        got = gateway.acquire(LeaseIdentity(pg_tenant, "agent", f"b{i}"), "c1", scopes=[],
                              ttl=60)
        assert got.lease is not None
        leases.append(got.lease)
    assert gateway.release(leases[3]).ok
    stolen = gateway.takeover(leases[7].identity, "c2", scopes=[], ttl=60, expected_epoch=1)
    assert stolen.ok
    results = gateway.heartbeat_many(leases, ttl=30)
    reasons = [r.reason for r in results]
    assert reasons[3] is Reason.LEASE_RELEASED and reasons[7] is Reason.STALE_EPOCH
    assert all(r.outcome is Outcome.RENEWED for i, r in enumerate(results) if i not in (3, 7))
    audit = gateway.store.audit(leases[0].identity)  # type: ignore[attr-defined]
    assert [r.entry.outcome for r in audit] == [Outcome.ACQUIRED, Outcome.RENEWED]


def _acquired(gateway: ConnectorLeaseCoordinator, tenant: str, n: int,
              ttl: float = 60) -> list[LeaseHandle]:
    leases = []
    for i in range(n):
        got = gateway.acquire(LeaseIdentity(tenant, "agent", f"b{i}"), "c1", scopes=["s"],
                              ttl=ttl)
        assert got.lease is not None, got
        leases.append(got.lease)
    return leases


def _renewals(leases: list[LeaseHandle]) -> list[tuple[Renew, AuditEntry]]:
    return [(Renew(lease.identity, lease.connector_id, lease.lease_id, lease.epoch,
                   timedelta(seconds=90)),
             AuditEntry(uuid7(), LifecycleEvent.HEARTBEAT, Outcome.RENEWED, None,
                        lease.identity, lease.connector_id, lease.epoch, "batch"))
            for lease in leases]


def test_a_row_held_by_another_transaction_is_not_reached_and_the_rest_are_renewed(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    """The statement itself: one row held ``FOR SHARE`` by an open transaction is skipped
    (``reached=False``: not judged, not written, not audited) without waiting for the lock;
    every other row of the batch is renewed and audited; a row that does not exist is a
    failed guard, not a skipped row; once the lock goes the skipped lease renews."""
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    leases = _acquired(gateway, pg_tenant, 20)
    held = leases[5]
    missing = LeaseHandle(LeaseIdentity(pg_tenant, "agent", "never"), "c1", uuid7(), 1,
                          ("s",), held.expires_at)
    renewals = _renewals([*leases, missing])
    before = store.load(held.identity).row
    with psycopg.connect(pg_dsn) as blocker:
        blocker.execute(SHARE_ROW, (held.identity.tenant_id, held.identity.logical_agent_id,
                                    held.identity.binding_id))
        began = time.monotonic()
        outcomes = store.renew_many(renewals)
        took = time.monotonic() - began
        assert store.load(held.identity).row == before  # written nothing
        blocker.commit()
    # Not a lock wait: the store's lock_timeout (2 s) would have failed the whole statement.
    assert took < 1.0, took
    assert [o.reached for o in outcomes] == [i != 5 for i in range(21)]
    assert outcomes[5].row is None
    assert all(o.row is not None for i, o in enumerate(outcomes[:20]) if i != 5)
    assert outcomes[20].row is None and outcomes[20].reached  # missing: the guard failed
    assert not store.event_committed(renewals[5][1].event_id)
    assert all(store.event_committed(entry.event_id)
               for i, (_, entry) in enumerate(renewals[:20]) if i != 5)
    assert store.load(held.identity).row == before
    # The lock is gone: the same lease renews.
    again = store.renew_many(_renewals([held]))
    assert again[0].reached and again[0].row is not None
    assert again[0].row.expires_at > before.expires_at  # type: ignore[union-attr]


def test_heartbeat_many_beside_a_long_fenced_transaction(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    """``heartbeat_many`` while a long tool's ``fenced_transaction(valid_until=LEASE)``
    holds one binding's row: that lease's result is ``store_unavailable`` (no audit row),
    every other lease is renewed at once, and after the tool commits the next batch renews
    it too."""
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    leases = _acquired(gateway, pg_tenant, 10)
    tool = leases[3]
    grant = gateway.issue_grant(tool, scopes=["s"], ttl=10).grant
    assert grant is not None
    context = gateway.validate(grant, identity=tool.identity, scopes=["s"]).context
    assert context is not None
    with psycopg.connect(pg_dsn) as conn, fenced_transaction(
            conn, context, scopes=["s"], valid_until=ValidUntil.LEASE) as cur:
        cur.execute("SELECT 1")
        began = time.monotonic()
        results = gateway.heartbeat_many(leases, ttl=60)
        took = time.monotonic() - began
    assert took < 1.0, took
    assert results[3].outcome is Outcome.DENIED
    assert results[3].reason is Reason.STORE_UNAVAILABLE and results[3].lease is None
    assert all(r.ok and r.outcome is Outcome.RENEWED for i, r in enumerate(results) if i != 3)
    audit = gateway.store.audit(tool.identity)  # type: ignore[attr-defined]
    # Neither a renewal nor a refusal was recorded for the lease the batch did not reach.
    assert [r.entry.event for r in audit] == [LifecycleEvent.ACQUIRE,
                                              LifecycleEvent.GRANT_ISSUE]
    later = gateway.heartbeat_many([tool], ttl=60)
    assert later[0].ok, later


def test_a_single_heartbeat_waits_for_a_held_row_at_most_lock_timeout(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    """``renew.sql`` (one lease: a keeper under ``hold()``) has no other lease to hold back,
    so it still waits for the row, and is judged by a clock read once it holds it. The wait
    is bounded by ``lock_timeout``: then it fails transiently (``StoreUnavailable``, retried
    by the keeper), having written and audited nothing."""
    store = pg_stores(settings=ConnectionSettings(lock_timeout=timedelta(seconds=0.3)))
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    (lease,) = _acquired(gateway, pg_tenant, 1)
    before = store.load(lease.identity).row
    with psycopg.connect(pg_dsn) as blocker:
        blocker.execute(SHARE_ROW, (lease.identity.tenant_id, lease.identity.logical_agent_id,
                                    lease.identity.binding_id))
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match="lock timeout"):
            gateway.heartbeat(lease, ttl=60)
        took = time.monotonic() - began
        blocker.commit()
    assert 0.3 <= took < 2.0, took
    assert store.load(lease.identity).row == before
    assert [r.entry.event for r in store.audit(lease.identity)] == [LifecycleEvent.ACQUIRE]
    assert gateway.heartbeat(lease, ttl=60).ok


def test_overlapping_batches_from_several_gateways_do_not_deadlock(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    setup = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    leases: list[LeaseHandle] = []
    for i in range(40):
        got = setup.acquire(LeaseIdentity(pg_tenant, "agent", f"b{i}"), "c1", scopes=[],
                            ttl=120)
        assert got.lease is not None
        leases.append(got.lease)
    failures: list[BaseException] = []
    renewed = [0, 0, 0, 0]
    unexpected: list[Any] = []

    def gateway(index: int) -> None:
        coordinator = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
        rng = random.Random(index)
        try:
            for _ in range(15):
                batch = rng.sample(leases, 30)  # each batch in its own order
                results = coordinator.heartbeat_many(batch, ttl=120)
                renewed[index] += sum(r.ok for r in results)
                # A row another gateway's batch holds at that moment is not waited for.
                unexpected.extend(r for r in results
                                  if not r.ok and r.reason is not Reason.STORE_UNAVAILABLE)
        except BaseException as failure:
            failures.append(failure)

    threads = [threading.Thread(target=gateway, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a batch hung"
    assert not failures, failures
    assert not unexpected, unexpected
    assert all(count > 0 for count in renewed), renewed
    rows: Any = setup.store.audit  # type: ignore[attr-defined]
    total = sum(len(rows(lease.identity, limit=10_000)) for lease in leases)
    assert total == 40 + sum(renewed)  # one audit row per renewal made, none for the rest


def test_a_batch_whose_reply_is_lost_is_reconciled_lease_by_lease(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    """The set-based batch statement commits but its reply is lost: every lease in it is in
    doubt, and each is reconciled through its own audit event, renewed exactly once."""
    from mos_lease_pg import ConnectionSettings
    from tests.pg_support import FaultProxy

    proxy = FaultProxy(pg_dsn)
    try:
        gateway = ConnectorLeaseCoordinator(
            pg_stores(proxy.dsn, settings=ConnectionSettings(prepare=False)), AllowAllPolicy())
        leases = []
        for i in range(5):
            got = gateway.acquire(LeaseIdentity(pg_tenant, "agent", f"b{i}"), "c1", scopes=[],
                                  ttl=60)
            assert got.lease is not None
            leases.append(got.lease)
        proxy.cut_reply_to(b"WITH ORDINALITY")
        results = gateway.heartbeat_many(leases, ttl=30)
    finally:
        proxy.close()
    assert all(r.ok and r.reconciled for r in results), results
    observer = pg_stores()
    for lease in leases:
        outcomes = [r.entry.outcome for r in observer.audit(lease.identity)]
        assert outcomes == [Outcome.ACQUIRED, Outcome.RENEWED]


def test_a_lost_batch_reply_with_a_held_row_settles_the_others(
        pg_dsn: str, pg_stores: StoreFactory, pg_tenant: str) -> None:
    """The batch commits around a row another transaction holds, and its reply is lost:
    each lease is reconciled through its own audit event. The held one was not renewed, so
    its renewal is tried alone and meets the lock (``lock_timeout``): that lease alone is
    ``store_unavailable``; the others keep their reconciled renewals."""
    from tests.pg_support import FaultProxy

    proxy = FaultProxy(pg_dsn)
    try:
        gateway = ConnectorLeaseCoordinator(
            pg_stores(proxy.dsn, settings=ConnectionSettings(
                prepare=False, lock_timeout=timedelta(seconds=0.3))), AllowAllPolicy())
        leases = _acquired(gateway, pg_tenant, 5)
        held = leases[2].identity
        with psycopg.connect(pg_dsn) as blocker:
            blocker.execute(SHARE_ROW, (held.tenant_id, held.logical_agent_id,
                                        held.binding_id))
            proxy.cut_reply_to(b"WITH ORDINALITY")
            results = gateway.heartbeat_many(leases, ttl=30)
            blocker.commit()
    finally:
        proxy.close()
    assert results[2].reason is Reason.STORE_UNAVAILABLE, results[2]
    assert all(r.ok and r.reconciled for i, r in enumerate(results) if i != 2), results
    observer = pg_stores()
    for i, lease in enumerate(leases):
        outcomes = [r.entry.outcome for r in observer.audit(lease.identity)]
        assert outcomes == [Outcome.ACQUIRED] + ([] if i == 2 else [Outcome.RENEWED])
