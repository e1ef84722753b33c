"""What every part of the benchmark shares: the server, throwaway databases, the store's
connection, and the raw statements taken from the adapter itself."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

import attrs
import psycopg
from psycopg import sql

from mos_lease import LeaseIdentity
from mos_lease.ids import uuid7
from mos_lease.machine import Write
from mos_lease.records import AuditEntry
from mos_lease.vocabulary import LifecycleEvent, Outcome
from mos_lease_pg import PostgresLeaseStore, sql_files, statements
from mos_lease_pg.admin import migrate
from mos_lease_pg.wire import Wire
from tests.pg_support import (
    PgServer,
    create_database,
    drop_database,
    find_server,
    unique_name,
)

SCOPES = ("tool:run",)
LEASE_TTL = 120  # seconds: long enough that no lease expires during a block
GRANT_TTL = 30  # seconds: the cap; grants are refreshed well before they run out

Params = Mapping[str, object]


class BenchError(Exception):
    """The benchmark could not run (no server, ...): exit status 2."""


class CorrectnessError(Exception):
    """Something the benchmark asserts did not hold (two winners in a round, a loser that
    got an exception instead of a typed refusal, ...): exit status 3."""


def failed(error: BenchError | CorrectnessError) -> int:
    """Say why a benchmark stopped and give its exit status: 2 when it could not run (no
    server, say), 3 when a correctness check failed."""
    if isinstance(error, BenchError):
        print(f"cannot run: {error}", file=sys.stderr)
        return 2
    print(f"correctness check failed: {error}", file=sys.stderr)
    return 3


def server() -> PgServer:
    """The server the tests would use (same discovery rules: ``MOS_LEASE_TEST_DSN``, a
    trust-auth server on 127.0.0.1:5432, testcontainers, a throwaway ``initdb`` cluster)."""
    found = find_server()
    if isinstance(found, str):
        raise BenchError(found)
    return found


@contextlib.contextmanager
def throwaway_database(srv: PgServer, prefix: str, *, migrated: bool = True) -> Iterator[str]:
    """A database of its own, migrated, dropped afterwards. Lease rows refuse DELETE and
    TRUNCATE by design, so a benchmark never reuses one."""
    name = unique_name(prefix)
    dsn = create_database(srv.dsn, name)
    try:
        if migrated:
            migrate(dsn)
        yield dsn
    finally:
        drop_database(srv.dsn, name)


def create_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))


def store_wire(store: PostgresLeaseStore) -> Wire:
    """The store's own sender on its dedicated connection, so raw floors run on the very
    connection (and backend, and prepared statements) the library uses. Reaches into the
    store: the adapter deliberately has no public accessor for it."""
    source = store._source
    with source.checkout() as wire:
        return wire


def store_connection(store: PostgresLeaseStore) -> psycopg.Connection[Any]:
    return store_wire(store).conn


# --- the raw statements, straight from the adapter --------------------------------------


@attrs.frozen
class Raw:
    """One statement and its parameters exactly as the store builds them (by
    ``mos_lease_pg.statements`` itself, so a floor cannot drift from the library)."""

    statement: sql_files.Statement
    params: Params


def raw_write(store: PostgresLeaseStore, write: Write, entry: AuditEntry) -> Raw:
    call = statements.apply(write, entry, NO_OFFSET)
    return Raw(call.statement, call.params)


def raw_load(store: PostgresLeaseStore, identity: LeaseIdentity) -> Raw:
    call = statements.load(identity, NO_OFFSET)
    return Raw(call.statement, call.params)


def entry(event: LifecycleEvent, outcome: Outcome, identity: LeaseIdentity, connector_id: str,
          epoch: int | None, event_id: UUID | None = None) -> AuditEntry:
    return AuditEntry(event_id or uuid7(), event, outcome, None, identity, connector_id, epoch,
                      uuid4().hex)


def run_raw(conn: psycopg.Connection[Any], raw: Raw) -> tuple[Any, ...]:
    """Send one statement prepared, the plain psycopg way (public API only: a new cursor
    per call, psycopg's own prepared statement), and return its single row."""
    rows: list[tuple[Any, ...]] = conn.execute(raw.statement.text, raw.params,
                                               prepare=True).fetchall()
    return rows[0]


def run_wire(wire: Wire, raw: Raw) -> tuple[Any, ...]:
    """Send one statement the way the store sends it (prepared, on its connection's
    long-lived binary cursor, :class:`~mos_lease_pg.wire.Wire`) and return its single row:
    the floor of the store's own sending, without the library's Python around it."""
    return wire.execute(raw.statement.text, raw.params)[0]


def written(row: tuple[Any, ...]) -> bool:
    """Whether a guarded write's result row says the guard held (lease columns not NULL)."""
    return row[1] is not None


TTL = timedelta(seconds=LEASE_TTL)
NO_OFFSET = timedelta(0)  # the production stores read the database clock as it is
