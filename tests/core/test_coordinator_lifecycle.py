"""Lifecycle semantics of the synchronous coordinator: epochs, lease ids, release,
expiry by the store clock, fencing by takeover, correlation ids and defaults."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from mos_lease import (
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    LeaseHandle,
    Outcome,
    Reason,
)
from mos_lease.vocabulary import LeaseState
from mos_lease_memory import InMemoryLeaseStore
from tests.helpers import IDENT, OTHER_IDENT, SCOPES, CountingIds, expire, make_env, row_of


def test_acquire_gives_epoch_one_and_store_time_expiry() -> None:
    env = make_env()
    result = env.coordinator.acquire(IDENT, "conn-a", scopes=["b", "a", "b"], ttl=30,
                                     correlation_id="req-1")
    assert result.outcome is Outcome.ACQUIRED
    assert result.ok and result.reason is None and not result.reconciled
    assert result.correlation_id == "req-1"
    lease = result.lease
    assert lease is not None
    assert lease.epoch == 1 and result.current_epoch == 1
    assert lease.scopes == ("a", "b")
    assert lease.expires_at == env.clock.now() + timedelta(seconds=30)
    row = row_of(env.store)
    assert LeaseHandle.of(row) == lease
    assert row.acquired_at == row.heartbeat_at == row.updated_at == env.clock.now()
    assert row.released_at is None


def test_takeover_increments_by_one_and_rotates_the_lease_id() -> None:
    env = make_env()
    lease = env.acquire()
    seen_ids = {lease.lease_id}
    current = lease
    for expected in range(1, 30):
        result = env.coordinator.takeover(IDENT, f"conn-{expected % 3}", scopes=SCOPES,
                                          ttl=10, expected_epoch=expected)
        assert result.outcome is Outcome.TAKEN_OVER
        assert result.lease is not None
        assert result.lease.epoch == expected + 1 == current.epoch + 1
        assert result.lease.lease_id not in seen_ids
        seen_ids.add(result.lease.lease_id)
        current = result.lease
    assert row_of(env.store).epoch == 30
    assert len(env.rows()) == 1


def test_release_keeps_the_epoch_and_only_takeover_follows() -> None:
    env = make_env()
    lease = env.acquire()
    taken = env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10,
                                     expected_epoch=1).lease
    assert taken is not None
    released = env.coordinator.release(taken)
    assert released.outcome is Outcome.RELEASED
    assert released.lease is not None and released.lease.epoch == 2
    row = row_of(env.store)
    assert row.epoch == 2 and row.state(env.clock.now()) is LeaseState.RELEASED
    assert row.released_at == env.clock.now()
    again = env.coordinator.takeover(IDENT, "conn-a", scopes=SCOPES, ttl=10, expected_epoch=2)
    assert again.lease is not None and again.lease.epoch == 3
    assert lease.epoch == 1


@pytest.mark.parametrize("how", ["expired", "released"])
def test_nothing_but_takeover_revives_a_dead_lease(how: str) -> None:
    env = make_env()
    lease = env.acquire(ttl=10)
    if how == "expired":
        expire(env, lease)
        dead = Reason.LEASE_EXPIRED
    else:
        assert env.coordinator.release(lease).ok
        dead = Reason.LEASE_RELEASED
    frozen = row_of(env.store)
    c = env.coordinator
    assert c.heartbeat(lease, ttl=10).reason is dead
    assert c.release(lease).reason is dead
    assert c.issue_grant(lease, scopes=[], ttl=5).reason is dead
    for who in ("conn-a", "conn-b"):
        assert c.acquire(IDENT, who, scopes=SCOPES, ttl=10).reason is Reason.TAKEOVER_REQUIRED
    assert row_of(env.store) == frozen
    revived = c.takeover(IDENT, "conn-a", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert revived.ok and revived.lease is not None and revived.lease.epoch == 2


def test_heartbeat_moves_expiry_to_store_time_plus_ttl() -> None:
    env = make_env()
    lease = env.acquire(ttl=10)
    env.clock.advance(9)
    result = env.coordinator.heartbeat(lease, ttl=timedelta(seconds=20))
    assert result.outcome is Outcome.RENEWED and result.lease is not None
    assert result.lease.expires_at == env.clock.now() + timedelta(seconds=20)
    assert result.lease.epoch == 1 and result.lease.lease_id == lease.lease_id
    row = row_of(env.store)
    assert row.heartbeat_at == env.clock.now()
    assert row.acquired_at == env.clock.now() - timedelta(seconds=9)
    # The original handle still names the lease: heartbeat matches identity, not expiry.
    env.clock.advance(15)
    assert env.coordinator.heartbeat(lease, ttl=5).ok


def test_expiry_is_judged_by_the_store_clock_not_the_wall_clock() -> None:
    # The store lives in 2001: by the wall clock this lease expired decades ago.
    env = make_env(start=datetime(2001, 1, 1, tzinfo=UTC))
    lease = env.acquire(ttl=10)
    assert lease.expires_at < datetime.now(UTC)
    env.clock.advance(timedelta(seconds=9, microseconds=999_999))
    assert env.coordinator.heartbeat(lease, ttl=10).ok
    grant = env.grant(lease, ttl=5)
    assert env.coordinator.validate(grant, identity=IDENT, scopes=["tool:run"]).ok
    # And in the far future: the store says expired although no wall time has passed.
    future = make_env(start=datetime(2999, 1, 1, tzinfo=UTC))
    far = future.acquire(ttl=10)
    future.clock.advance(10)
    assert future.coordinator.heartbeat(far, ttl=10).reason is Reason.LEASE_EXPIRED


def test_denials_report_the_current_epoch() -> None:
    env = make_env()
    env.acquire()
    c = env.coordinator
    assert c.takeover(IDENT, "b", scopes=SCOPES, ttl=10, expected_epoch=1).current_epoch == 2
    assert c.acquire(IDENT, "c", scopes=SCOPES, ttl=10).current_epoch == 2
    assert c.takeover(IDENT, "c", scopes=SCOPES, ttl=10, expected_epoch=9).current_epoch == 2
    assert c.takeover(OTHER_IDENT, "c", scopes=SCOPES, ttl=10,
                      expected_epoch=1).current_epoch is None
    deny = ConnectorLeaseCoordinator(env.store, id_source=CountingIds())
    assert deny.acquire(IDENT, "c", scopes=SCOPES, ttl=10).current_epoch is None


def test_takeover_fences_every_old_grant_and_handle() -> None:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    grants = [env.grant(lease, [scope], ttl=30) for scope in SCOPES]
    for grant in grants:
        assert c.validate(grant, identity=IDENT, scopes=grant.scopes).ok
    taken = c.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert taken.lease is not None
    for grant in grants:
        assert c.validate(grant, identity=IDENT, scopes=grant.scopes).reason is (
            Reason.STALE_EPOCH)
        calls: list[ConnectorExecutionContext] = []
        assert c.invoke(grant, calls.append, identity=IDENT,
                        scopes=grant.scopes).reason is Reason.STALE_EPOCH
        assert calls == []
    assert c.heartbeat(lease, ttl=10).reason is Reason.STALE_EPOCH
    assert c.release(lease).reason is Reason.STALE_EPOCH
    assert c.issue_grant(lease, scopes=[], ttl=5).reason is Reason.STALE_EPOCH
    fresh = env.grant(taken.lease)
    assert c.validate(fresh, identity=IDENT, scopes=["tool:run"]).ok
    assert row_of(env.store).connector_id == "conn-b"


def test_correlation_ids_are_propagated_or_generated() -> None:
    env = make_env()
    given_id = env.coordinator.acquire(IDENT, "a", scopes=SCOPES, ttl=10, correlation_id="r-9")
    assert given_id.correlation_id == "r-9"
    assert env.audit()[-1].entry.correlation_id == "r-9"
    generated = env.coordinator.acquire(OTHER_IDENT, "a", scopes=SCOPES, ttl=10)
    assert generated.correlation_id and generated.correlation_id != "r-9"
    assert env.audit()[-1].entry.correlation_id == generated.correlation_id


def test_default_policy_denies() -> None:
    coordinator = ConnectorLeaseCoordinator(InMemoryLeaseStore())
    result = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10)
    assert result.reason is Reason.POLICY_DENIED
    assert isinstance(coordinator.store, InMemoryLeaseStore)
    assert coordinator.store.leases() == []
