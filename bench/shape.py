"""What one call puts on the wire, read from libpq's own protocol trace.

Timing says how fast; the trace says why, without trusting the code under test: every
message the client sends and receives is logged by libpq (``PQtrace``). From it:

* round trips: the client's ``Sync`` and ``Query`` messages (each makes the client wait for
  ``ReadyForQuery``; a pipeline sends one ``Sync`` for the whole batch);
* transactions: ``ReadyForQuery`` with status ``I`` (idle: a transaction just ended; an
  autocommit statement is one transaction, an explicit BEGIN ... COMMIT is one);
* parses: ``Parse`` messages. Zero on a warm call means the statement was already prepared
  on the server and only bound and executed;
* statements: ``Execute`` messages plus simple ``Query`` messages.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import attrs
import psycopg
from psycopg import pq


@attrs.frozen
class Shape:
    round_trips: int
    transactions: int
    parses: int
    statements: int

    def __str__(self) -> str:
        return (f"{self.round_trips} round trip(s), {self.transactions} transaction(s), "
                f"{self.statements} statement(s), {self.parses} parse(s)")


def parse_trace(text: str) -> Shape:
    round_trips = transactions = parses = executes = 0
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) < 3:
            continue
        direction, message = fields[0], fields[2].strip()
        if direction == "F":
            if message in ("Sync", "Query"):
                round_trips += 1
            if message in ("Execute", "Query"):
                executes += 1
            if message == "Parse":
                parses += 1
        elif direction == "B" and message == "ReadyForQuery" and fields[3].strip() == "I":
            transactions += 1
    return Shape(round_trips, transactions, parses, executes)


def trace(conn: psycopg.Connection[Any], action: Callable[[], object]) -> Shape:
    """Run ``action`` with libpq tracing ``conn`` and return what went over the wire."""
    fd, path = tempfile.mkstemp(prefix="mos-lease-bench-", suffix=".trace")
    try:
        conn.pgconn.trace(fd)
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            action()
        finally:
            conn.pgconn.untrace()  # flushes libpq's stream
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_trace(f.read())
    finally:
        os.close(fd)
        os.unlink(path)
