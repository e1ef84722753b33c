"""``mos-lease check``: is this database, and this role on it, ready for gateways?

Two halves, kept apart so the judgement can be tested on any facts, including ones a test
server cannot produce (a standby, an old server, synchronous replication):

* :func:`gather` (here) connects once and reads :class:`Facts`: the server and session settings
  (``sql/check/server.sql``), the store's own first-use check (:mod:`mos_lease_pg.preflight`,
  called, not copied: schema, version and privileges are judged exactly as a store judges
  them), a few readings of the database clock against this host's clock, and the database
  clock against the newest stamp of the lease table (``sql/check/stamps.sql``: a clock that
  stepped back reads earlier than it), and how many lease rows hold metadata the library
  withholds (``sql/check/metadata.sql``, judged by the write rule).
* :func:`evaluate` (:mod:`mos_lease_pg.admin.verdict`, whose names are exported here too)
  turns facts into :class:`Item` rows (name, value, ok / warn / problem and a fix for
  anything not ok). No I/O.

The exit code of the command is :attr:`Report.exit_code`: 0 with no problem, 1 with one;
a connection that cannot be made is 2 (:data:`CANNOT_CONNECT`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, Final

import psycopg

from mos_lease.errors import ConfigurationError, InvalidInput
from mos_lease.metadata import check_metadata
from mos_lease_pg import preflight
from mos_lease_pg.admin.verdict import (
    CANNOT_CONNECT,
    CLOCK_WARN_SECONDS,
    MIN_SERVER_VERSION_NUM,
    ClockReading,
    Facts,
    Item,
    Report,
    Status,
    cannot_connect,
    evaluate,
    render_text,
)
from mos_lease_pg.preflight import SchemaCheck
from mos_lease_pg.sql_files import DEFAULT_SCHEMA, check_schema, query_text, schema_query

__all__ = ["CANNOT_CONNECT", "CLOCK_SAMPLES", "CLOCK_WARN_SECONDS", "MIN_SERVER_VERSION_NUM",
           "ClockReading", "Facts", "Item", "Report", "Status", "cannot_connect", "evaluate",
           "gather", "read_clock", "read_stamps", "read_withheld_metadata", "render_text",
           "run_check"]

CLOCK_SAMPLES: Final = 5


def _check_sql(name: str) -> bytes:
    return query_text("check", name).encode("utf-8")


SERVER_SQL: Final = _check_sql("server.sql")
CLOCK_SQL: Final = _check_sql("clock.sql")


def read_clock(conn: psycopg.Connection[Any], *, samples: int = CLOCK_SAMPLES,
               local_clock: Callable[[], float] = time.time) -> tuple[ClockReading, list[int]]:
    """Measure the clock offset (and collect the backend pid of each reading)."""
    best: ClockReading | None = None
    pids: list[int] = []
    for _ in range(samples):
        before = local_clock()
        row = conn.execute(CLOCK_SQL).fetchone()
        after = local_clock()
        assert row is not None
        server: datetime = row[0]
        pids.append(row[1])
        reading = ClockReading(server.timestamp() - (before + after) / 2, (after - before) / 2)
        if best is None or reading.uncertainty < best.uncertainty:
            best = reading
    assert best is not None
    return best, pids


def read_stamps(conn: psycopg.Connection[Any], schema: str) -> tuple[float | None, int]:
    """How far the newest lease stamp lies ahead of the database clock, and over how many
    rows (``None``: no row, or the table cannot be read by this role)."""
    try:
        row = conn.execute(schema_query(schema, "check", "stamps.sql")).fetchone()
    except psycopg.errors.DatabaseError:
        # Missing table or privilege: already reported by the schema check.
        return None, 0
    assert row is not None
    return (None if row[0] is None else float(row[0])), int(row[1])


def read_withheld_metadata(conn: psycopg.Connection[Any], schema: str) -> int | None:
    """How many lease rows hold metadata the library withholds on read (it breaks the rule
    every write passes: written around the library); ``None``: the table cannot be read."""
    try:
        rows = conn.execute(schema_query(schema, "check", "metadata.sql")).fetchall()
    except psycopg.errors.DatabaseError:
        return None  # missing table or privilege: already reported by the schema check
    withheld = 0
    for (stored,) in rows:
        try:
            check_metadata("holder_metadata", stored)
        except InvalidInput:
            withheld += 1
    return withheld


def _schema_verdict(conn: psycopg.Connection[Any],
                    schema: str) -> tuple[SchemaCheck | None, str | None]:
    try:
        return preflight.check(conn, schema), None
    except ConfigurationError as refused:
        return None, str(refused)


def gather(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA, *,
           local_clock: Callable[[], float] = time.time) -> Facts:
    """Read the facts over ``conn`` (autocommit, no startup options of the store's, so the
    settings seen are the role's and the server's own)."""
    check_schema(schema)
    row = conn.execute(SERVER_SQL).fetchone()
    assert row is not None
    (version_num, version, role, database, sync_commit, standby_names, in_recovery,
     statement_timeout, lock_timeout, server_port, first_pid) = row
    schema_check, schema_error = _schema_verdict(conn, schema)
    clock, pids = read_clock(conn, local_clock=local_clock)
    stamp_lead, rows_compared = (read_stamps(conn, schema) if schema_check is not None
                                 else (None, 0))
    withheld = (read_withheld_metadata(conn, schema) if schema_check is not None
                and rows_compared else None)
    return Facts(
        schema=schema, server_version_num=version_num, server_version=version, role=role,
        database=database, schema_check=schema_check, schema_error=schema_error,
        synchronous_commit=sync_commit, synchronous_standby_names=standby_names,
        in_recovery=in_recovery, statement_timeout=statement_timeout,
        lock_timeout=lock_timeout, clock=clock, client_port=_port(conn.info.port),
        server_port=server_port, backend_pids=(first_pid, *pids),
        startup_pid=conn.info.backend_pid, stamp_lead=stamp_lead, rows_compared=rows_compared,
        metadata_withheld=withheld)


def _port(value: object) -> int | None:
    return value if isinstance(value, int) and value > 0 else None


def run_check(conninfo: str, schema: str = DEFAULT_SCHEMA, *, behind_pooler: bool = False,
              connect_timeout: int = 5,
              local_clock: Callable[[], float] = time.time) -> tuple[Report, int]:
    """Connect, gather and evaluate; return the report and the exit code (2: no
    connection)."""
    check_schema(schema)
    try:
        # Autocommit: each reading is its own transaction, which is what lets a transaction
        # pooler show itself. No prepared statements: an older pooler cannot track them.
        conn = psycopg.Connection.connect(conninfo, autocommit=True, prepare_threshold=None,
                                          connect_timeout=connect_timeout,
                                          application_name="mos-lease check")
    except psycopg.Error as exc:
        return cannot_connect(f"cannot connect: {exc}".strip()), CANNOT_CONNECT
    try:
        with conn:
            facts = gather(conn, schema, local_clock=local_clock)
    except psycopg.Error as exc:
        return cannot_connect(f"connection failed during the check: {exc}"), CANNOT_CONNECT
    report = evaluate(facts, behind_pooler=behind_pooler)
    return report, report.exit_code
