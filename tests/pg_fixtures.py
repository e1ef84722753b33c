"""pytest fixtures for the PostgreSQL tests (load with ``pytest_plugins = ["tests.pg_fixtures"]``).

* ``pg_server`` (session): the server :func:`pg_support.find_server` found. Without one the
  tests skip, or fail when ``MOS_LEASE_REQUIRE_PG=1`` (CI).
* ``pg_dsn`` (session): a database created for this run on that server, migrated, dropped
  with ``WITH (FORCE)`` at the end; the DSN connects as the server's admin role.
* ``pg_admin`` (session): an autocommit admin connection to that database.
* ``pg_tenant`` (function): a tenant id no other test uses. Tests isolate by tenant instead
  of truncating: the schema refuses TRUNCATE and DELETE by design, and a fresh tenant costs
  nothing.
* ``pg_stores`` (function): makes :class:`PostgresLeaseStore` objects and closes them after.
* ``pg_schema_dsn`` (function): an empty schema of its own (not migrated), dropped after;
  the DSN's search_path is that schema. ``pg_migrated_schema_dsn``: the same, migrated.
* ``pg_harness_factory`` (function): the conformance kit's harness
  (:mod:`mos_lease.testing`) on a store of its own schema; harnesses share that store and
  move its clock offset (runs are isolated by tenant, which the kit already does).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease_pg import PostgresLeaseStore, migrate
from tests.pg_support import (
    PgServer,
    create_database,
    drop_database,
    find_server,
    in_schema,
    require_pg,
    unique_name,
)

StoreFactory = Callable[..., PostgresLeaseStore]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    found = find_server()
    if isinstance(found, str):
        if require_pg():
            pytest.fail(f"MOS_LEASE_REQUIRE_PG is set and {found}", pytrace=False)
        pytest.skip(found)
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="session")
def pg_dsn(pg_server: PgServer) -> Iterator[str]:
    name = unique_name("mos_lease_test")
    dsn = create_database(pg_server.dsn, name)
    try:
        migrate(dsn)
        yield dsn
    finally:
        drop_database(pg_server.dsn, name)


@pytest.fixture(scope="session")
def pg_admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def pg_tenant() -> str:
    return f"tenant-{secrets.token_hex(6)}"


@pytest.fixture
def pg_stores(pg_dsn: str) -> Iterator[StoreFactory]:
    made: list[PostgresLeaseStore] = []

    def make(conninfo: str | None = None, **options: Any) -> PostgresLeaseStore:
        if "pool" in options:
            store = PostgresLeaseStore(**options)
        else:
            store = PostgresLeaseStore(conninfo if conninfo is not None else pg_dsn, **options)
        made.append(store)
        return store

    try:
        yield make
    finally:
        for store in made:
            store.close()


@pytest.fixture
def pg_store(pg_stores: StoreFactory) -> PostgresLeaseStore:
    return pg_stores()


@pytest.fixture
def pg_schema_dsn(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[str]:
    schema = unique_name("s")
    pg_admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        yield in_schema(pg_dsn, schema)
    finally:
        pg_admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def pg_migrated_schema_dsn(pg_schema_dsn: str) -> str:
    migrate(pg_schema_dsn)
    return pg_schema_dsn


class PostgresHarness:
    """A :class:`mos_lease.testing.StoreHarness` for PostgreSQL: the store's time authority
    is the database clock, moved forward by the store's test-only offset."""

    def __init__(self, store: PostgresLeaseStore) -> None:
        self._store = store

    @property
    def store(self) -> PostgresLeaseStore:
        return self._store

    def advance(self, by: timedelta) -> None:
        self._store.advance(by)


@pytest.fixture
def pg_harness_factory(pg_stores: StoreFactory,
                       pg_migrated_schema_dsn: str) -> Callable[[], PostgresHarness]:
    store = pg_stores(pg_migrated_schema_dsn)
    return lambda: PostgresHarness(store)
