"""Tools that outlive a grant, on a real PostgreSQL server, in real time.

A tool with a 1 s grant runs for 4 s writing through ``fenced_transaction``, while the
gateway keeps its 2 s lease renewed: with the lease-judged fence (``valid_until=LEASE``) on
its first context, or with the context the gateway renews (``renew_grant``). Every effect
commits; the first after a rival's takeover is refused and writes nothing. Sync and asyncio.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    Reason,
)
from mos_lease.fencing import FencedEffectRefused, ValidUntil
from mos_lease_pg import AsyncPostgresLeaseStore
from mos_lease_pg.effects import fenced_transaction, fenced_transaction_async
from tests.pg.test_fencing import EFFECTS_TABLE, notes, write_note
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ("effects:write",)
LEASE_TTL, GRANT_TTL = 2.0, 1.0
RUN_FOR, STEP, RENEW_LEASE_EVERY = 4.0, 0.2, 0.6


@pytest.fixture
def effects(pg_admin: psycopg.Connection[Any]) -> str:
    pg_admin.execute(f"""CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (
        seq bigserial PRIMARY KEY, tenant_id text NOT NULL, epoch bigint NOT NULL,
        note text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())""")
    return EFFECTS_TABLE


def write(conn: psycopg.Connection[Any], fence: ConnectorExecutionContext,
          valid_until: ValidUntil = ValidUntil.CONTEXT) -> Reason | None:
    try:
        with fenced_transaction(conn, fence, scopes=SCOPES, valid_until=valid_until) as cur:
            write_note(cur, fence, str(valid_until))
    except FencedEffectRefused as refused:
        assert isinstance(refused.reason, Reason)
        return refused.reason
    return None


@pytest.mark.parametrize("valid_until", list(ValidUntil))
def test_a_tool_outlives_its_grant_and_its_first_effect_after_a_takeover_is_refused(
        pg_stores: StoreFactory, pg_dsn: str, pg_admin: psycopg.Connection[Any], effects: str,
        pg_tenant: str, valid_until: ValidUntil) -> None:
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    identity = LeaseIdentity(pg_tenant, "agent-1", "long-tool")
    lease = gateway.acquire(identity, "conn-a", scopes=SCOPES, ttl=LEASE_TTL).lease
    assert lease is not None
    grant = gateway.issue_grant(lease, scopes=SCOPES, ttl=GRANT_TTL).grant
    assert grant is not None
    first = gateway.validate(grant, identity=identity, scopes=SCOPES).context
    assert first is not None
    context, written = first, 0
    started = renewed_at = time.monotonic()
    with psycopg.connect(pg_dsn) as conn:
        while time.monotonic() - started < RUN_FOR:
            time.sleep(STEP)
            if time.monotonic() - renewed_at >= RENEW_LEASE_EVERY:  # the keeper's work
                heartbeat = gateway.heartbeat(lease, ttl=LEASE_TTL)
                assert heartbeat.lease is not None, heartbeat
                lease, renewed_at = heartbeat.lease, time.monotonic()
            if valid_until is ValidUntil.CONTEXT:  # the gateway renews the tool's context
                renewed = gateway.renew_grant(grant, identity=identity, scopes=SCOPES,
                                              ttl=GRANT_TTL)
                assert renewed.grant is not None and renewed.context is not None, renewed
                grant, context = renewed.grant, renewed.context
            assert write(conn, context, valid_until) is None
            written += 1
        # The run outlived the first grant: judged by its own expiry, its context is done.
        assert write(conn, first) is Reason.GRANT_EXPIRED
        assert gateway.takeover(identity, "conn-b", scopes=SCOPES, ttl=LEASE_TTL,
                                expected_epoch=1).ok
        assert write(conn, context, valid_until) is Reason.STALE_EPOCH
    assert written >= RUN_FOR / STEP / 2
    assert notes(pg_admin, pg_tenant) == [(1, str(valid_until))] * written
    if valid_until is ValidUntil.CONTEXT:
        late = gateway.renew_grant(grant, identity=identity, scopes=SCOPES, ttl=GRANT_TTL)
        assert late.reason is Reason.STALE_EPOCH


def test_asyncio_a_tool_outlives_its_grant_both_ways(
        pg_dsn: str, pg_admin: psycopg.Connection[Any], effects: str, pg_tenant: str) -> None:
    identity = LeaseIdentity(pg_tenant, "agent-1", "long-tool-async")

    async def write_async(conn: psycopg.AsyncConnection[Any], fence: ConnectorExecutionContext,
                          valid_until: ValidUntil) -> Reason | None:
        try:
            async with fenced_transaction_async(conn, fence, scopes=SCOPES,
                                                valid_until=valid_until) as cur:
                await cur.execute(f"INSERT INTO {EFFECTS_TABLE} (tenant_id, epoch, note) "
                                  "VALUES (%s, %s, %s)",
                                  (identity.tenant_id, fence.epoch, str(valid_until)))
        except FencedEffectRefused as refused:
            assert isinstance(refused.reason, Reason)
            return refused.reason
        return None

    async def main() -> int:
        async with AsyncPostgresLeaseStore(pg_dsn) as store, \
                await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            gateway = AsyncConnectorLeaseCoordinator(store, AllowAllPolicy())
            lease = (await gateway.acquire(identity, "conn-a", scopes=SCOPES,
                                           ttl=LEASE_TTL)).lease
            assert lease is not None
            grant = (await gateway.issue_grant(lease, scopes=SCOPES, ttl=GRANT_TTL)).grant
            assert grant is not None
            first = (await gateway.validate(grant, identity=identity, scopes=SCOPES)).context
            assert first is not None
            context, steps = first, 0
            started = time.monotonic()
            while time.monotonic() - started < RUN_FOR:
                await asyncio.sleep(STEP)
                steps += 1
                if steps % 3 == 0:
                    renewed_lease = (await gateway.heartbeat(lease, ttl=LEASE_TTL)).lease
                    assert renewed_lease is not None
                    lease = renewed_lease
                renewed = await gateway.renew_grant(grant, identity=identity, scopes=SCOPES,
                                                    ttl=GRANT_TTL)
                assert renewed.grant is not None and renewed.context is not None, renewed
                grant, context = renewed.grant, renewed.context
                assert await write_async(conn, context, ValidUntil.CONTEXT) is None
                assert await write_async(conn, first, ValidUntil.LEASE) is None
            assert await write_async(conn, first, ValidUntil.CONTEXT) is Reason.GRANT_EXPIRED
            assert (await gateway.takeover(identity, "conn-b", scopes=SCOPES, ttl=LEASE_TTL,
                                           expected_epoch=1)).ok
            assert await write_async(conn, context, ValidUntil.CONTEXT) is Reason.STALE_EPOCH
            assert await write_async(conn, first, ValidUntil.LEASE) is Reason.STALE_EPOCH
            late = await gateway.renew_grant(grant, identity=identity, scopes=SCOPES,
                                             ttl=GRANT_TTL)
            assert late.reason is Reason.STALE_EPOCH
            return steps

    steps = asyncio.run(main())
    assert steps >= RUN_FOR / STEP / 2
    assert notes(pg_admin, pg_tenant) == [(1, "context"), (1, "lease")] * steps
