"""Coalesced fenced effects (``mos_lease_pg.effect_batches``): the effects of overlapping
tasks share one transaction, each judged on its own locked lease row in it; a refused
effect and a failing statement fail only their own caller."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg import errors
from psycopg_pool import AsyncConnectionPool

from mos_lease import (
    AllowAllPolicy,
    ConnectorExecutionContext,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
    Reason,
)
from mos_lease.fencing import FencedEffectRefused
from mos_lease_pg.effect_batches import CoalescedEffects
from tests.pg.test_pg_effects import LEASE_SCOPES, WRITE, acquired, granted
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

TABLE = "public.coalesced_effects"
# The transaction that wrote the row: effects of one batch share it.
INSERT = (f"INSERT INTO {TABLE} (tenant_id, epoch, note) VALUES (%s, %s, %s) "
          "RETURNING seq, pg_current_xact_id()::text")


@pytest.fixture
def table(pg_admin: psycopg.Connection[Any]) -> str:
    pg_admin.execute(f"""CREATE TABLE IF NOT EXISTS {TABLE} (
        seq bigserial PRIMARY KEY, tenant_id text NOT NULL, epoch bigint NOT NULL,
        note text NOT NULL CHECK (note <> 'bad'))""")
    return TABLE


def _contexts(pg_stores: StoreFactory, tenant: str, n: int
              ) -> tuple[ConnectorLeaseCoordinator, list[ConnectorExecutionContext]]:
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    contexts = []
    for i in range(n):
        handle = acquired(gateway, LeaseIdentity(tenant, f"agent-{i}", "b"))
        contexts.append(granted(gateway, handle)[1])
    return gateway, contexts


def _notes(pg_admin: psycopg.Connection[Any], tenant: str) -> list[str]:
    return [r[0] for r in pg_admin.execute(
        f"SELECT note FROM {TABLE} WHERE tenant_id = %s ORDER BY seq", (tenant,)).fetchall()]


async def _together(pg_dsn: str, calls: list[tuple[ConnectorExecutionContext, str]],
                    **options: Any) -> tuple[list[Any], CoalescedEffects]:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False) as pool:
        effects = CoalescedEffects(pool, **options)
        answers = await asyncio.gather(*(
            effects.execute(c, INSERT, (c.identity.tenant_id, c.epoch, note), scopes=WRITE)
            for c, note in calls), return_exceptions=True)
        return answers, effects


def test_overlapping_effects_share_one_transaction(pg_dsn: str, pg_stores: StoreFactory,
                                                   pg_admin: psycopg.Connection[Any],
                                                   pg_tenant: str, table: str) -> None:
    _, contexts = _contexts(pg_stores, pg_tenant, 6)
    answers, _ = asyncio.run(_together(pg_dsn, [(c, f"n{i}") for i, c in
                                                enumerate(contexts)]))
    assert all(isinstance(a, tuple) for a in answers), answers
    assert len({a[1] for a in answers}) == 1  # one transaction, one commit
    assert sorted(_notes(pg_admin, pg_tenant)) == [f"n{i}" for i in range(6)]


def test_a_stale_fence_is_refused_alone_and_the_others_commit(
        pg_dsn: str, pg_stores: StoreFactory, pg_admin: psycopg.Connection[Any],
        pg_tenant: str, table: str) -> None:
    gateway, contexts = _contexts(pg_stores, pg_tenant, 4)
    stale = contexts[2]
    assert gateway.takeover(stale.identity, "conn-b", scopes=LEASE_SCOPES, ttl=30,
                            expected_epoch=stale.epoch).ok
    answers, _ = asyncio.run(_together(pg_dsn, [(c, f"n{i}") for i, c in
                                                enumerate(contexts)]))
    refused = answers[2]
    assert isinstance(refused, FencedEffectRefused)
    assert refused.reason is Reason.STALE_EPOCH
    committed = [a for i, a in enumerate(answers) if i != 2]
    assert all(isinstance(a, tuple) for a in committed), answers
    assert len({a[1] for a in committed}) == 1
    assert sorted(_notes(pg_admin, pg_tenant)) == ["n0", "n1", "n3"]


def test_a_failing_statement_fails_only_its_own_caller(
        pg_dsn: str, pg_stores: StoreFactory, pg_admin: psycopg.Connection[Any],
        pg_tenant: str, table: str) -> None:
    _, contexts = _contexts(pg_stores, pg_tenant, 4)
    notes = ["n0", "bad", "n2", "n3"]
    answers, _ = asyncio.run(_together(pg_dsn, list(zip(contexts, notes, strict=True))))
    assert isinstance(answers[1], errors.CheckViolation)
    assert all(isinstance(a, tuple) for i, a in enumerate(answers) if i != 1), answers
    assert sorted(_notes(pg_admin, pg_tenant)) == ["n0", "n2", "n3"]


def test_a_caller_cancelled_before_its_batch_went_out_writes_nothing(
        pg_dsn: str, pg_stores: StoreFactory, pg_admin: psycopg.Connection[Any],
        pg_tenant: str, table: str) -> None:
    _, contexts = _contexts(pg_stores, pg_tenant, 4)
    first = contexts[0].identity

    async def main() -> list[Any]:
        async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=1, open=False) as pool, \
                await psycopg.AsyncConnection.connect(pg_dsn) as holder:
            # The first effect's batch waits for its lease row (a writer holds it), so the
            # effects submitted meanwhile queue behind it (one batch at a time).
            await holder.execute(
                "SELECT 1 FROM mos_lease.logical_agent_connector_leases WHERE tenant_id = %s"
                " AND logical_agent_id = %s AND binding_id = %s FOR UPDATE",
                (first.tenant_id, first.logical_agent_id, first.binding_id))
            effects = CoalescedEffects(pool, batches=1)

            def submit(i: int) -> asyncio.Task[Any]:
                c = contexts[i]
                return asyncio.create_task(effects.execute(
                    c, INSERT, (c.identity.tenant_id, c.epoch, f"n{i}"), scopes=WRITE))

            tasks = [submit(0)]
            while not effects._in_flight:
                await asyncio.sleep(0)
            tasks += [submit(i) for i in (1, 2, 3)]
            while len(effects._waiting) < 3:
                await asyncio.sleep(0)
            tasks[2].cancel()
            await asyncio.sleep(0)
            assert len(effects._waiting) == 2  # withdrawn
            await holder.commit()
            return await asyncio.gather(*tasks, return_exceptions=True)

    answers = asyncio.run(main())
    assert isinstance(answers[2], asyncio.CancelledError)
    assert sorted(_notes(pg_admin, pg_tenant)) == ["n0", "n1", "n3"]


def test_batches_are_a_positive_int(pg_dsn: str) -> None:
    async def main() -> None:
        async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=1, open=False) as pool:
            with pytest.raises(Exception, match="batches"):
                CoalescedEffects(pool, batches=0)

    asyncio.run(main())
