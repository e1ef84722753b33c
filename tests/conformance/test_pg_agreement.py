"""The PostgreSQL store agrees with the in-memory reference store, operation by operation.

Hypothesis generates sequences of acquire, takeover, heartbeat (single and batched),
release, grant issue, validation and time steps over a few identities and connectors. Each
sequence runs against a fresh in-memory store on a manual clock and against PostgreSQL (its
clock moved by the test-only offset), with the same deterministic id source, and every
outcome, reason, epoch, handle, grant and the whole audit trail must be identical; only
absolute timestamps differ.

TTLs are whole seconds plus a half and time moves in whole seconds, so the few milliseconds
the database clock drifts during a sequence can never flip an expiry boundary.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import uuid4

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mos_lease import (
    ConnectorLeaseCoordinator,
    GrantResult,
    LeaseIdentity,
    LeaseResult,
    StaticConnectorPolicy,
    ValidationResult,
)
from mos_lease.clock import ManualClock
from mos_lease.grants import ExecutionGrant
from mos_lease.records import LeaseHandle, LeaseRow
from mos_lease_memory import InMemoryLeaseStore
from mos_lease_pg import PostgresLeaseStore
from tests.pg_clock import ShiftedPostgresLeaseStore
from tests.pg_support import CountingIds

pytestmark = pytest.mark.pg

SCOPES = ("a", "b", "c")
POLICY_RULES = [
    {"connector_id": "c1", "scopes": ["a", "b"], "max_lease_ttl": 60, "max_grant_ttl": 20,
     "preempt_active": True},
    {"connector_id": "c2", "scopes": ["a"], "max_lease_ttl": 60, "max_grant_ttl": 20,
     "preempt_active": False},
    {"connector_id": "c3", "scopes": ["a", "b", "c"], "max_lease_ttl": 20, "max_grant_ttl": 5},
]  # "c4" matches no rule
POLICY = StaticConnectorPolicy.from_dict({"rules": [
    {"tenant_id": "*", "logical_agent_id": "*", "binding_id": "*", **rule}
    for rule in POLICY_RULES]})
AGENTS = (("agent-a", "b1"), ("agent-a", "b2"), ("agent-b", "b1"))

connectors = st.sampled_from(("c1", "c2", "c3", "c4"))
scope_sets = st.lists(st.sampled_from(SCOPES), max_size=3)
lease_ttls = st.sampled_from((5.5, 10.5, 30.5, 90.5))
grant_ttls = st.sampled_from((2.5, 5.5, 25.5))
index = st.integers(min_value=0, max_value=7)
operations = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.integers(0, 2), connectors, scope_sets, lease_ttls),
    st.tuples(st.just("takeover"), st.integers(0, 2), connectors, scope_sets, lease_ttls,
              st.sampled_from((-1, 0, 0, 0, 1))),
    st.tuples(st.just("heartbeat"), index, lease_ttls),
    st.tuples(st.just("heartbeat_many"), st.lists(index, min_size=1, max_size=3), lease_ttls),
    st.tuples(st.just("release"), index),
    st.tuples(st.just("grant"), index, scope_sets, grant_ttls),
    st.tuples(st.just("validate"), index, st.integers(0, 3), scope_sets),
    st.tuples(st.just("advance"), st.sampled_from((1, 4, 9, 20, 35))),
), min_size=1, max_size=40)


@pytest.fixture(scope="module")
def shared_pg_store(pg_dsn: str) -> Iterator[ShiftedPostgresLeaseStore]:
    # One store for every example: each example uses its own tenants, and the offset only
    # ever moves forward, which is all a fresh store would give.
    with ShiftedPostgresLeaseStore(pg_dsn) as store:
        yield store


def _handle(handle: LeaseHandle | None) -> tuple[Any, ...] | None:
    if handle is None:
        return None
    return (handle.identity, handle.connector_id, handle.lease_id, handle.epoch, handle.scopes)


def _grant(grant: ExecutionGrant | None) -> tuple[Any, ...] | None:
    if grant is None:
        return None
    return (grant.grant_id, grant.identity, grant.connector_id, grant.lease_id, grant.epoch,
            grant.scopes, grant.correlation_id)


def summary(result: LeaseResult | GrantResult | ValidationResult | list[LeaseResult]
            ) -> Any:
    """Everything in a result except absolute timestamps."""
    if isinstance(result, list):
        return [summary(r) for r in result]
    if isinstance(result, LeaseResult):
        return (result.outcome, result.reason, result.current_epoch, result.reconciled,
                _handle(result.lease), result.correlation_id)
    if isinstance(result, GrantResult):
        return (result.outcome, result.reason, _grant(result.grant), result.correlation_id)
    context = result.context
    return (result.reason, None if context is None else (
        context.identity, context.connector_id, context.lease_id, context.epoch,
        context.scopes, context.correlation_id))


def _row(row: LeaseRow) -> tuple[Any, ...]:
    return (row.identity, row.lease_id, row.connector_id, row.scopes, row.epoch,
            row.released_at is None, row.expires_at - row.heartbeat_at,
            # Whole seconds of model time apart; the database clock adds milliseconds.
            round((row.heartbeat_at - row.acquired_at).total_seconds()))


class Side:
    """One store with its coordinator and the handles and grants it has been given."""

    def __init__(self, store: InMemoryLeaseStore | PostgresLeaseStore,
                 coordinator: ConnectorLeaseCoordinator) -> None:
        self.store = store
        self.gateway = coordinator
        self.handles: list[LeaseHandle] = []
        self.grants: list[ExecutionGrant] = []

    def run(self, op: tuple[Any, ...], identities: list[LeaseIdentity]) -> Any:
        kind, *args = op
        g = self.gateway
        result: Any
        if kind == "acquire":
            ident, connector, scopes, ttl = args
            result = g.acquire(identities[ident], connector, scopes=scopes, ttl=ttl)
        elif kind == "takeover":
            ident, connector, scopes, ttl, delta = args
            snapshot = self.store.load(identities[ident])
            epoch = max(1, (snapshot.row.epoch if snapshot.row is not None else 1) + delta)
            result = g.takeover(identities[ident], connector, scopes=scopes, ttl=ttl,
                                expected_epoch=epoch)
        elif kind == "heartbeat" and self.handles:
            result = g.heartbeat(self.handles[args[0] % len(self.handles)], ttl=args[1])
        elif kind == "heartbeat_many" and self.handles:
            picked = [self.handles[i % len(self.handles)] for i in args[0]]
            result = g.heartbeat_many(picked, ttl=args[1])
        elif kind == "release" and self.handles:
            result = g.release(self.handles[args[0] % len(self.handles)])
        elif kind == "grant" and self.handles:
            handle = self.handles[args[0] % len(self.handles)]
            result = g.issue_grant(handle, scopes=args[1], ttl=args[2])
            if result.grant is not None:
                self.grants.append(result.grant)
        elif kind == "validate" and self.grants:
            grant = self.grants[args[0] % len(self.grants)]
            result = g.validate(grant, identity=identities[args[1]], scopes=args[2])
        else:
            return None
        for item in result if isinstance(result, list) else [result]:
            if isinstance(item, LeaseResult) and item.lease is not None:
                self.handles.append(item.lease)
        return summary(result)


_namespaces = itertools.count(1)


@settings(max_examples=1000, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=operations)
def test_postgres_agrees_with_the_memory_store(shared_pg_store: ShiftedPostgresLeaseStore,
                                               ops: list[tuple[Any, ...]]) -> None:
    run = uuid4().hex[:12]
    tenant, foreign = f"agree-{run}", f"agree-{run}-x"
    identities = [LeaseIdentity(tenant, agent, binding) for agent, binding in AGENTS]
    identities.append(LeaseIdentity(foreign, "agent-a", "b1"))  # only as a validation target
    namespace = (int(run, 16) << 8) | next(_namespaces) % 256
    clock = ManualClock()
    memory_store = InMemoryLeaseStore(clock)
    memory = Side(memory_store, ConnectorLeaseCoordinator(memory_store, POLICY,
                                                          id_source=CountingIds(namespace)))
    postgres = Side(shared_pg_store, ConnectorLeaseCoordinator(
        shared_pg_store, POLICY, id_source=CountingIds(namespace)))
    for step, op in enumerate(ops):
        if op[0] == "advance":
            clock.advance(timedelta(seconds=op[1]))
            shared_pg_store.advance(timedelta(seconds=op[1]))
            continue
        expected = memory.run(op, identities)
        got = postgres.run(op, identities)
        assert got == expected, f"step {step} {op}: postgres {got} != memory {expected}"

    memory_audit = [r.entry for r in memory_store.audit(limit=100_000)]
    pg_audit = [r.entry for r in shared_pg_store.search_audit(tenant_id=tenant, limit=100_000)]
    pg_audit += [r.entry for r in shared_pg_store.search_audit(tenant_id=foreign)]
    by_event = {entry.event_id: entry for entry in pg_audit}
    assert len(by_event) == len(pg_audit) == len(memory_audit)
    # The foreign tenant's rows were read separately; compare in the memory store's order.
    assert [by_event.get(entry.event_id) for entry in memory_audit] == memory_audit
    assert ([_row(r) for r in shared_pg_store.leases(tenant)]
            == [_row(r) for r in memory_store.leases(tenant)])
