"""The asyncio store, through ``AsyncConnectorLeaseCoordinator``: the same flows, the same
statements and the same failure handling as the synchronous store."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    LeaseIdentity,
    Reason,
    StoreUnavailable,
)
from mos_lease_pg import AsyncPostgresLeaseStore, ConnectionSettings, open_async_pool
from tests.pg_clock import ShiftedAsyncPostgresLeaseStore
from tests.pg_support import FaultProxy

pytestmark = pytest.mark.pg

SCOPES = ["tool:run"]


async def _lifecycle(store: ShiftedAsyncPostgresLeaseStore, tenant: str) -> None:
    gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
    ident = LeaseIdentity(tenant, "agent", "b1")
    first = await gateway.acquire(ident, "c1", scopes=SCOPES, ttl=10)
    assert first.lease is not None and first.lease.epoch == 1
    assert (await gateway.acquire(ident, "c2", scopes=SCOPES, ttl=10)).reason is Reason.LEASE_HELD
    renewed = await gateway.heartbeat(first.lease, ttl=20)
    assert renewed.lease is not None and renewed.lease.expires_at > first.lease.expires_at
    [batched] = await gateway.heartbeat_many([first.lease], ttl=20)
    assert batched.ok
    grant = (await gateway.issue_grant(first.lease, scopes=SCOPES, ttl=5)).grant
    assert grant is not None
    checked = await gateway.validate(grant, identity=ident, scopes=SCOPES)
    assert checked.context is not None and checked.context.epoch == 1
    second = await gateway.takeover(ident, "c2", scopes=SCOPES, ttl=10, expected_epoch=1)
    assert second.lease is not None and second.lease.epoch == 2
    stale = await gateway.validate(grant, identity=ident, scopes=SCOPES)
    assert stale.reason is Reason.STALE_EPOCH
    store.advance(timedelta(seconds=11))
    expired = await gateway.heartbeat(second.lease, ttl=10)
    assert expired.reason is Reason.LEASE_EXPIRED
    third = await gateway.takeover(ident, "c1", scopes=SCOPES, ttl=10, expected_epoch=2)
    assert third.lease is not None and third.lease.epoch == 3
    assert (await gateway.release(third.lease)).ok
    [row] = await store.leases(tenant)
    assert row.epoch == 3 and row.released_at is not None
    events = [(r.entry.event.value, r.entry.outcome.value) for r in await store.audit(ident)]
    assert events == [("acquire", "acquired"), ("acquire", "denied"), ("heartbeat", "renewed"),
                      ("heartbeat", "renewed"), ("grant_issue", "grant_issued"),
                      ("takeover", "taken_over"), ("grant_validate", "denied"),
                      ("heartbeat", "denied"), ("takeover", "taken_over"),
                      ("release", "released")]
    assert len(await store.search_audit(tenant_id=tenant, limit=3)) == 3
    assert await store.now() >= row.released_at


def test_async_store_with_a_dedicated_connection(pg_dsn: str, pg_tenant: str) -> None:
    async def scenario() -> None:
        async with ShiftedAsyncPostgresLeaseStore(pg_dsn) as store:
            await _lifecycle(store, pg_tenant)

    asyncio.run(scenario())


def test_async_store_with_a_pool(pg_dsn: str, pg_tenant: str) -> None:
    async def scenario() -> None:
        settings = ConnectionSettings(pool_timeout=0.2)
        pool = await open_async_pool(pg_dsn, settings, min_size=1, max_size=1)
        try:
            store = ShiftedAsyncPostgresLeaseStore(pool=pool, settings=settings)
            await _lifecycle(store, pg_tenant)
            held = await pool.getconn()
            try:
                started = time.monotonic()
                with pytest.raises(StoreUnavailable, match="pool exhausted"):
                    await store.load(LeaseIdentity(pg_tenant, "agent", "b1"))
                assert time.monotonic() - started < 2
            finally:
                await pool.putconn(held)
            await store.aclose()  # the pool stays open: it is the caller's
            assert (await store.load(LeaseIdentity(pg_tenant, "agent", "b1"))).row is not None
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_async_store_reconciles_and_fails_closed(pg_dsn: str, pg_tenant: str) -> None:
    proxy = FaultProxy(pg_dsn)

    async def scenario() -> None:
        async with AsyncPostgresLeaseStore(
                proxy.dsn, settings=ConnectionSettings(prepare=False)) as store:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            ident = LeaseIdentity(pg_tenant, "agent", "b1")
            first = await gateway.acquire(ident, "c1", scopes=SCOPES, ttl=30)
            assert first.lease is not None
            proxy.cut_reply_to(b"epoch = l.epoch + 1")
            second = await gateway.takeover(ident, "c2", scopes=SCOPES, ttl=30,
                                            expected_epoch=1)
            assert second.ok and second.reconciled and second.lease is not None
            assert second.lease.epoch == 2
            grant = (await gateway.issue_grant(second.lease, scopes=SCOPES, ttl=5)).grant
            assert grant is not None
            proxy.refuse()
            denied = await gateway.validate(grant, identity=ident, scopes=SCOPES)
            assert denied.reason is Reason.STORE_UNAVAILABLE
        async with AsyncPostgresLeaseStore(pg_dsn) as direct:
            taken = [r for r in await direct.audit(ident) if r.entry.event.value == "takeover"]
            assert [r.entry.epoch for r in taken] == [2]

    try:
        asyncio.run(scenario())
    finally:
        proxy.close()
