"""Batched heartbeats on PostgreSQL: one statement, each lease fenced and audited on its own,
and overlapping batches from several gateways never deadlock."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseHandle, LeaseIdentity
from mos_lease.vocabulary import Outcome, Reason
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg


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

    def gateway(index: int) -> None:
        coordinator = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
        rng = random.Random(index)
        try:
            for _ in range(15):
                batch = rng.sample(leases, 30)  # each batch in its own order
                results = coordinator.heartbeat_many(batch, ttl=120)
                renewed[index] += sum(r.ok for r in results)
        except BaseException as failure:
            failures.append(failure)

    threads = [threading.Thread(target=gateway, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a batch hung"
    assert not failures, failures
    assert renewed == [15 * 30] * 4
    rows: Any = setup.store.audit  # type: ignore[attr-defined]
    total = sum(len(rows(lease.identity, limit=10_000)) for lease in leases)
    assert total == 40 + 4 * 15 * 30


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
