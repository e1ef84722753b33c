"""``ConnectionSettings(audit_heartbeats=False)``: a successful heartbeat (single or batched)
writes no audit row; every denial, including a denied heartbeat, and every acquire,
takeover, release and grant issue still does; the default audits everything. A lost
unaudited heartbeat cannot be reconciled from the log, so reconcile says so
(``CommitOutcomeUnknown``) instead of answering "not committed" for a renewal that
happened."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.errors import CommitOutcomeUnknown, ConfigurationError
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.reconcile import IN_DOUBT
from tests.pg_fixtures import StoreFactory
from tests.pg_support import FaultProxy

pytestmark = pytest.mark.pg

QUIET = ConnectionSettings(audit_heartbeats=False, prepare=False)


def _trail(store: PostgresLeaseStore, identity: LeaseIdentity) -> list[tuple[str, str]]:
    return [(r.entry.event.value, r.entry.outcome.value) for r in store.audit(identity)]


@pytest.fixture
def forgetful() -> Iterator[None]:
    yield
    IN_DOUBT.clear()


def test_the_default_audits_every_heartbeat(pg_stores: StoreFactory, pg_tenant: str) -> None:
    assert ConnectionSettings().audit_heartbeats is True
    store = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "a", "b")
    lease = gateway.acquire(identity, "c", scopes=["tool:run"], ttl=30).lease
    assert lease is not None
    assert gateway.heartbeat(lease, ttl=30).ok
    assert gateway.heartbeat_many([lease, lease], ttl=30)[0].ok
    assert _trail(store, identity).count(("heartbeat", "renewed")) >= 2


def test_without_heartbeat_audit_everything_else_is_still_audited(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores(settings=QUIET)
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identities = [LeaseIdentity(pg_tenant, "a", f"b{i}") for i in range(3)]
    leases = []
    for identity in identities:
        acquired = gateway.acquire(identity, "c1", scopes=["tool:run"], ttl=30)
        assert acquired.lease is not None
        leases.append(acquired.lease)
    for _ in range(3):
        assert gateway.heartbeat(leases[0], ttl=30).ok
    assert all(r.ok for r in gateway.heartbeat_many(leases, ttl=30))
    assert gateway.issue_grant(leases[0], scopes=["tool:run"], ttl=10).ok
    taken = gateway.takeover(identities[0], "c2", scopes=["tool:run"], ttl=30,
                             expected_epoch=1, correlation_id="take")
    assert taken.lease is not None
    denied = gateway.heartbeat(leases[0], ttl=30)  # the old holder, superseded
    assert not denied.ok
    assert gateway.release(taken.lease).ok
    assert _trail(store, identities[0]) == [
        ("acquire", "acquired"), ("grant_issue", "grant_issued"), ("takeover", "taken_over"),
        ("heartbeat", "denied"), ("release", "released")]
    for identity in identities[1:]:
        assert _trail(store, identity) == [("acquire", "acquired")]
    # The renewals happened all the same.
    (renewed,) = [row for row in store.leases(pg_tenant) if row.identity == identities[1]]
    assert renewed.heartbeat_at > renewed.acquired_at


def test_a_lost_unaudited_heartbeat_is_unknown_not_denied(
        proxy: FaultProxy, pg_stores: StoreFactory, pg_tenant: str,
        forgetful: None) -> None:
    store = pg_stores(proxy.dsn, settings=QUIET)
    observer = pg_stores()
    gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "a", "b")
    lease = gateway.acquire(identity, "c", scopes=["tool:run"], ttl=30).lease
    assert lease is not None
    (before,) = observer.leases(pg_tenant)
    # The renewal commits; its reply never comes back.
    proxy.cut_reply_to(b"SET heartbeat_at = t.now")
    with pytest.raises(CommitOutcomeUnknown) as unknown:
        gateway.heartbeat(lease, ttl=30)
    (after,) = observer.leases(pg_tenant)
    assert after.heartbeat_at > before.heartbeat_at  # it did renew
    # The log has no row for it, so "not committed" would be false: reconcile says unknown,
    # however often it is asked.
    for _ in range(2):
        with pytest.raises(CommitOutcomeUnknown):
            gateway.reconcile(identity, unknown.value.event_id)
    assert _trail(observer, identity) == [("acquire", "acquired")]
    # Heartbeating again is the way on.
    assert gateway.heartbeat(lease, ttl=30).ok


def test_the_switch_takes_only_a_flag() -> None:
    for value in ("no", 0, None):
        with pytest.raises(ConfigurationError, match="audit_heartbeats"):
            ConnectionSettings(audit_heartbeats=value)  # type: ignore[arg-type]
