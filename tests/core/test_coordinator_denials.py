"""Every denial reason, provoked for real on the in-memory store, returns a typed result
and appends exactly one matching audit row; a store that is down fails closed."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import UUID

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    ExecutionGrant,
    LeaseHandle,
    LeaseIdentity,
    Outcome,
    Reason,
    StaticConnectorPolicy,
    StoreUnavailable,
)
from mos_lease.identity import MAX_EPOCH
from mos_lease.machine import Insert
from mos_lease.records import AuditEntry, AuditRecord
from mos_lease.vocabulary import LifecycleEvent
from tests.helpers import (
    IDENT,
    OTHER_IDENT,
    SCOPES,
    CountingIds,
    Env,
    FaultyStore,
    expire,
    make_env,
    put_row,
    row_of,
)


@attrs.frozen
class Provoked:
    """One real denial: what the call returned and the audit rows it appended."""

    reason: Reason | None
    event: LifecycleEvent
    epoch: int | None
    connector_id: str
    identity: LeaseIdentity
    rows: list[AuditRecord]
    current_epoch: int | None = None
    expected_current_epoch: int | None = None


def _provoke(env: Env, event: LifecycleEvent, epoch: int | None, connector_id: str,
             call: Callable[[], Any], identity: LeaseIdentity = IDENT,
             current_epoch: int | None = None) -> Provoked:
    before = len(env.audit())
    result = call()
    return Provoked(result.reason, event, epoch, connector_id, identity, env.audit()[before:],
                    getattr(result, "current_epoch", None), current_epoch)


def _validate(env: Env, grant: Any, scopes: list[str] | None = None,
              identity: LeaseIdentity = IDENT) -> Callable[[], Any]:
    return lambda: env.coordinator.validate(grant, identity=identity,
                                            scopes=scopes or ["tool:run"])


A, H, T, R, G, V = (LifecycleEvent.ACQUIRE, LifecycleEvent.HEARTBEAT, LifecycleEvent.TAKEOVER,
                    LifecycleEvent.RELEASE, LifecycleEvent.GRANT_ISSUE,
                    LifecycleEvent.GRANT_VALIDATE)


def _lease_held() -> list[Provoked]:
    env = make_env()
    env.acquire()
    return [_provoke(env, A, None, "conn-b", lambda: env.coordinator.acquire(
        IDENT, "conn-b", scopes=SCOPES, ttl=10), current_epoch=1),
        _provoke(env, A, None, "conn-a", lambda: env.coordinator.acquire(
            IDENT, "conn-a", scopes=SCOPES, ttl=10), current_epoch=1)]


def _takeover_required() -> list[Provoked]:
    expired, released = make_env(), make_env()
    expire(expired, expired.acquire())
    assert released.coordinator.release(released.acquire()).ok
    return [_acquire_again(env, who) for env in (expired, released)
            for who in ("conn-a", "conn-b")]


def _acquire_again(env: Env, who: str) -> Provoked:
    return _provoke(env, A, None, who, lambda: env.coordinator.acquire(
        IDENT, who, scopes=SCOPES, ttl=10), current_epoch=1)


def _lease_missing() -> list[Provoked]:
    env = make_env()
    ghost = LeaseHandle(IDENT, "conn-a", UUID(int=42), 1, SCOPES, env.clock.now())
    c = env.coordinator
    return [
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(ghost, ttl=10)),
        _provoke(env, R, 1, "conn-a", lambda: c.release(ghost)),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(ghost, scopes=[], ttl=5)),
        _provoke(env, T, 3, "conn-b", lambda: c.takeover(
            IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=3)),
    ]


def _every_holder_call(env: Env, beating: LeaseHandle, closing: LeaseHandle,
                       grant: ExecutionGrant) -> list[Provoked]:
    """Heartbeat ``beating``, release and issue a grant on ``closing``, and validate
    ``grant``: every call a holder of conn-a at epoch 1 makes, each provoking the reason."""
    c = env.coordinator
    return [
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(beating, ttl=10), current_epoch=1),
        _provoke(env, R, 1, "conn-a", lambda: c.release(closing), current_epoch=1),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(closing, scopes=[], ttl=5)),
        _provoke(env, V, 1, "conn-a", _validate(env, grant)),
    ]


def _lease_expired() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire(ttl=30)
    grant = env.grant(lease, ttl=20)
    # Shorten the lease below the grant's expiry: the grant is alive, its lease is not.
    short = c.heartbeat(lease, ttl=5).lease
    assert short is not None
    env.clock.advance(6)
    return _every_holder_call(env, lease, short, grant)


def _lease_released() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    grant = env.grant(lease)
    assert c.release(lease).ok
    return _every_holder_call(env, lease, lease, grant)


def _lease_replaced() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    grant = env.grant(lease)
    other_id = attrs.evolve(lease, lease_id=UUID(int=7))
    other_conn = attrs.evolve(lease, connector_id="conn-x")
    provoked = [
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(other_id, ttl=10), current_epoch=1),
        _provoke(env, R, 1, "conn-x", lambda: c.release(other_conn), current_epoch=1),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(other_id, scopes=[], ttl=5)),
        _provoke(env, H, 1, "conn-x", lambda: c.heartbeat(other_conn, ttl=10),
                 current_epoch=1),
    ]
    # Same epoch, different lease id in the durable row (a store in a state no public call
    # reaches): the grant names a lease that is no longer current.
    put_row(env.store, attrs.evolve(row_of(env.store), lease_id=UUID(int=8)))
    provoked.append(_provoke(env, V, 1, "conn-a", _validate(env, grant)))
    return provoked


def _stale_epoch() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    grant = env.grant(lease)
    assert c.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1).ok
    return [
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(lease, ttl=10), current_epoch=2),
        _provoke(env, R, 1, "conn-a", lambda: c.release(lease), current_epoch=2),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(lease, scopes=[], ttl=5)),
        _provoke(env, V, 1, "conn-a", _validate(env, grant)),
    ]


def _epoch_mismatch() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire()
    expire(env, lease)
    future = attrs.evolve(lease, epoch=2)
    return [
        _provoke(env, T, 5, "conn-b", lambda: c.takeover(
            IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=5), current_epoch=1),
        _provoke(env, H, 2, "conn-a", lambda: c.heartbeat(future, ttl=10), current_epoch=1),
        _provoke(env, R, 2, "conn-a", lambda: c.release(future), current_epoch=1),
    ]


def _epoch_exhausted() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    entry = AuditEntry(UUID(int=99), A, Outcome.ACQUIRED, None, IDENT, "conn-a", 1, "seed")
    outcome = env.store.apply(Insert(IDENT, UUID(int=98), "conn-a", SCOPES,
                                     timedelta(seconds=10)), entry)
    assert outcome.row is not None
    put_row(env.store, attrs.evolve(outcome.row, epoch=MAX_EPOCH))
    active = [_provoke(env, T, MAX_EPOCH, "conn-b", lambda: c.takeover(
        IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=MAX_EPOCH),
        current_epoch=MAX_EPOCH)]  # AllowAllPolicy preempts, still refused
    env.clock.advance(10)
    expired = [_provoke(env, T, MAX_EPOCH, "conn-b", lambda: c.takeover(
        IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=MAX_EPOCH),
        current_epoch=MAX_EPOCH)]
    assert row_of(env.store).epoch == MAX_EPOCH
    assert row_of(env.store).connector_id == "conn-a"
    return active + expired


def _clock_behind() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire(ttl=30)
    env.clock.advance(5)
    renewed = c.heartbeat(lease, ttl=30).lease
    assert renewed is not None
    # The store's clock steps back behind the row's latest stamp (the renewal): each write
    # that would otherwise succeed is refused for it, and the row keeps its stamps.
    env.clock.step_back(10)
    provoked = [
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(renewed, ttl=10), current_epoch=1),
        _provoke(env, R, 1, "conn-a", lambda: c.release(renewed), current_epoch=1),
        _provoke(env, T, 1, "conn-b", lambda: c.takeover(  # AllowAllPolicy preempts
            IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1), current_epoch=1),
    ]
    assert row_of(env.store).updated_at == renewed.expires_at - timedelta(seconds=30)
    return provoked


def _policy_denied() -> list[Provoked]:
    """The production default (no policy given) denies every lease and grant operation."""
    env = make_env()
    lease = env.acquire()
    deny = ConnectorLeaseCoordinator(env.store, id_source=CountingIds())
    other = ConnectorLeaseCoordinator(env.store, StaticConnectorPolicy.from_dict(
        {"rules": [{"tenant_id": "acme", "logical_agent_id": "*", "binding_id": "*",
                    "connector_id": "conn-a", "scopes": ["tool:run"], "max_lease_ttl": 60,
                    "max_grant_ttl": 10}]}), id_source=CountingIds())
    expire(env, lease)
    before = env.rows()
    provoked = [
        _provoke(env, A, None, "conn-b", lambda: deny.acquire(
            OTHER_IDENT, "conn-b", scopes=SCOPES, ttl=10), identity=OTHER_IDENT),
        _provoke(env, T, 1, "conn-b", lambda: deny.takeover(
            IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1)),
        _provoke(env, H, 1, "conn-a", lambda: deny.heartbeat(lease, ttl=10)),
        _provoke(env, R, 1, "conn-a", lambda: deny.release(lease)),
        _provoke(env, G, 1, "conn-a", lambda: deny.issue_grant(lease, scopes=[], ttl=5)),
        # A configured policy with no matching rule also says policy_denied.
        _provoke(env, A, None, "conn-z", lambda: other.acquire(
            OTHER_IDENT, "conn-z", scopes=[], ttl=10), identity=OTHER_IDENT),
    ]
    assert env.rows() == before
    return provoked


def _preemption_denied() -> list[Provoked]:
    env = make_env(StaticConnectorPolicy.from_dict({"rules": [
        {"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*", "connector_id": "*",
         "scopes": list(SCOPES), "max_lease_ttl": 60, "max_grant_ttl": 10}]}))
    env.acquire()
    provoked = [_provoke(env, T, 1, "conn-b", lambda: env.coordinator.takeover(
        IDENT, "conn-b", scopes=SCOPES, ttl=10, expected_epoch=1))]
    assert row_of(env.store).connector_id == "conn-a"
    return provoked


_NARROW = {"rules": [{"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*",
                      "connector_id": "*", "scopes": ["tool:read"], "max_lease_ttl": 60,
                      "max_grant_ttl": 10}]}


def _scope_not_authorized() -> list[Provoked]:
    env = make_env()
    c = env.coordinator
    lease = env.acquire(scopes=["tool:run"])
    grant = env.grant(lease, ["tool:run"])
    provoked = [
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(
            lease, scopes=["tool:run", "tool:admin"], ttl=5)),
        _provoke(env, V, 1, "conn-a", _validate(env, grant, ["tool:run", "tool:read"])),
    ]
    # The lease's scopes no longer cover the grant's (same lease id and epoch).
    put_row(env.store, attrs.evolve(row_of(env.store), scopes=("tool:read",)))
    provoked.append(_provoke(env, V, 1, "conn-a", _validate(env, grant, ["tool:run"])))
    static = make_env(StaticConnectorPolicy.from_dict(_NARROW))
    provoked.append(_provoke(static, A, None, "conn-a", lambda: static.coordinator.acquire(
        IDENT, "conn-a", scopes=["tool:run"], ttl=10)))
    return provoked


def _ttl_not_authorized() -> list[Provoked]:
    env = make_env(StaticConnectorPolicy.from_dict(_NARROW))
    c = env.coordinator
    lease = env.acquire(scopes=["tool:read"], ttl=60)
    return [
        _provoke(env, A, None, "conn-b", lambda: c.acquire(
            OTHER_IDENT, "conn-b", scopes=["tool:read"], ttl=61), identity=OTHER_IDENT),
        _provoke(env, H, 1, "conn-a", lambda: c.heartbeat(lease, ttl=60.5)),
        _provoke(env, G, 1, "conn-a", lambda: c.issue_grant(
            lease, scopes=["tool:read"], ttl=11)),
    ]


def _grant_unknown() -> list[Provoked]:
    env = make_env()
    lease = env.acquire()
    grant = env.grant(lease)
    forged = attrs.evolve(grant)
    restarted = env.restart()
    return [
        _provoke(env, V, None, "unrecognized", _validate(env, forged)),
        _provoke(env, V, None, "unrecognized", _validate(env, "not a grant")),
        _provoke(env, V, None, "unrecognized", lambda: restarted.validate(
            grant, identity=IDENT, scopes=["tool:run"])),
    ]


def _grant_expired() -> list[Provoked]:
    env = make_env()
    lease = env.acquire()
    grant = env.grant(lease, ttl=5)
    env.clock.advance(5)  # expiry is inclusive: expires_at <= now is expired
    return [_provoke(env, V, 1, "conn-a", _validate(env, grant))]


def _mismatch(target: LeaseIdentity) -> list[Provoked]:
    env = make_env()
    grant = env.grant(env.acquire())
    env.acquire(target, "conn-t")
    return [_provoke(env, V, 1, "conn-a", _validate(env, grant, identity=target),
                     identity=target)]


def _store_unavailable() -> list[Provoked]:
    env = make_env()
    faulty = FaultyStore(env.store)
    coordinator = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=env.ids)
    lease = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10).lease
    assert lease is not None
    issued = coordinator.issue_grant(lease, scopes=["tool:run"], ttl=5)
    assert issued.grant is not None
    faulty.fail_load = True
    return [_provoke(env, V, 1, "conn-a", lambda: coordinator.validate(
        issued.grant, identity=IDENT, scopes=["tool:run"]))]  # type: ignore[arg-type]


SCENARIOS: dict[Reason, Callable[[], list[Provoked]]] = {
    Reason.LEASE_HELD: _lease_held,
    Reason.TAKEOVER_REQUIRED: _takeover_required,
    Reason.LEASE_MISSING: _lease_missing,
    Reason.LEASE_EXPIRED: _lease_expired,
    Reason.LEASE_RELEASED: _lease_released,
    Reason.LEASE_REPLACED: _lease_replaced,
    Reason.STALE_EPOCH: _stale_epoch,
    Reason.EPOCH_MISMATCH: _epoch_mismatch,
    Reason.EPOCH_EXHAUSTED: _epoch_exhausted,
    Reason.CLOCK_BEHIND: _clock_behind,
    Reason.POLICY_DENIED: _policy_denied,
    Reason.PREEMPTION_DENIED: _preemption_denied,
    Reason.SCOPE_NOT_AUTHORIZED: _scope_not_authorized,
    Reason.TTL_NOT_AUTHORIZED: _ttl_not_authorized,
    Reason.GRANT_UNKNOWN: _grant_unknown,
    Reason.GRANT_EXPIRED: _grant_expired,
    Reason.TENANT_MISMATCH: lambda: _mismatch(LeaseIdentity("other", "agent-1", "binding-1")),
    Reason.AGENT_MISMATCH: lambda: _mismatch(LeaseIdentity("acme", "agent-2", "binding-1")),
    Reason.BINDING_MISMATCH: lambda: _mismatch(LeaseIdentity("acme", "agent-1", "binding-9")),
    Reason.STORE_UNAVAILABLE: _store_unavailable,
}


def test_every_reason_is_provoked_for_real() -> None:
    provoked = {p.reason for scenario in SCENARIOS.values() for p in scenario()}
    assert provoked == set(Reason)


@pytest.mark.parametrize("reason", list(Reason), ids=str)
def test_denial_reason_and_its_audit_row(reason: Reason) -> None:
    attempts = SCENARIOS[reason]()
    assert attempts
    for p in attempts:
        assert p.reason is reason, p
        assert p.current_epoch == p.expected_current_epoch, p
        assert len(p.rows) == 1, f"{p.event} {reason}: {len(p.rows)} audit rows"
        entry = p.rows[0].entry
        assert entry.event is p.event
        assert entry.outcome is Outcome.DENIED
        assert entry.reason is reason
        assert entry.epoch == p.epoch
        assert entry.connector_id == p.connector_id
        assert entry.identity == p.identity


def test_store_down_entirely_validation_still_fails_closed() -> None:
    env = make_env()
    faulty = FaultyStore(env.store)
    coordinator = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=env.ids)
    lease = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=10).lease
    assert lease is not None
    grant = coordinator.issue_grant(lease, scopes=["tool:run"], ttl=5).grant
    assert grant is not None
    faulty.fail_load = faulty.fail_record = True
    calls: list[ConnectorExecutionContext] = []
    result = coordinator.invoke(grant, calls.append, identity=IDENT, scopes=["tool:run"])
    assert result.reason is Reason.STORE_UNAVAILABLE
    assert calls == []
    faulty.fail_load = faulty.fail_record = False
    assert coordinator.validate(grant, identity=IDENT, scopes=["tool:run"]).ok


def test_lifecycle_store_failure_raises_store_unavailable() -> None:
    env = make_env()
    faulty = FaultyStore(env.store)
    coordinator = ConnectorLeaseCoordinator(faulty, AllowAllPolicy(), id_source=env.ids)
    faulty.fail_load = True
    with pytest.raises(StoreUnavailable):
        coordinator.takeover(IDENT, "conn-a", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert env.state() == ([], [])
