"""Every denial reason, provoked through the coordinator on PostgreSQL and found in the
audit log (validation denials included; ``store_unavailable`` cannot reach an unreachable
log, so it is checked on the result only)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import uuid4

import attrs
import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    DenyAllPolicy,
    LeaseHandle,
    LeaseIdentity,
    Reason,
    StaticConnectorPolicy,
)
from mos_lease.identity import MAX_EPOCH
from mos_lease_pg import ConnectionSettings
from tests.pg_fixtures import StoreFactory
from tests.pg_support import FaultProxy

pytestmark = pytest.mark.pg

SCOPES = ["tool:read", "tool:run"]


class Seen:
    """Collects every reason a result reported, to check that all were provoked."""

    def __init__(self) -> None:
        self.reasons: set[Reason] = set()

    def expect(self, result: Any, reason: Reason) -> None:
        assert result.reason is reason, result
        self.reasons.add(reason)


@pytest.fixture(scope="module")
def seen() -> Seen:
    return Seen()


def test_lease_state_reasons(pg_stores: StoreFactory, pg_admin: psycopg.Connection[Any],
                             pg_tenant: str, seen: Seen) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    seen.expect(gateway.takeover(ident, "c2", scopes=SCOPES, ttl=10, expected_epoch=1),
                Reason.LEASE_MISSING)
    first = gateway.acquire(ident, "c1", scopes=SCOPES, ttl=10)
    assert first.lease is not None
    seen.expect(gateway.acquire(ident, "c2", scopes=SCOPES, ttl=10), Reason.LEASE_HELD)
    seen.expect(gateway.takeover(ident, "c2", scopes=SCOPES, ttl=10, expected_epoch=2),
                Reason.EPOCH_MISMATCH)
    seen.expect(gateway.heartbeat(attrs.evolve(first.lease, lease_id=uuid4()), ttl=10),
                Reason.LEASE_REPLACED)
    seen.expect(gateway.heartbeat(attrs.evolve(first.lease, epoch=2), ttl=10),
                Reason.EPOCH_MISMATCH)
    seen.expect(gateway.heartbeat(attrs.evolve(
        first.lease, identity=LeaseIdentity(pg_tenant, "agent", "nowhere")), ttl=10),
        Reason.LEASE_MISSING)
    second = gateway.takeover(ident, "c2", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert second.lease is not None and second.lease.epoch == 2
    seen.expect(gateway.heartbeat(first.lease, ttl=10), Reason.STALE_EPOCH)
    seen.expect(gateway.release(first.lease), Reason.STALE_EPOCH)
    assert gateway.release(second.lease).ok
    seen.expect(gateway.heartbeat(second.lease, ttl=10), Reason.LEASE_RELEASED)
    seen.expect(gateway.acquire(ident, "c3", scopes=SCOPES, ttl=10), Reason.TAKEOVER_REQUIRED)
    third = gateway.takeover(ident, "c3", scopes=SCOPES, ttl=10, expected_epoch=2)
    assert third.lease is not None
    store.advance(timedelta(seconds=11))
    seen.expect(gateway.heartbeat(third.lease, ttl=10), Reason.LEASE_EXPIRED)
    seen.expect(gateway.acquire(ident, "c3", scopes=SCOPES, ttl=10), Reason.TAKEOVER_REQUIRED)
    # The bigint ceiling: set by a superuser stepping around the triggers (the schema lets
    # epochs rise by one only).
    with pg_admin.transaction():
        pg_admin.execute("SET LOCAL session_replication_role = replica")
        pg_admin.execute("UPDATE logical_agent_connector_leases SET epoch = %s"
                         " WHERE tenant_id = %s", (MAX_EPOCH, pg_tenant))
    seen.expect(gateway.takeover(ident, "c1", scopes=SCOPES, ttl=10, expected_epoch=MAX_EPOCH),
                Reason.EPOCH_EXHAUSTED)
    audited = {(r.entry.event.value, r.entry.reason) for r in store.audit(ident)
               if r.entry.reason is not None}
    assert {reason for _, reason in audited} >= {
        Reason.LEASE_MISSING, Reason.LEASE_HELD, Reason.EPOCH_MISMATCH, Reason.LEASE_REPLACED,
        Reason.STALE_EPOCH, Reason.LEASE_RELEASED, Reason.TAKEOVER_REQUIRED,
        Reason.LEASE_EXPIRED, Reason.EPOCH_EXHAUSTED}


def test_clock_behind_reason(pg_stores: StoreFactory, pg_tenant: str, seen: Seen) -> None:
    # The row is stamped by a store a minute ahead; to a store at the database clock, that
    # clock has stepped back behind the row (more in test_pg_clock_steps.py).
    ahead = ConnectorLeaseCoordinator(pg_stores(time_offset=timedelta(minutes=1)),
                                      AllowAllPolicy())
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    held = ahead.acquire(ident, "c1", scopes=SCOPES, ttl=10)
    assert held.lease is not None
    store = pg_stores()
    seen.expect(ConnectorLeaseCoordinator(store, AllowAllPolicy()).heartbeat(held.lease, ttl=10),
                Reason.CLOCK_BEHIND)
    assert [r.entry.reason for r in store.audit(ident)] == [None, Reason.CLOCK_BEHIND]


def test_policy_reasons(pg_stores: StoreFactory, pg_tenant: str, seen: Seen) -> None:
    store = pg_stores()
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    seen.expect(ConnectorLeaseCoordinator(store).acquire(ident, "c1", scopes=SCOPES, ttl=10),
                Reason.POLICY_DENIED)
    seen.expect(ConnectorLeaseCoordinator(store, DenyAllPolicy()).takeover(
        ident, "c1", scopes=SCOPES, ttl=10, expected_epoch=1), Reason.POLICY_DENIED)
    policy = StaticConnectorPolicy.from_dict({"rules": [
        {"tenant_id": pg_tenant, "logical_agent_id": "*", "binding_id": "*",
         "connector_id": "c1", "scopes": SCOPES, "max_lease_ttl": 30, "max_grant_ttl": 5},
        {"tenant_id": pg_tenant, "logical_agent_id": "*", "binding_id": "*",
         "connector_id": "c2", "scopes": ["tool:read"], "max_lease_ttl": 30,
         "max_grant_ttl": 5},
    ]})
    gateway = ConnectorLeaseCoordinator(store, policy)
    seen.expect(gateway.acquire(ident, "c1", scopes=SCOPES, ttl=60), Reason.TTL_NOT_AUTHORIZED)
    seen.expect(gateway.acquire(ident, "c2", scopes=SCOPES, ttl=10),
                Reason.SCOPE_NOT_AUTHORIZED)
    seen.expect(gateway.acquire(ident, "c3", scopes=SCOPES, ttl=10), Reason.POLICY_DENIED)
    held = gateway.acquire(ident, "c1", scopes=SCOPES, ttl=10)
    assert held.lease is not None
    seen.expect(gateway.takeover(ident, "c2", scopes=["tool:read"], ttl=10, expected_epoch=1),
                Reason.PREEMPTION_DENIED)
    seen.expect(gateway.issue_grant(held.lease, scopes=SCOPES, ttl=30),
                Reason.TTL_NOT_AUTHORIZED)
    audited = {r.entry.reason for r in store.audit(ident)}
    assert audited >= {Reason.POLICY_DENIED, Reason.TTL_NOT_AUTHORIZED,
                       Reason.SCOPE_NOT_AUTHORIZED, Reason.PREEMPTION_DENIED}


def test_grant_reasons(pg_stores: StoreFactory, pg_tenant: str, seen: Seen) -> None:
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    ident = LeaseIdentity(pg_tenant, "agent", "b1")
    held = gateway.acquire(ident, "c1", scopes=["tool:read"], ttl=60)
    assert held.lease is not None
    seen.expect(gateway.issue_grant(held.lease, scopes=SCOPES, ttl=5),
                Reason.SCOPE_NOT_AUTHORIZED)
    granted = gateway.issue_grant(held.lease, scopes=["tool:read"], ttl=5)
    grant = granted.grant
    assert grant is not None
    assert gateway.validate(grant, identity=ident, scopes=["tool:read"]).ok
    seen.expect(gateway.validate(grant, identity=ident, scopes=["tool:run"]),
                Reason.SCOPE_NOT_AUTHORIZED)
    for other, reason in (
            (LeaseIdentity(f"{pg_tenant}x", "agent", "b1"), Reason.TENANT_MISMATCH),
            (LeaseIdentity(pg_tenant, "agent-x", "b1"), Reason.AGENT_MISMATCH),
            (LeaseIdentity(pg_tenant, "agent", "b2"), Reason.BINDING_MISMATCH)):
        seen.expect(gateway.validate(grant, identity=other, scopes=["tool:read"]), reason)
    other_gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    seen.expect(other_gateway.validate(grant, identity=ident, scopes=["tool:read"]),
                Reason.GRANT_UNKNOWN)
    store.advance(timedelta(seconds=6))
    seen.expect(gateway.validate(grant, identity=ident, scopes=["tool:read"]),
                Reason.GRANT_EXPIRED)
    # A grant dies with its lease's epoch: a takeover fences it.
    fresh = gateway.issue_grant(held.lease, scopes=["tool:read"], ttl=5).grant
    assert fresh is not None
    assert gateway.takeover(ident, "c2", scopes=["tool:read"], ttl=10, expected_epoch=1).ok
    seen.expect(gateway.validate(fresh, identity=ident, scopes=["tool:read"]),
                Reason.STALE_EPOCH)
    validations = {r.entry.reason for r in store.audit(ident)
                   if r.entry.event.value == "grant_validate"}
    assert validations >= {Reason.SCOPE_NOT_AUTHORIZED, Reason.GRANT_UNKNOWN,
                           Reason.GRANT_EXPIRED, Reason.STALE_EPOCH}


def test_validation_fails_closed_without_the_database(pg_dsn: str, pg_stores: StoreFactory,
                                                      pg_tenant: str, seen: Seen) -> None:
    proxy = FaultProxy(pg_dsn)
    try:
        store = pg_stores(proxy.dsn, settings=ConnectionSettings(prepare=False))
        gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
        ident = LeaseIdentity(pg_tenant, "agent", "b1")
        held = gateway.acquire(ident, "c1", scopes=SCOPES, ttl=30)
        assert held.lease is not None
        grant = gateway.issue_grant(held.lease, scopes=SCOPES, ttl=10).grant
        assert grant is not None
        proxy.refuse()
        seen.expect(gateway.validate(grant, identity=ident, scopes=SCOPES),
                    Reason.STORE_UNAVAILABLE)
    finally:
        proxy.close()


def test_unknown_handle_fields_are_refused_not_trusted(pg_stores: StoreFactory,
                                                       pg_tenant: str) -> None:
    # A hand-built handle naming a lease that does not exist is refused by the store's full
    # match, not by anything cached in the coordinator.
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    forged = LeaseHandle(LeaseIdentity(pg_tenant, "agent", "b9"), "c1", uuid4(), 1,
                         ("tool:run",), datetime.now(UTC))
    assert gateway.heartbeat(forged, ttl=10).reason is Reason.LEASE_MISSING
    assert gateway.release(forged).reason is Reason.LEASE_MISSING


def test_every_reason_was_provoked(seen: Seen) -> None:
    # Runs last in this module: the tests above fill ``seen``.
    missing = set(Reason) - seen.reasons
    assert not missing, f"reasons never provoked on PostgreSQL: {sorted(missing)}"
