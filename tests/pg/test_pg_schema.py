"""The schema is explicit: every statement names it, ``migrate`` takes it (and refuses a
second copy of the tables), and a store checks on first use that it exists at the version
it needs and that its role may do what the store does, failing with a
``ConfigurationError`` that names the fix (never ``StoreUnavailable``, which keepers retry).

The run's database holds the tables in ``mos_lease``; the admin role's search_path is
``public``, so every PostgreSQL test here also shows that nothing depends on it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Iterator
from importlib import resources
from typing import Any

import psycopg
import psycopg_pool
import pytest
from psycopg import sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.errors import ConfigurationError
from mos_lease_pg import (
    AsyncPostgresLeaseStore,
    ConnectionSettings,
    PostgresLeaseStore,
    effects,
    fencing,
    make_pool,
    preflight,
    reconcile,
    sql_files,
    statements,
)
from mos_lease_pg.admin import applied_versions, migrate
from mos_lease_pg.admin.cli import register
from mos_lease_pg.admin.migrations import SecondCopyRefused
from mos_lease_pg.fencing import PostgresResourceGuard
from mos_lease_pg.sql_files import (
    DEFAULT_SCHEMA,
    LIBRARY_TABLES,
    Template,
    UnqualifiedStatement,
    checked,
    unqualified,
)
from tests.pg_fixtures import PgSchema, StoreFactory
from tests.pg_support import in_schema, unique_name, with_params

LATEST = preflight.required_version()


# --- the loader (no database) ---------------------------------------------------------------


def test_the_loader_refuses_a_table_named_without_its_schema() -> None:
    with pytest.raises(UnqualifiedStatement, match="logical_agent_connector_leases"):
        checked("bad.sql", "SELECT 1 FROM logical_agent_connector_leases")
    with pytest.raises(UnqualifiedStatement, match="connector_lease_audit_log"):
        checked("bad.sql", 'SELECT 1 FROM "mos_lease".connector_lease_audit_log')
    good = "SELECT 1 FROM {schema}.logical_agent_connector_leases AS l"
    assert checked("good.sql", good) == good
    # Longer names that merely start with a table's name are other objects.
    assert unqualified("CREATE TRIGGER logical_agent_connector_leases_fencing") == []


# Every folder of files sent as they are (the migrations themselves run with a pinned
# search_path instead: see migrations.py).
SENT_FOLDERS = ("statements", "migrate", "audit", "check", "describe", "setup", "preflight",
                "notices")


def _shipped() -> dict[str, str]:
    found = {}
    for name in SENT_FOLDERS:
        folder = resources.files("mos_lease_pg").joinpath("sql", name)
        found.update({f"{name}/{item.name}": item.read_text("utf-8")
                      for item in folder.iterdir() if item.name.endswith(".sql")})
    return found


def test_every_shipped_statement_file_names_its_schema() -> None:
    shipped = _shipped()
    assert {"statements/renew.sql", "migrate/lock.sql", "audit/drop.sql"} <= set(shipped)
    bare = {name: unqualified(sql_files._COMMENT_LINE.sub("", text))
            for name, text in shipped.items()}
    assert {name: found for name, found in bare.items() if found} == {}


def _templates() -> dict[str, Template]:
    found: dict[str, Template] = {}
    for module in (statements, effects, fencing, reconcile):
        for name, value in vars(module).items():
            if isinstance(value, Template):
                found[f"{module.__name__}.{name}"] = value
    for write, template in statements.WRITES.items():
        found[f"WRITES[{write.__name__}]"] = template
    return found


def test_every_statement_sent_names_its_schema() -> None:
    templates = _templates()
    assert len(templates) >= 15
    for name, template in templates.items():
        text = template.at("elsewhere").text.decode()
        assert "{schema}" not in text, name
        for table in LIBRARY_TABLES:
            assert text.count(table) == text.count(f'"elsewhere".{table}'), (name, table)


def test_the_schema_setting_is_a_plain_identifier() -> None:
    assert ConnectionSettings().schema == DEFAULT_SCHEMA == "mos_lease"
    assert ConnectionSettings(schema="tenant_a_2").schema == "tenant_a_2"
    for bad in ("", "Mos", 'a"b', "a;b", "a.b", "1st", "x" * 64, 7, None):
        with pytest.raises(ConfigurationError, match="schema"):
            ConnectionSettings(schema=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        migrate("dbname=unused", schema='x"; DROP TABLE y; --')


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mos-lease")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_every_command_takes_the_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOS_LEASE_SCHEMA", raising=False)
    for command in ("migrate", "status", "audit"):
        assert _parse(command, "--dsn", "x").schema == DEFAULT_SCHEMA
        assert _parse(command, "--dsn", "x", "--schema", "other").schema == "other"
        with pytest.raises(SystemExit):
            _parse(command, "--dsn", "x", "--schema", "Bad-Name")
    assert _parse("migrate", "--dsn", "x", "--allow-second-copy").allow_second_copy
    assert not _parse("migrate", "--dsn", "x").allow_second_copy
    monkeypatch.setenv("MOS_LEASE_SCHEMA", "from_env")
    assert _parse("status", "--dsn", "x").schema == "from_env"


# --- migrate -------------------------------------------------------------------------------


def _tables_in(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    return [name for (name,) in conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind IN ('r', 'p') AND NOT c.relispartition"
        " ORDER BY 1", (schema,))]


@pytest.mark.pg
def test_migrate_as_postgres_builds_nothing_in_public(pg_dsn: str,
                                                      pg_admin: psycopg.Connection[Any]) -> None:
    # Found only through search_path: postgres's search_path is "$user", public.
    assert migrate(pg_dsn) == []
    assert migrate(in_schema(pg_dsn, "public")) == []
    assert [t for t in _tables_in(pg_admin, "public") if t in LIBRARY_TABLES] == []
    assert applied_versions(pg_dsn) == list(range(1, LATEST + 1))


@pytest.mark.pg
def test_migrate_refuses_a_second_copy_unless_asked(pg_schema_dsn: PgSchema,
                                                    pg_admin: psycopg.Connection[Any]) -> None:
    target = pg_schema_dsn
    with pytest.raises(SecondCopyRefused) as refused:
        migrate(target.dsn, schema=target.schema)
    assert isinstance(refused.value, ConfigurationError)
    assert "--schema mos_lease" in str(refused.value)
    assert "--allow-second-copy" in str(refused.value)
    assert _tables_in(pg_admin, target.schema) == []  # refused before creating anything
    assert migrate(target.dsn, schema=target.schema, allow_second_copy=True) == list(
        range(1, LATEST + 1))
    # Now that this schema holds them, migrating it again needs no flag.
    assert migrate(target.dsn, schema=target.schema) == []


@pytest.mark.pg
def test_migrate_creates_the_schema_and_ignores_the_search_path(
        pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> None:
    schema = unique_name("fresh")
    try:
        # A misleading search_path (an existing schema) changes nothing.
        misleading = in_schema(pg_dsn, "public")
        assert migrate(misleading, schema=schema, allow_second_copy=True) == list(
            range(1, LATEST + 1))
        assert set(LIBRARY_TABLES) <= set(_tables_in(pg_admin, schema))
        assert [t for t in _tables_in(pg_admin, "public") if t in LIBRARY_TABLES] == []
        comment = pg_admin.execute(
            "SELECT obj_description(%s::regclass, 'pg_class')",
            (f'"{schema}".mos_lease_schema_migrations',)).fetchone()
        assert comment == (f"mos-lease schema version {LATEST}",)
    finally:
        pg_admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                         .format(sql.Identifier(schema)))


@pytest.mark.pg
def test_status_as_postgres_lists_the_leases(pg_dsn: str, pg_stores: StoreFactory,
                                             pg_tenant: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    gateway = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    assert gateway.acquire(LeaseIdentity(pg_tenant, "a", "b"), "c", scopes=[], ttl=60).ok
    args = _parse("status", "--dsn", in_schema(pg_dsn, "public"), "--tenant", pg_tenant)
    assert args.func(args) == 0
    assert "1 lease(s)" in capsys.readouterr().out


# --- the first-use check -------------------------------------------------------------------


@pytest.mark.pg
def test_a_missing_schema_is_a_configuration_error(pg_dsn: str) -> None:
    settings = ConnectionSettings(schema=unique_name("absent"))
    store = PostgresLeaseStore(pg_dsn, settings=settings)
    try:
        with pytest.raises(ConfigurationError,
                           match=f"mos-lease migrate --schema {settings.schema}"):
            store.load(LeaseIdentity("t", "a", "b"))
        with pytest.raises(ConfigurationError):  # again: nothing was cached as passed
            store.now()
    finally:
        store.close()


@pytest.mark.pg
def test_an_unmigrated_schema_is_a_configuration_error(pg_schema_dsn: PgSchema) -> None:
    with PostgresLeaseStore(pg_schema_dsn.dsn, settings=pg_schema_dsn.settings()) as store, \
            pytest.raises(ConfigurationError, match=r"has no .*mos-lease migrate --schema"):
        store.leases()


@pytest.mark.pg
def test_an_outdated_schema_is_a_configuration_error(pg_migrated_schema_dsn: PgSchema,
                                                     pg_admin: psycopg.Connection[Any]) -> None:
    target = pg_migrated_schema_dsn
    table = sql.SQL("{}.mos_lease_schema_migrations").format(sql.Identifier(target.schema))
    pg_admin.execute(sql.SQL("COMMENT ON TABLE {} IS 'mos-lease schema version 1'")
                     .format(table))
    if LATEST > 1:
        with PostgresLeaseStore(target.dsn, settings=target.settings()) as store, \
                pytest.raises(ConfigurationError, match=f"version 1, this mos-lease needs "
                              f"{LATEST}: run `mos-lease migrate --schema {target.schema}`"):
            store.load(LeaseIdentity("t", "a", "b"))
    # Without the comment, a role that may read the bookkeeping table is answered from it.
    pg_admin.execute(sql.SQL("COMMENT ON TABLE {} IS NULL").format(table))
    with PostgresLeaseStore(target.dsn, settings=target.settings()) as store:
        store.load(LeaseIdentity("t", "a", "b"))
        check = store._source.schema_check
        assert check is not None and check.version == LATEST


@pytest.fixture
def weak_role(pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> Iterator[str]:
    """A login role that may use the schema and read the lease table, nothing more."""
    role = unique_name("weak")
    pg_admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        pg_admin.execute(sql.SQL("GRANT USAGE ON SCHEMA mos_lease TO {}")
                         .format(sql.Identifier(role)))
        pg_admin.execute(sql.SQL("GRANT SELECT ON mos_lease.logical_agent_connector_leases"
                                 " TO {}").format(sql.Identifier(role)))
        yield with_params(pg_dsn, user=role)
    finally:
        pg_admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        pg_admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.pg
def test_a_missing_privilege_is_a_configuration_error(weak_role: str) -> None:
    with PostgresLeaseStore(weak_role) as store, \
            pytest.raises(ConfigurationError, match="roles step") as refused:
        store.load(LeaseIdentity("t", "a", "b"))
    message = str(refused.value)
    assert "INSERT on logical_agent_connector_leases" in message
    assert "UPDATE (lease_id, connector_id" in message
    assert "SELECT on connector_lease_audit_log" in message
    assert "SELECT on logical_agent_connector_leases" not in message


@pytest.mark.pg
def test_pooled_and_async_stores_check_too(pg_dsn: str) -> None:
    settings = ConnectionSettings(schema=unique_name("absent"))
    with make_pool(pg_dsn, settings) as pool:
        store = PostgresLeaseStore(pool=pool, settings=settings)
        with pytest.raises(ConfigurationError, match="migrate --schema"):
            store.now()

    async def scenario() -> None:
        async with AsyncPostgresLeaseStore(pg_dsn, settings=settings) as dedicated:
            with pytest.raises(ConfigurationError, match="migrate --schema"):
                await dedicated.now()
        pool = psycopg_pool.AsyncConnectionPool(pg_dsn, open=False, kwargs={"autocommit": True})
        await pool.open()
        try:
            pooled = AsyncPostgresLeaseStore(pool=pool, settings=settings)
            with pytest.raises(ConfigurationError, match="migrate --schema"):
                await pooled.now()
        finally:
            await pool.close()

    asyncio.run(scenario())


@pytest.mark.pg
def test_more_privileges_than_needed_are_reported_once_not_refused(
        pg_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mos_lease_pg")
    with PostgresLeaseStore(pg_dsn) as store:  # the superuser
        store.load(LeaseIdentity("t", "a", "b"))
        store.now()
        check = store._source.schema_check
    assert check is not None and check.version == LATEST and check.schema == DEFAULT_SCHEMA
    assert check.surplus[0] == "superuser"
    assert any("DELETE on logical_agent_connector_leases" in s for s in check.surplus)
    warned = [r for r in caplog.records if "never uses" in r.getMessage()]
    assert len(warned) == 1


@pytest.mark.pg
def test_a_table_gone_after_the_check_is_a_configuration_error(
        pg_migrated_schema_dsn: PgSchema, pg_admin: psycopg.Connection[Any]) -> None:
    target = pg_migrated_schema_dsn
    with PostgresLeaseStore(target.dsn, settings=target.settings()) as store:
        store.load(LeaseIdentity("t", "a", "b"))
        pg_admin.execute(sql.SQL("ALTER TABLE {}.logical_agent_connector_leases RENAME TO gone")
                         .format(sql.Identifier(target.schema)))
        with pytest.raises(ConfigurationError, match="roles step"):
            store.load(LeaseIdentity("t", "a", "b"))


@pytest.mark.pg
def test_the_resource_guard_uses_its_schema_not_the_search_path(
        pg_migrated_schema_dsn: PgSchema) -> None:
    target = pg_migrated_schema_dsn
    # The connection's search_path names the per-test copy; the guard names mos_lease.
    with psycopg.connect(in_schema(target.dsn, target.schema), autocommit=True) as conn:
        conn.execute("INSERT INTO connector_resource_epochs VALUES"
                     " ('only-here', 't', 'a', 'b', 1, clock_timestamp())")
        assert PostgresResourceGuard(conn).state("only-here") is None
        found = PostgresResourceGuard(conn, schema=target.schema).state("only-here")
        assert found is not None and found.highest_epoch == 1
        with pytest.raises(ConfigurationError):
            PostgresResourceGuard(conn, schema=unique_name("absent")).state("x")
