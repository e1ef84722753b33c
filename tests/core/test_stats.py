"""The always-on counters (``stats()``, :mod:`mos_lease.stats`) of the in-memory store, the
coordinators and the supervisors: each count moves by exactly what the calls made."""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseIdentity,
)
from mos_lease.clock import ManualClock
from mos_lease.keep.schedule import BATCH
from mos_lease.stats import CoordinatorStats, StoreStats, SupervisorStats
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.core.test_supervisor import Rig, ident

SCOPES = ("tool:run",)


def _gateway() -> tuple[InMemoryLeaseStore, ConnectorLeaseCoordinator]:
    store = InMemoryLeaseStore(ManualClock(datetime(2030, 1, 1, tzinfo=UTC)))
    return store, ConnectorLeaseCoordinator(store, AllowAllPolicy())


def test_a_snapshot_is_frozen_and_later_calls_do_not_change_it() -> None:
    store, gateway = _gateway()
    lease = gateway.acquire(LeaseIdentity("t", "a", "b"), "c", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    before, ops = store.stats(), gateway.stats()
    assert gateway.heartbeat(lease, ttl=60).ok
    assert before.round_trips == {"insert": 1}
    assert ops.operations == {"acquire": {"acquired": 1}}
    assert store.stats().round_trips == {"insert": 1, "renew": 1}
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        before.reconciles = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        before.round_trips["insert"] = 5  # type: ignore[index]


def test_the_memory_store_counts_each_call_under_the_statement_names() -> None:
    store, gateway = _gateway()
    leases = [gateway.acquire(LeaseIdentity("t", f"a{i}", "b"), "c", scopes=SCOPES,
                              ttl=60).lease for i in range(3)]
    assert all(lease is not None for lease in leases)
    grant = gateway.issue_grant(leases[0], scopes=SCOPES, ttl=20).grant  # type: ignore[arg-type]
    assert grant is not None
    start = store.stats()
    for _ in range(5):
        assert gateway.validate(grant, identity=grant.identity, scopes=SCOPES).ok
    results = gateway.heartbeat_many(leases, ttl=60)  # type: ignore[arg-type]
    assert all(r.ok for r in results)
    assert gateway.release(leases[2]).ok  # type: ignore[arg-type]
    assert not store.event_committed(grant.grant_id)
    end = store.stats()
    moved = {k: n - start.round_trips.get(k, 0) for k, n in end.round_trips.items()
             if n != start.round_trips.get(k, 0)}
    # A validation is one read; a batch of heartbeats one call, not one per lease.
    assert moved == {"load": 5, "renew_many": 1, "close": 1, "event_committed": 1}
    assert end.round_trips_total - start.round_trips_total == 8
    assert end.reconciles == start.reconciles + 1
    assert asyncio.run(_async_store_stats(store)) == store.stats()


async def _async_store_stats(store: InMemoryLeaseStore) -> StoreStats:
    return AsyncInMemoryLeaseStore(store).stats()


def test_the_coordinator_counts_operations_by_outcome_and_denials_by_reason() -> None:
    _store, gateway = _gateway()
    identity = LeaseIdentity("t", "a", "b")
    lease = gateway.acquire(identity, "c", scopes=SCOPES, ttl=60).lease
    assert lease is not None
    assert not gateway.acquire(identity, "other", scopes=SCOPES, ttl=60).ok  # lease_held
    grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=20).grant
    assert grant is not None
    for _ in range(3):
        assert gateway.validate(grant, identity=identity, scopes=SCOPES).ok
    for _ in range(2):
        assert not gateway.validate(grant, identity=identity, scopes=["tool:write"]).ok
    with pytest.raises(InvalidInput):
        gateway.heartbeat(lease, ttl=-1)
    stats = gateway.stats()
    assert stats.operations == {"acquire": {"acquired": 1, "denied": 1},
                                "issue_grant": {"grant_issued": 1},
                                "validate": {"ok": 3, "denied": 2}}
    assert stats.count("validate") == 5
    assert stats.count("validate", "denied") == 2
    assert stats.count("takeover") == 0
    assert stats.denials == {"lease_held": 1, "scope_not_authorized": 2}
    assert stats.failed == {"heartbeat": 1}


def test_the_asyncio_coordinator_counts_as_the_synchronous_one() -> None:
    async def main() -> CoordinatorStats:
        gateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
        identity = LeaseIdentity("t", "a", "b")
        lease = (await gateway.acquire(identity, "c", scopes=SCOPES, ttl=60)).lease
        assert lease is not None
        grant = (await gateway.issue_grant(lease, scopes=SCOPES, ttl=20)).grant
        assert grant is not None
        assert (await gateway.validate(grant, identity=identity, scopes=SCOPES)).ok
        assert (await gateway.release(lease)).ok
        return gateway.stats()

    stats = asyncio.run(main())
    assert stats.operations == {"acquire": {"acquired": 1}, "issue_grant": {"grant_issued": 1},
                                "validate": {"ok": 1}, "release": {"released": 1}}


def _delta(after: SupervisorStats, before: SupervisorStats) -> dict[str, int]:
    return {f.name: getattr(after, f.name) - getattr(before, f.name)
            for f in attrs.fields(SupervisorStats)}


@pytest.mark.parametrize("bindings", [5, 2 * BATCH + 500])
def test_a_supervisor_counts_its_ticks_and_the_leases_renewed_in_each(bindings: int) -> None:
    rig = Rig()
    rig.add(bindings)
    rig.settle()
    won = rig.supervisor.stats()
    assert (won.acquires, won.bindings, won.bindings_held) == (bindings, bindings, bindings)
    assert won.renewal_ticks == won.leases_renewed == 0
    rig.run(12)  # one renewal interval (ttl / 3) and a little
    renewed = rig.supervisor.stats()
    ticks = math.ceil(bindings / BATCH)
    assert _delta(renewed, won) == {**dict.fromkeys(_delta(won, won), 0),
                                    "renewal_ticks": ticks, "leases_renewed": bindings,
                                    "last_renewed": renewed.last_renewed}
    # Due leases go out in batches of BATCH, the remainder last.
    assert renewed.last_renewed == bindings - (ticks - 1) * BATCH
    # The store saw the same batches: one renew_many call per tick.
    assert rig.store.stats().round_trips["renew_many"] == ticks
    assert rig.coordinator.stats().operations["heartbeat_many"] == {"ok": ticks}
    rig.supervisor.remove(ident(0))
    removed = rig.supervisor.stats()
    assert (removed.releases, removed.bindings, removed.bindings_held) == (
        1, bindings - 1, bindings - 1)
