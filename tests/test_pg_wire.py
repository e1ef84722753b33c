"""How the stores send a statement: prepared once per connection under a name of their own,
prepared again when the server forgot it, unprepared when told so or past the cap."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from mos_lease import LeaseIdentity
from mos_lease_pg import (
    AsyncPostgresLeaseStore,
    ConnectionSettings,
    PostgresLeaseStore,
    make_pool,
    wire,
)
from mos_lease_pg.wire import Query
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

_OURS = b"SELECT name FROM pg_prepared_statements WHERE name LIKE 'mos\\_lease\\_%' ORDER BY name"


def test_placeholders_become_numbered_parameters_in_first_use_order() -> None:
    query = Query.convert(b"SELECT %(b)s, %(a)s, %(b)s::int, 5 %% 2")
    assert query.text == b"SELECT $1, $2, $1::int, 5 % 2"
    assert query.names == ("b", "a")
    assert len(query.formats) == 2


@pytest.mark.parametrize("text", [b"SELECT %s", b"SELECT 5 % 2", b"SELECT %(a)b"])
def test_other_percent_uses_are_refused(text: bytes) -> None:
    with pytest.raises(ValueError, match="unsupported placeholder"):
        Query.convert(text)


def _prepared(store: PostgresLeaseStore) -> list[str]:
    """The names this store's own session has prepared (other sessions cannot see them)."""
    with store._source.checkout() as w:
        return [row[0] for row in w.conn.execute(_OURS).fetchall()]


def _identity(tenant: str) -> LeaseIdentity:
    return LeaseIdentity(tenant, "agent", "binding")


def test_a_statement_is_prepared_once_per_connection(pg_stores: StoreFactory,
                                                      pg_tenant: str) -> None:
    store = pg_stores()
    for _ in range(5):
        assert store.load(_identity(pg_tenant)).row is None
    assert len(_prepared(store)) == 1
    store.now()
    assert len(_prepared(store)) == 2


def test_a_forgotten_prepared_statement_is_prepared_again(pg_stores: StoreFactory,
                                                          pg_tenant: str) -> None:
    store = pg_stores()
    store.load(_identity(pg_tenant))
    before = _prepared(store)
    with store._source.checkout() as w:
        w.conn.execute(b"DEALLOCATE ALL")
    assert _prepared(store) == []
    assert store.load(_identity(pg_tenant)).row is None
    after = _prepared(store)
    assert len(after) == 1 and after != before  # a fresh name, not a collision


def test_prepare_off_prepares_nothing(pg_stores: StoreFactory, pg_tenant: str) -> None:
    store = pg_stores(settings=ConnectionSettings(prepare=False))
    for _ in range(3):
        assert store.load(_identity(pg_tenant)).row is None
    assert _prepared(store) == []


def test_past_the_cap_statements_run_unprepared(pg_stores: StoreFactory, pg_tenant: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "_MAX_PREPARED", 1)
    store = pg_stores()
    store.load(_identity(pg_tenant))
    now = store.now()
    assert store.now() >= now
    assert len(_prepared(store)) == 1


def test_a_pooled_connection_keeps_its_prepared_statements(pg_dsn: str,
                                                           pg_tenant: str) -> None:
    with make_pool(pg_dsn, min_size=1, max_size=1) as pool:
        store = PostgresLeaseStore(pool=pool)
        for _ in range(3):
            store.load(_identity(pg_tenant))
        with pool.connection() as conn:
            names = conn.execute(_OURS).fetchall()
        assert len(names) == 1


def test_a_statement_error_leaves_the_connection_usable(pg_stores: StoreFactory,
                                                        pg_tenant: str) -> None:
    store = pg_stores()
    bad = Query.convert(b"SELECT 1 / %(zero)s::int")
    with store._source.checkout() as w, pytest.raises(psycopg.errors.DivisionByZero):
        w.conn.wait(w.execute(bad, {"zero": 0}))
    assert store.load(_identity(pg_tenant)).row is None


def test_the_async_store_prepares_again_after_deallocate(pg_dsn: str, pg_tenant: str) -> None:
    async def scenario() -> list[Any]:
        async with AsyncPostgresLeaseStore(pg_dsn) as store:
            await store.load(_identity(pg_tenant))
            async with store._source.checkout() as w:
                await w.conn.execute(b"DEALLOCATE ALL")
            assert (await store.load(_identity(pg_tenant))).row is None
            async with store._source.checkout() as w:
                cur = await w.conn.execute(_OURS)
                return await cur.fetchall()

    assert len(asyncio.run(scenario())) == 1
