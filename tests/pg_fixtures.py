"""pytest fixtures for the PostgreSQL tests (load with ``pytest_plugins = ["tests.pg_fixtures"]``).

* ``pg_server`` (session): the server :func:`pg_support.find_server` found. Without one the
  tests skip, or fail when ``MOS_LEASE_REQUIRE_PG=1`` (CI).
* ``pg_dsn`` (session): a database created for this run on that server, migrated into the
  default schema ``mos_lease`` (by name: the admin role's search_path is ``public``), dropped
  with ``WITH (FORCE)`` at the end; the DSN connects as the server's admin role.
* ``pg_admin`` (session): an autocommit admin connection to that database, for the tests'
  own SQL: its search_path is ``public, mos_lease`` so that SQL may name tables briefly
  (what tests create lands in ``public``).
  The library never relies on one: stores and ``migrate`` get ``pg_dsn``, whose search_path
  is the server default (``public``, where no tables are).
* ``pg_tenant`` (function): a tenant id no other test uses. Tests isolate by tenant instead
  of truncating: the schema refuses TRUNCATE and DELETE by design, and a fresh tenant costs
  nothing.
* ``pg_stores`` (function): makes :class:`PostgresLeaseStore` objects and closes them after.
* ``pg_schema_dsn`` (function): a :class:`PgSchema`, an empty schema of its own (not
  migrated) in the run's database, dropped after; stores reach it by
  ``ConnectionSettings(schema=...)`` (``PgSchema.settings``), never by search_path.
  ``pg_migrated_schema_dsn``: the same, migrated (a deliberate second copy of the tables).
* ``pg_harness_factory`` (function): the conformance kit's harness
  (:mod:`mos_lease.testing`) on a store of its own schema; harnesses share that store and
  move its clock offset (runs are isolated by tenant, which the kit already does).
* ``pg_own_cluster`` (session): a throwaway cluster of this run's own, for tests that make
  roles under their default names (roles are cluster-wide); ``pg_set_up`` (function): a new
  database on it, brought to the working layout by ``mos-lease setup``
  (:class:`SetUpDatabase`: DSNs as a superuser, the owner and the gateway role), dropped
  after. The documentation's PostgreSQL snippets and the examples run on it.
* ``proxy`` (function): a :class:`~tests.pg_support.FaultProxy` in front of ``pg_dsn``
  (stores reach the server through ``proxy.dsn``), closed after.
"""

from __future__ import annotations

import argparse
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from mos_lease.identity import LeaseIdentity
from mos_lease_pg import ConnectionSettings
from mos_lease_pg.admin import migrate
from mos_lease_pg.admin.cli import register
from mos_lease_pg.admin.roles import DEFAULT_GATEWAY_ROLE, DEFAULT_OWNER_ROLE, set_up
from mos_lease_pg.sql_files import DEFAULT_SCHEMA
from tests.pg_clock import ShiftedPostgresLeaseStore
from tests.pg_support import (
    FaultProxy,
    PgServer,
    create_database,
    drop_database,
    find_server,
    in_schema,
    require_pg,
    throwaway_cluster,
    unique_name,
    with_params,
)

StoreFactory = Callable[..., ShiftedPostgresLeaseStore]


@attrs.frozen
class PgSchema:
    """A schema of the run's database: ``dsn`` connects as the admin role (whose search_path
    does not include it), ``schema`` names it."""

    dsn: str
    schema: str

    def settings(self, **options: Any) -> ConnectionSettings:
        return ConnectionSettings(schema=self.schema, **options)


