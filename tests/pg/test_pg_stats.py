"""The PostgreSQL stores' counters (``stats()``): statements sent by name, and the coalesced
reads and appends with the calls they carried, against concurrent validations."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from mos_lease import AllowAllPolicy, AsyncConnectorLeaseCoordinator, ExecutionGrant, LeaseIdentity
from mos_lease.ids import uuid7
from mos_lease.stats import StoreStats
from tests.pg_clock import ShiftedAsyncPostgresLeaseStore
from tests.pg_fixtures import StoreFactory

SCOPES = ["tool:run"]
CALLS = 32


def _moved(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def _loads_add_up(before: StoreStats, after: StoreStats, calls: int) -> int:
    """The load round trips the calls took, checked against the batches' sizes: every load
    went out alone (a ``load`` or ``load_many`` statement that is no batch) or in a batch."""
    sent = _moved(after.round_trips, before.round_trips)
    trips = sent.get("load", 0) + sent.get("load_many", 0)
    batches = after.load_batches - before.load_batches
    alone = trips - batches
    assert alone + (after.loads_batched - before.loads_batched) == calls
    return trips


def _records_add_up(before: StoreStats, after: StoreStats, calls: int) -> int:
    sent = _moved(after.round_trips, before.round_trips)
    trips = sent.get("record", 0) + sent.get("record_many", 0)
    batches = after.record_batches - before.record_batches
    assert trips - batches + (after.records_batched - before.records_batched) == calls
    return trips


def test_concurrent_validations_take_fewer_round_trips_than_validations(pg_dsn: str,
                                                                         pg_tenant: str) -> None:
    async def main() -> None:
        async with ShiftedAsyncPostgresLeaseStore(pg_dsn) as store:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            grants: list[ExecutionGrant] = []
            for i in range(CALLS):
                lease = (await gateway.acquire(LeaseIdentity(pg_tenant, f"a{i}", "b"), "c",
                                               scopes=SCOPES, ttl=60)).lease
                assert lease is not None
                grant = (await gateway.issue_grant(lease, scopes=SCOPES, ttl=20)).grant
                assert grant is not None
                grants.append(grant)
            before, ops = store.stats(), gateway.stats()
            ok = await asyncio.gather(*(gateway.validate(g, identity=g.identity, scopes=SCOPES)
                                        for g in grants))
            assert all(r.ok for r in ok)
            after = store.stats()
            assert _loads_add_up(before, after, CALLS) < CALLS
            assert after.load_batches > before.load_batches
            # Nothing but reads: a validation that passes writes nothing.
            assert set(_moved(after.round_trips, before.round_trips)) <= {"load", "load_many"}
            assert gateway.stats().count("validate", "ok") - ops.count("validate", "ok") == CALLS

            # Refused for their scopes: each read, then each denial's audit row appended,
            # the appends coalesced as the reads are.
            denied = await asyncio.gather(*(gateway.validate(g, identity=g.identity,
                                                             scopes=["tool:write"])
                                            for g in grants))
            assert not any(r.ok for r in denied)
            end = store.stats()
            assert _loads_add_up(after, end, CALLS) < CALLS
            assert _records_add_up(after, end, CALLS) < CALLS
            assert end.record_batches > after.record_batches
            assert gateway.stats().denials["scope_not_authorized"] == CALLS
            assert end.commit_outcome_unknown == 0

    asyncio.run(main())


def test_reconciling_an_event_is_counted_with_its_statements(pg_stores: StoreFactory) -> None:
    store = pg_stores()
    before = store.stats()
    assert not store.event_committed(uuid7())
    after = store.stats()
    assert after.reconciles == before.reconciles + 1
    sent = _moved(after.round_trips, before.round_trips)
    assert sent["event_committed"] == 1
    assert after.round_trips_total - before.round_trips_total == sum(sent.values())
