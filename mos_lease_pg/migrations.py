"""Versioned schema migrations: ``sql/migrations/NNNN_name.sql``, applied in order.

``migrate`` is idempotent and safe to run from several gateways at once: it creates the
bookkeeping table ``mos_lease_schema_migrations`` if missing, then applies each pending
version in its own transaction, holding an ACCESS EXCLUSIVE lock on that table while it
checks and applies, so concurrent migrators queue up and each version is applied once. No
advisory locks, so it also works through a transaction-pooling proxy.

Objects are created in the first schema of the connecting role's search_path; run it as the
owner role (see ``roles.sql``).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import attrs
import psycopg
from psycopg import errors as pg_errors

from mos_lease.errors import MosLeaseError
from mos_lease_pg.statements import sql_text

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_CREATE_RACE_RETRIES = 5


class MigrationError(MosLeaseError):
    """The schema could not be brought up to date; nothing partial was committed for the
    version that failed."""


@attrs.frozen(slots=True)
class Migration:
    version: int
    name: str
    sql: str


def available_migrations() -> list[Migration]:
    """Every migration shipped with this package, in version order."""
    folder = resources.files("mos_lease_pg").joinpath("sql", "migrations")
    found = []
    for item in folder.iterdir():
        match = _NAME.match(item.name)
        if match:
            found.append(Migration(int(match[1]), match[2], item.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration versions must run 1..n without gaps: {versions}")
    return found


def _connect(conninfo: str) -> psycopg.Connection[Any]:
    try:
        return psycopg.Connection.connect(conninfo, autocommit=True, prepare_threshold=None,
                                          application_name="mos-lease migrate")
    except psycopg.Error as exc:
        raise MigrationError(f"cannot connect to PostgreSQL: {exc}") from exc


def _ensure_bookkeeping(conn: psycopg.Connection[Any]) -> None:
    # CREATE TABLE IF NOT EXISTS is not atomic against a concurrent identical CREATE: the
    # loser can fail on the catalog's unique index. The table exists then, so try again.
    for _ in range(_CREATE_RACE_RETRIES):
        try:
            conn.execute(sql_text("migrations_table.sql").encode("utf-8"))
            return
        except (pg_errors.UniqueViolation, pg_errors.DuplicateTable, pg_errors.DuplicateObject):
            continue
    raise MigrationError("could not create mos_lease_schema_migrations")


def _applied(conn: psycopg.Connection[Any]) -> set[int]:
    return {v for (v,) in conn.execute(b"SELECT version FROM mos_lease_schema_migrations")}


def applied_versions(conninfo: str) -> list[int]:
    """The versions recorded in the database (empty if it was never migrated)."""
    with _connect(conninfo) as conn:
        exists = conn.execute(b"SELECT to_regclass('mos_lease_schema_migrations')").fetchone()
        if exists is None or exists[0] is None:
            return []
        return sorted(_applied(conn))


def migrate(conninfo: str) -> list[int]:
    """Apply every pending migration; return the versions this call applied."""
    done: list[int] = []
    with _connect(conninfo) as conn:
        try:
            _ensure_bookkeeping(conn)
            for migration in available_migrations():
                with conn.transaction():
                    conn.execute(
                        b"LOCK TABLE mos_lease_schema_migrations IN ACCESS EXCLUSIVE MODE")
                    if migration.version in _applied(conn):
                        continue  # another migrator got here first
                    # No parameters: sent as a simple query, so one file may hold many
                    # statements (and "%" in it is not a placeholder).
                    conn.execute(migration.sql.encode("utf-8"))
                    conn.execute(
                        b"INSERT INTO mos_lease_schema_migrations (version, name)"
                        b" VALUES (%s, %s)", (migration.version, migration.name))
                done.append(migration.version)
        except psycopg.Error as exc:
            raise MigrationError(f"migration failed: {exc}") from exc
    return done