def allow_test_clock(dsn: str, schema: str = DEFAULT_SCHEMA) -> None:
    """Let writes in ``schema`` be stamped ahead of the database clock, as the test stores
    of ``tests/pg_clock.py`` stamp them (the schema allows none by default)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {}.mos_lease_settings SET clock_allowance = "
                             "interval '10 years'").format(sql.Identifier(schema)))


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
        allow_test_clock(dsn)
        yield dsn
    finally:
        drop_database(pg_server.dsn, name)


@pytest.fixture(scope="session")
def pg_admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(in_schema(pg_dsn, f"public,{DEFAULT_SCHEMA}"), autocommit=True) as conn:
        yield conn


@pytest.fixture
def pg_tenant() -> str:
    return f"tenant-{secrets.token_hex(6)}"


@pytest.fixture
def pg_stores(pg_dsn: str) -> Iterator[StoreFactory]:
    made: list[ShiftedPostgresLeaseStore] = []

    def make(conninfo: str | None = None, **options: Any) -> ShiftedPostgresLeaseStore:
        if "pool" in options:
            store = ShiftedPostgresLeaseStore(**options)
        else:
            store = ShiftedPostgresLeaseStore(conninfo if conninfo is not None else pg_dsn,
                                              **options)
        made.append(store)
        return store

    try:
        yield make
    finally:
        for store in made:
            store.close()


@pytest.fixture
def pg_store(pg_stores: StoreFactory) -> ShiftedPostgresLeaseStore:
    return pg_stores()


@pytest.fixture
def pg_schema_dsn(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[PgSchema]:
    schema = unique_name("s")
    pg_admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        yield PgSchema(pg_dsn, schema)
    finally:
        pg_admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def pg_migrated_schema_dsn(pg_schema_dsn: PgSchema) -> PgSchema:
    # The run's database holds the tables in mos_lease already: this copy is on purpose.
    migrate(pg_schema_dsn.dsn, schema=pg_schema_dsn.schema, allow_second_copy=True)
    allow_test_clock(pg_schema_dsn.dsn, pg_schema_dsn.schema)
    return pg_schema_dsn


class PostgresHarness:
    """A :class:`mos_lease.testing.StoreHarness` for PostgreSQL: the store's time authority
    is the database clock, moved forward by the store's test-only offset."""

    def __init__(self, store: ShiftedPostgresLeaseStore) -> None:
        self._store = store

    @property
    def store(self) -> ShiftedPostgresLeaseStore:
        return self._store

    def advance(self, by: timedelta) -> None:
        self._store.advance(by)


class LockingPostgresHarness(PostgresHarness):
    """:class:`PostgresHarness` that can also hold a lease row from another session
    (``hold_row``, as a fenced transaction holds it), for the kit's batch case."""

    def __init__(self, store: ShiftedPostgresLeaseStore, dsn: str) -> None:
        super().__init__(store)
        self._dsn = dsn

    @contextmanager
    def hold_row(self, identity: LeaseIdentity) -> Iterator[None]:
        """``identity``'s lease row held ``FOR SHARE`` by another session until the block
        exits."""
        with psycopg.connect(self._dsn) as conn:
            conn.execute(sql.SQL(
                "SELECT 1 FROM {}.logical_agent_connector_leases WHERE tenant_id = %s "
                "AND logical_agent_id = %s AND binding_id = %s FOR SHARE").format(
                    sql.Identifier(self._store.settings.schema)),
                (identity.tenant_id, identity.logical_agent_id, identity.binding_id))
            yield


@pytest.fixture
def pg_harness_factory(pg_stores: StoreFactory,
                       pg_migrated_schema_dsn: PgSchema) -> Callable[[], PostgresHarness]:
    store = pg_stores(pg_migrated_schema_dsn.dsn, settings=pg_migrated_schema_dsn.settings())
    return lambda: LockingPostgresHarness(store, pg_migrated_schema_dsn.dsn)


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(pg_dsn)
    try:
        yield fault_proxy
    finally:
        fault_proxy.close()


@pytest.fixture(scope="session")
def pg_own_cluster() -> Iterator[PgServer]:
    found = throwaway_cluster()
    if isinstance(found, str):
        if require_pg():
            pytest.fail(f"MOS_LEASE_REQUIRE_PG is set and {found}", pytrace=False)
        pytest.skip(found)
    try:
        yield found
    finally:
        found.stop()


@attrs.frozen
class SetUpDatabase:
    """A database after ``mos-lease setup``: DSNs as a superuser, as the owner role and as
    the gateway role (``mos_lease_gateway``), which is how gateways connect."""

    admin_dsn: str
    owner_dsn: str
    gateway_dsn: str

    def environ(self) -> dict[str, str]:
        """The variables the documentation's snippets read."""
        return {"ADMIN_DSN": self.admin_dsn, "OWNER_DSN": self.owner_dsn,
                "MOS_LEASE_DSN": self.gateway_dsn}


@pytest.fixture
def pg_set_up(pg_own_cluster: PgServer) -> Iterator[SetUpDatabase]:
    name = unique_name("mos_lease_setup")
    admin_dsn = create_database(pg_own_cluster.dsn, name)
    try:
        set_up(admin_dsn)
        yield SetUpDatabase(admin_dsn, with_params(admin_dsn, user=DEFAULT_OWNER_ROLE),
                            with_params(admin_dsn, user=DEFAULT_GATEWAY_ROLE))
    finally:
        drop_database(pg_own_cluster.dsn, name)


def run_cli(*argv: str) -> int:
    """``mos-lease ARGV...`` in this process, as the console script parses it: its exit
    status (what it prints goes to the captured stdout and stderr)."""
    parser = argparse.ArgumentParser(prog="mos-lease")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code
