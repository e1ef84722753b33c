"""The store's first-use check: its schema exists, at the version it needs, and its role can
do what the store does.

A store names its schema explicitly (``ConnectionSettings.schema``), so a missing schema, an
unmigrated or outdated one, or a role without the grants fails the first statement with
``42P01`` / ``42501``. Those are configuration faults, not transient ones: retrying them (as
keepers retry ``StoreUnavailable``) would only hide them. So before its first statement the
store reads the catalogs once (one round trip, readable by every role) and raises
:class:`~mos_lease.errors.ConfigurationError` naming the fix.

The version is read from the comment ``mos-lease migrate`` puts on the bookkeeping table
(``mos-lease schema version N``), since the gateway role has no privilege on that table;
a role that may read the table is answered from its rows when the comment is missing.

Decisions:

* An older schema than this package needs is refused (``mos-lease migrate --schema X``). A
  newer one is accepted with a WARNING: migrations only add, so a gateway may keep running
  while the fleet is upgraded after the migration.
* The server's replication is read at first use too (:mod:`mos_lease_pg.replication`):
  whether it is a primary, its ``synchronous_commit`` and ``synchronous_standby_names``,
  logged once at INFO. A store never writes through a standby (refused unless
  ``standby_reads``), and ``require_synchronous_replication`` refuses a primary whose
  commits do not wait for a synchronous standby.
* A transaction pooler in front of the server (PgBouncer and the like) is refused at first
  use unless the store is built with ``POOLER_SETTINGS`` (no startup options, no prepared
  statements): its server sessions are shared between clients, so another client's
  prepared statements collide with the store's, and startup options are refused or
  dropped. A pooler shows itself by answering the connection's startup with a backend key
  of its own: the pid there is not the pid of the backend that runs the statements (a
  plain TCP relay passes the server's own key through).
* A role with MORE privileges than the store needs (the owner, a superuser as in tests, a
  role granted DELETE, any privilege on a partition of the audit log) is not refused: the
  schema's triggers, not privileges, keep the data right. The surplus is listed in
  :attr:`SchemaCheck.surplus` and logged once per store at WARNING, so an operator sees
  that the least-privilege layout is not in use.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Generator, Mapping
from typing import Any, Final, TypeVar

import attrs
import psycopg

from mos_lease.errors import ConfigurationError
from mos_lease.flowdrive import Drive, outcome_of, outcome_of_async
from mos_lease_pg import replication
from mos_lease_pg.replication import NO_NEEDS, Needs, ReplicationFacts
from mos_lease_pg.rows import Row
from mos_lease_pg.sql_files import query_text, render
from mos_lease_pg.translate import pooler_misconfigured, statement_failure
from mos_lease_pg.versions import available_migrations

log = logging.getLogger("mos_lease_pg")

LEASES: Final = "logical_agent_connector_leases"
AUDIT: Final = "connector_lease_audit_log"
EVENT_IDS: Final = "connector_lease_event_ids"
MIGRATIONS: Final = "mos_lease_schema_migrations"
T = TypeVar("T")
VERSION_COMMENT: Final = "mos-lease schema version {version}"
_VERSION_IN_COMMENT: Final = re.compile(r"^mos-lease schema version (\d+)$")

# What the store sends needs (store.py, statements/*.sql): read and append both tables, and
# update the lease columns a write sets (UPDATE also allows the FOR UPDATE of the lock step
# and of settling). ``None``: the privilege on the whole table.
_WRITTEN_COLUMNS: Final = ("lease_id", "connector_id", "allowed_scopes", "epoch",
                           "acquired_at", "heartbeat_at", "expires_at", "released_at",
                           "updated_at", "holder_metadata")
NEEDED: Final[tuple[tuple[str, str, str | None], ...]] = (
    (LEASES, "SELECT", None), (LEASES, "INSERT", None),
    *((LEASES, "UPDATE", column) for column in _WRITTEN_COLUMNS),
    (AUDIT, "SELECT", None), (AUDIT, "INSERT", None),
    (EVENT_IDS, "SELECT", None),
)
# What it never needs: having any of these is reported, not refused (see the module text).
SURPLUS: Final[tuple[tuple[str, str, str | None], ...]] = (
    *((LEASES, "UPDATE", column) for column in ("tenant_id", "logical_agent_id", "binding_id")),
    (LEASES, "DELETE", None), (LEASES, "TRUNCATE", None), (LEASES, "TRIGGER", None),
    (AUDIT, "UPDATE", None), (AUDIT, "DELETE", None), (AUDIT, "TRUNCATE", None),
    (AUDIT, "TRIGGER", None),
    # Writing the event-id claims could let an event id be applied twice.
    (EVENT_IDS, "INSERT", None), (EVENT_IDS, "UPDATE", None), (EVENT_IDS, "DELETE", None),
    (EVENT_IDS, "TRUNCATE", None),
)

_QUERY: Final = query_text("preflight", "privileges.sql").encode("utf-8")


def required_version() -> int:
    """The schema version this package needs: the highest migration it ships."""
    return max(m.version for m in available_migrations())


@attrs.frozen(slots=True)
class SchemaCheck:
    """What the first-use check found (the store refused to start otherwise)."""

    schema: str
    version: int
    role: str
    # Privileges the store never uses, held anyway (superuser, owner, DELETE, ...).
    surplus: tuple[str, ...]
    # The server's replication as first seen (None where it was not read: mos-lease check).
    replication: ReplicationFacts | None = None


def _named(keys: list[tuple[str, str, str | None]]) -> list[str]:
    """``SELECT on t``, ``UPDATE (a, b) on t``: one entry per table and privilege."""
    columns: dict[tuple[str, str], list[str]] = {}
    for relname, privilege, attname in keys:
        columns.setdefault((privilege, relname), []).extend([] if attname is None else [attname])
    return [f"{privilege} ({', '.join(cols)}) on {relname}" if cols
            else f"{privilege} on {relname}" for (privilege, relname), cols in columns.items()]


def _params(schema: str) -> dict[str, Any]:
    asked = (*NEEDED, *SURPLUS)
    return {"schema": schema, "migrations": MIGRATIONS, "audit": AUDIT,
            "relnames": [r for r, _, _ in asked], "privileges": [p for _, p, _ in asked],
            "attnames": [a for _, _, a in asked]}


def _fix_migrate(schema: str) -> str:
    return f"run `mos-lease migrate --schema {schema}` as the owner role"


def _fix_roles(schema: str, role: str, database: str) -> str:
    return (f"run the roles step as a superuser on database {database!r} (`mos-lease roles "
            f"--schema {schema} --gateway-role {role} --dsn ...`, or `mos-lease setup`)")


def _version(comment: str | None) -> int | None:
    match = None if comment is None else _VERSION_IN_COMMENT.match(comment)
    return None if match is None else int(match[1])


def judge(schema: str, rows: list[tuple[Any, ...]], table_version: int | None) -> SchemaCheck:
    """Decide from the rows of the catalog query (and, when the version comment is missing,
    the bookkeeping table's highest version if the role could read it)."""
    exists, usage, create, superuser, role, database, comment = rows[0][:7]
    if not exists:
        raise ConfigurationError(
            f"schema {schema!r} does not exist in database {database!r}: "
            f"{_fix_migrate(schema)}, then {_fix_roles(schema, role, database)}")
    if not usage:
        raise ConfigurationError(
            f"role {role!r} may not use schema {schema!r}: {_fix_roles(schema, role, database)}")
    facts = {(r[8], r[9], r[10]): (bool(r[11]), bool(r[12])) for r in rows}
    missing_tables = sorted({rel for (rel, _, _), (found, _) in facts.items() if not found})
    version = _version(comment) if comment is not None else table_version
    if missing_tables or version is None:
        what = (f"has no {', '.join(missing_tables)}" if missing_tables
                else "records no schema version")
        raise ConfigurationError(
            f"schema {schema!r} {what} (not migrated, or migrated by an older mos-lease): "
            f"{_fix_migrate(schema)}")
    needed = required_version()
    if version < needed:
        raise ConfigurationError(
            f"schema {schema!r} is at version {version}, this mos-lease needs {needed}: "
            f"{_fix_migrate(schema)}")
    if version > needed:
        log.warning("schema %r is at version %d, newer than this mos-lease knows (%d): "
                    "upgrade the gateways", schema, version, needed)
    lacking = _named([key for key in NEEDED if not facts[key][1]])
    if lacking:
        raise ConfigurationError(
            f"role {role!r} lacks {', '.join(lacking)} in schema {schema!r}: "
            f"{_fix_roles(schema, role, database)}")
    surplus = _named([key for key in SURPLUS if facts[key][1]])
    # The audit log's partitions (0003) are reached through the log itself: a privilege on
    # one lets a role read or append there directly.
    partitions = int(rows[0][13] or 0)
    if partitions:
        surplus.append(f"privileges on {partitions} partition(s) of {AUDIT}")
    if superuser:
        surplus.insert(0, "superuser")
    if create:
        surplus.append(f"CREATE on schema {schema}")
    return SchemaCheck(schema, version, role, tuple(surplus))


def _report(check: SchemaCheck) -> SchemaCheck:
    if check.surplus:
        log.warning("mos-lease store as role %r holds privileges it never uses in schema %r "
                    "(%s): not refused, since the schema's triggers keep the data right, but "
                    "gateways should connect as the least-privilege role of roles.sql",
                    check.role, check.schema, "; ".join(check.surplus))
    return check


@attrs.frozen(slots=True)
class _Query:
    """One statement of a check, for whichever driver runs it; answered with its rows."""

    text: bytes
    params: Mapping[str, object] | None = None
    prepare: bool | None = None


Check = Generator[_Query, list[Row], T]


def _checking(schema: str) -> Check[SchemaCheck]:
    rows = yield _Query(_QUERY, _params(schema))
    table_version = None
    if rows and rows[0][6] is None and rows[0][7]:
        found = yield _Query(render(query_text("preflight", "table_version.sql"),
                                    schema).encode("utf-8"))
        table_version = found[0][0] if found else None
    return _report(judge(schema, rows, table_version))


def _first_using(schema: str, needs: Needs, pooler_safe: bool, backend_pid: int,
                 server: str) -> Check[SchemaCheck]:
    if not pooler_safe:
        (answered,), = yield _Query(_BACKEND_PID, prepare=False)  # see backend_pid.sql
        judge_backend(backend_pid, answered)
    (row,) = yield _Query(replication.FACTS)
    found = replication.judge(replication.facts(row), needs, server=server)
    return attrs.evolve((yield from _checking(schema)), replication=found)


def _rows(conn: psycopg.Connection[Any], query: _Query) -> list[Row]:
    return conn.execute(query.text, query.params, prepare=query.prepare).fetchall()


async def _rows_async(conn: psycopg.AsyncConnection[Any], query: _Query) -> list[Row]:
    return await (await conn.execute(query.text, query.params,
                                     prepare=query.prepare)).fetchall()


def _run(conn: psycopg.Connection[Any], check: Check[T]) -> T:
    drive = Drive(check, ())  # a database error ends the check: the caller translates it
    for query in drive:
        drive.send(outcome_of(_rows, conn, query))
    return drive.result


async def _run_async(conn: psycopg.AsyncConnection[Any], check: Check[T]) -> T:
    drive = Drive(check, ())  # as in _run
    for query in drive:
        drive.send(await outcome_of_async(_rows_async, conn, query))
    return drive.result


def check(conn: psycopg.Connection[Any], schema: str) -> SchemaCheck:
    """Run the check on ``conn`` (autocommit). Raises ``ConfigurationError`` with the fix."""
    return _run(conn, _checking(schema))


async def check_async(conn: psycopg.AsyncConnection[Any], schema: str) -> SchemaCheck:
    """As :func:`check`, on an asyncio connection."""
    return await _run_async(conn, _checking(schema))


_BACKEND_PID: Final = query_text("preflight", "backend_pid.sql").encode("utf-8")


def judge_backend(announced: int, answered: int) -> None:
    """Refuse a connection whose startup named another backend than the one answering
    (see the module text)."""
    if announced != answered:
        raise pooler_misconfigured(
            f"the connection's startup named backend pid {announced}, but backend "
            f"{answered} answered")


def _server(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    return f"{conn.info.host}:{conn.info.port}"


def first_use(conn: psycopg.Connection[Any], schema: str, *, needs: Needs = NO_NEEDS,
              pooler_safe: bool = False) -> SchemaCheck:
    """:func:`check` for a connection source, then the replication check against
    ``needs``; a database error is a ``StoreUnavailable`` like any statement's (the source
    closes a connection of its own that failed, see ``connection.py``). Unless the store's
    settings are ``pooler_safe``, a pooler in front of the server is refused first."""
    try:
        return _run(conn, _first_using(schema, needs, pooler_safe, conn.info.backend_pid,
                                       _server(conn)))
    except psycopg.Error as exc:
        raise statement_failure(exc, what="schema check", write_event=None).error from exc


async def first_use_async(conn: psycopg.AsyncConnection[Any], schema: str, *,
                          needs: Needs = NO_NEEDS, pooler_safe: bool = False) -> SchemaCheck:
    """As :func:`first_use`, on an asyncio connection."""
    try:
        return await _run_async(conn, _first_using(schema, needs, pooler_safe,
                                                   conn.info.backend_pid, _server(conn)))
    except psycopg.Error as exc:
        raise statement_failure(exc, what="schema check", write_event=None).error from exc
