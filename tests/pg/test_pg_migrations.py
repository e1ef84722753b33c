"""Migrations: they build exactly the shipped schema in the schema they are given (the
admin role's search_path says ``public``), are idempotent, survive concurrent migrators, and
a failed one leaves nothing behind. Each test's schema is a second copy of the tables in the
run's database (which holds them in ``mos_lease``), so it is migrated with
``allow_second_copy``; the refusal itself is tested in test_pg_schema.py."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import psycopg
import pytest
from psycopg import sql

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease_pg import ConnectionSettings, PostgresLeaseStore
from mos_lease_pg.admin import (
    MigrationError,
    applied_versions,
    archive,
    available_migrations,
    describe_schema,
    migrate,
)
from mos_lease_pg.sql_files import DEFAULT_SCHEMA
from tests.pg_fixtures import PgSchema

pytestmark = pytest.mark.pg


def _migrate(target: PgSchema) -> list[int]:
    return migrate(target.dsn, schema=target.schema, allow_second_copy=True)


def _describe(dsn: str, schema: str = DEFAULT_SCHEMA) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return describe_schema(conn, schema)


def _library_part(lines: list[str], like: list[str]) -> list[str]:
    """The lines of ``lines`` about objects that ``like`` describes too: the shared test
    database also holds tables other tests create (example ledgers, effect tables)."""
    def name(line: str) -> str:
        return line.split(": ", 1)[1].split(" | ", 1)[0]

    names = {name(line) for line in like}
    return [line for line in lines if name(line) in names]


def _versions(target: PgSchema) -> list[tuple[int, str]]:
    with psycopg.connect(target.dsn) as conn:
        return [(v, n) for v, n in conn.execute(
            f'SELECT version, name FROM "{target.schema}".mos_lease_schema_migrations'
            " ORDER BY version")]


def test_shipped_migrations_are_numbered_without_gaps() -> None:
    migrations = available_migrations()
    assert [m.version for m in migrations] == list(range(1, len(migrations) + 1))
    assert migrations[0].name == "initial"


def test_migrations_build_the_schema_described_here(pg_schema_dsn: PgSchema,
                                                    pg_dsn: str) -> None:
    assert _migrate(pg_schema_dsn) == [m.version for m in available_migrations()]
    migrated = _describe(pg_schema_dsn.dsn, pg_schema_dsn.schema)
    text = "\n".join(migrated)
    # The description is detailed enough to notice what matters.
    for fact in ("table: logical_agent_connector_leases | r | fillfactor=90",
                 "connector_lease_audit_log_append_only",
                 "logical_agent_connector_leases_fencing",
                 "logical_agent_connector_leases_times",
                 "logical_agent_connector_leases_no_delete",
                 "connector_lease_event_ids | CREATE UNIQUE INDEX connector_lease_event_ids_pkey",
                 "connector_lease_audit_log_event_claim",
                 "connector_lease_audit_log_event_id_time",
                 "connector_lease_audit_log_stamp",
                 "connector_lease_audit_log | p |",
                 "connector_lease_audit_log_default | connector_lease_audit_log_no_truncate",
                 "CHECK ((epoch >= 1))",
                 "table: connector_resource_epochs",
                 "column: logical_agent_connector_leases | 7 | epoch | bigint | true"):
        assert fact in text, fact
    # No column that could carry what the audit log must never hold.
    audit_columns = {line.split(" | ")[2] for line in migrated
                     if line.startswith("column: connector_lease_audit_log |")}
    assert audit_columns == {"seq", "event_id", "event", "outcome", "reason", "tenant_id",
                             "logical_agent_id", "binding_id", "connector_id", "epoch",
                             "correlation_id", "recorded_at"}
    # The main test database was migrated the same way.
    assert _library_part(_describe(pg_dsn), migrated) == migrated


def test_migrate_is_idempotent(pg_schema_dsn: PgSchema) -> None:
    assert _migrate(pg_schema_dsn) == [m.version for m in available_migrations()]
    assert _migrate(pg_schema_dsn) == []
    assert applied_versions(pg_schema_dsn.dsn, schema=pg_schema_dsn.schema) == list(range(1, 12))
    assert _versions(pg_schema_dsn) == [(1, "initial"), (2, "transitions"),
                                        (3, "audit_partitions"), (4, "audit_integrity"),
                                        (5, "clock_steps"), (6, "fast_legal_writes"),
                                        (7, "holder_metadata"), (8, "short_fences"),
                                        (9, "event_ids_by_time"), (10, "metadata_rules"),
                                        (11, "set_records")]


def _applied_by(output: str) -> list[int]:
    """The versions a ``mos-lease migrate`` run says it applied (``applied migrations: 9,
    10``: read as numbers, so version 10 is not taken for version 1)."""
    for line in output.splitlines():
        if line.startswith("applied migrations: "):
            return [int(v) for v in line.split(": ", 1)[1].split(", ")]
    return []


def test_concurrent_migrators_apply_each_version_once(pg_schema_dsn: PgSchema,
                                                      pg_dsn: str) -> None:
    assert applied_versions(pg_schema_dsn.dsn, schema=pg_schema_dsn.schema) == []
    command = [sys.executable, "-m", "mos_lease_pg", "migrate", "--dsn", pg_schema_dsn.dsn,
               "--schema", pg_schema_dsn.schema, "--allow-second-copy"]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(4)]
    outputs = [run.communicate(timeout=60) for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0, 0], outputs
    assert sum(1 in _applied_by(out) for out, _ in outputs) == 1
    assert _versions(pg_schema_dsn) == [(1, "initial"), (2, "transitions"),
                                        (3, "audit_partitions"), (4, "audit_integrity"),
                                        (5, "clock_steps"), (6, "fast_legal_writes"),
                                        (7, "holder_metadata"), (8, "short_fences"),
                                        (9, "event_ids_by_time"), (10, "metadata_rules"),
                                        (11, "set_records")]
    migrated = _describe(pg_schema_dsn.dsn, pg_schema_dsn.schema)
    assert migrated == _library_part(_describe(pg_dsn), migrated)


def test_a_failed_migration_leaves_nothing_behind(pg_schema_dsn: PgSchema) -> None:
    schema = pg_schema_dsn.schema
    with psycopg.connect(pg_schema_dsn.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema}".connector_lease_audit_log (squatter int)')
    with pytest.raises(MigrationError, match="already exists"):
        _migrate(pg_schema_dsn)
    assert applied_versions(pg_schema_dsn.dsn, schema=schema) == []
    with psycopg.connect(pg_schema_dsn.dsn) as conn:
        left = conn.execute("SELECT to_regclass(%s), to_regproc(%s)",
                            (f'"{schema}".logical_agent_connector_leases',
                             f'"{schema}".mos_lease_refuse')).fetchone()
    assert left == (None, None)


def test_unreachable_database_is_a_migration_error() -> None:
    with pytest.raises(MigrationError, match="cannot connect"):
        migrate("host=127.0.0.1 port=1 dbname=x user=x connect_timeout=2")


def test_a_schema_named_by_a_keyword_is_built_used_and_kept_append_only(
        pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> None:
    # "select" is a plain lower-case identifier, so check_schema accepts it, but SQL needs it
    # quoted: every statement and function that names the schema must quote it once.
    schema = "select"
    try:
        assert migrate(pg_dsn, schema=schema, allow_second_copy=True) == list(range(1, 12))
        with PostgresLeaseStore(pg_dsn, settings=ConnectionSettings(schema=schema)) as store:
            gateway = ConnectorLeaseCoordinator(store, AllowAllPolicy())
            acquired = gateway.acquire(LeaseIdentity("t", "a", "b"), "c1", scopes=["tool:run"],
                                       ttl=30)
            assert acquired.ok
        made = archive.make_partitions(pg_dsn, schema, archive.MONTHS_AHEAD + 1)
        assert len(made) == 1
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            log = sql.SQL('"select".connector_lease_audit_log')
            for part in archive.partitions(conn, schema):
                table = sql.SQL('"select".{}').format(sql.Identifier(part.name))
                with pytest.raises(psycopg.errors.RestrictViolation):
                    conn.execute(sql.SQL("DELETE FROM {}").format(table))
            with pytest.raises(psycopg.errors.RestrictViolation):
                conn.execute(sql.SQL("UPDATE {} SET reason = 'x'").format(log))
            assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(log)).fetchone() == (1,)
    finally:
        pg_admin.execute('DROP SCHEMA IF EXISTS "select" CASCADE')
