"""Versioned schema migrations: ``sql/migrations/NNNN_name.sql``, applied in order.

``migrate`` is idempotent and safe to run from several gateways at once: it creates the
bookkeeping table ``mos_lease_schema_migrations`` if missing, then applies each pending
version in its own transaction, holding an ACCESS EXCLUSIVE lock on that table while it
checks and applies, so concurrent migrators queue up and each version is applied once. No
advisory locks, so it also works through a transaction-pooling proxy.

The schema is explicit (default ``mos_lease``), never the connecting role's search_path: a
role whose search_path starts elsewhere (``postgres`` finds ``public``) would otherwise build
a second, empty copy of the tables, and a gateway using that copy would hold identities
another gateway holds, at epoch 1 again. ``migrate`` creates the schema if it is missing
(when the role may), runs each migration file with ``SET LOCAL search_path`` pinned to that
schema and ``pg_catalog`` (the files' DDL is unqualified), keeps its bookkeeping table in
that schema, and refuses to build the tables when another schema of the database already
holds them, unless ``allow_second_copy=True``. Run it as the owner role (see ``mos-lease roles``).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from mos_lease.errors import ConfigurationError
from mos_lease_pg.admin.archive import MONTHS_AHEAD
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, check_schema, schema_query
from mos_lease_pg.versions import Migration, MigrationError, available_migrations

_CREATE_RACE_RETRIES = 5

# The shipped versions (mos_lease_pg.versions, which a store's first-use check also reads)
# are part of what this module offers beside applying them.
__all__ = ["Migration", "MigrationError", "SecondCopyRefused", "applied_versions",
           "available_migrations", "migrate", "other_copies"]


class SecondCopyRefused(MigrationError, ConfigurationError):
    """The tables already exist in another schema of the database: building a second copy
    would let two gateways hold the same identity, one in each copy."""


def _connect(conninfo: str) -> psycopg.Connection[Any]:
    try:
        return psycopg.Connection.connect(conninfo, autocommit=True, prepare_threshold=None,
                                          application_name="mos-lease migrate")
    except psycopg.Error as exc:
        raise MigrationError(f"cannot connect to PostgreSQL: {exc}") from exc


LEASES = "logical_agent_connector_leases"
BOOKKEEPING = "mos_lease_schema_migrations"


def _sql(schema: str, name: str, **marks: sql.Composable) -> sql.SQL | sql.Composed:
    return schema_query(schema, "migrate", name, **marks)


def _holds(conn: psycopg.Connection[Any], schema: str, relation: str) -> bool:
    found = conn.execute(_sql(schema, "relation_in.sql"), {"schema": schema, "name": relation})
    return found.fetchone() is not None


def _ensure_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    found = conn.execute(_sql(schema, "schema_exists.sql"), {"schema": schema})
    if found.fetchone() is not None:
        return
    try:
        conn.execute(_sql(schema, "create_schema.sql"))
    except pg_errors.InsufficientPrivilege as exc:
        raise MigrationError(
            f"schema {schema!r} does not exist and this role may not create it: run the roles "
            f"step first (`mos-lease roles --schema {schema} --dsn ...` as a superuser), then "
            "migrate as the owner role (`mos-lease setup` does both)") from exc
    except (pg_errors.UniqueViolation, pg_errors.DuplicateSchema):
        pass  # a concurrent migrator created it


def _ensure_bookkeeping(conn: psycopg.Connection[Any], schema: str) -> None:
    # CREATE TABLE IF NOT EXISTS is not atomic against a concurrent identical CREATE: the
    # loser can fail on the catalog's unique index. The table exists then, so try again.
    create = _sql(schema, "bookkeeping.sql")
    for _ in range(_CREATE_RACE_RETRIES):
        try:
            conn.execute(create)
            return
        except (pg_errors.UniqueViolation, pg_errors.DuplicateTable, pg_errors.DuplicateObject):
            continue
    raise MigrationError(f"could not create {schema}.mos_lease_schema_migrations")


def _applied(conn: psycopg.Connection[Any], schema: str) -> set[int]:
    return {v for (v,) in conn.execute(_sql(schema, "applied.sql"))}


def other_copies(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """The other schemas of the connected database that hold the lease table."""
    rows = conn.execute(_sql(schema, "other_copies.sql"), {"schema": schema, "name": LEASES})
    return [name for (name,) in rows]


def applied_versions(conninfo: str, *, schema: str = DEFAULT_SCHEMA) -> list[int]:
    """The versions recorded in ``schema`` (empty if it was never migrated)."""
    check_schema(schema)
    with _connect(conninfo) as conn:
        if not _holds(conn, schema, BOOKKEEPING):
            return []
        return sorted(_applied(conn, schema))


def _refuse_second_copy(conn: psycopg.Connection[Any], schema: str) -> None:
    if _holds(conn, schema, LEASES):
        return  # this schema is the copy: migrating it further builds nothing new
    copies = other_copies(conn, schema)
    if copies:
        raise SecondCopyRefused(
            f"the mos-lease tables already exist in schema(s) {', '.join(copies)} of this "
            f"database; refusing to build a second copy in {schema!r}, where gateways would "
            f"hold the same identities again. Pass the existing schema (`mos-lease migrate "
            f"--schema {copies[0]}`, ConnectionSettings(schema={copies[0]!r})), or, if two "
            "independent copies are really wanted, --allow-second-copy")


def _apply(conn: psycopg.Connection[Any], schema: str, migration: Migration,
           allow_second_copy: bool) -> bool:
    """Apply one migration in its own transaction; False if it was applied already."""
    with conn.transaction():
        conn.execute(_sql(schema, "lock.sql"))
        if migration.version in _applied(conn, schema):
            return False  # another migrator got here first
        if migration.version == 1 and not allow_second_copy:
            _refuse_second_copy(conn, schema)  # again: a concurrent migrator of another one
        conn.execute(_sql(schema, "pin_search_path.sql"))
        # No parameters: sent as a simple query, so one file may hold many statements (and
        # "%" in it is not a placeholder).
        conn.execute(migration.sql.encode("utf-8"))
        conn.execute(_sql(schema, "record.sql"),
                     {"version": migration.version, "name": migration.name})
    return True


def _mark_version(conn: psycopg.Connection[Any], schema: str) -> None:
    with conn.transaction():
        conn.execute(_sql(schema, "lock.sql"))
        current = max(_applied(conn, schema), default=0)
        if current >= 3:  # every migrate also keeps the audit log's months ahead ready (0003)
            conn.execute(schema_query(schema, "audit", "make_partitions.sql"),
                         {"ahead": MONTHS_AHEAD})
        conn.execute(_sql(schema, "version_comment.sql",
                          comment=sql.Literal(f"mos-lease schema version {current}")))


def migrate(conninfo: str, *, schema: str = DEFAULT_SCHEMA,
            allow_second_copy: bool = False) -> list[int]:
    """Apply every pending migration to ``schema``; return the versions this call applied.

    Raises :class:`SecondCopyRefused` if the tables exist in another schema of the database
    and ``allow_second_copy`` is false, :class:`MigrationError` otherwise."""
    check_schema(schema)
    done: list[int] = []
    with _connect(conninfo) as conn:
        try:
            if not allow_second_copy:
                _refuse_second_copy(conn, schema)  # before creating anything
            _ensure_schema(conn, schema)
            _ensure_bookkeeping(conn, schema)
            for migration in available_migrations():
                if _apply(conn, schema, migration, allow_second_copy):
                    done.append(migration.version)
            _mark_version(conn, schema)
        except psycopg.Error as exc:
            raise MigrationError(f"migration failed: {exc}") from exc
    return done
