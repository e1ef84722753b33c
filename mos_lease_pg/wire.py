"""Sending one statement on one connection, through psycopg's public cursor API only.

A :class:`Wire` (sync) or :class:`AsyncWire` belongs to one connection and keeps one cursor
for as long as it lives: ``Connection.execute`` would build a new cursor (and a new
adapters map) on every call, and a cursor that runs the same statement object again also
keeps its adaptation context. The cursor asks for binary results, which psycopg loads
without parsing text (timestamps, UUIDs).

Preparation is psycopg's own (``execute(..., prepare=True)``): a statement is prepared on its
first use on a connection and looked up by psycopg afterwards; ``prepare=False`` never
prepares. The only thing psycopg does not recover from by itself is a server that forgot a
statement behind its back (``DEALLOCATE``/``DISCARD ALL`` sent by a proxy or a pool's
reset): the server answers 26000 before running anything, so the store discards the
connection, whose cache is now wrong, and sends the statement once more on a fresh one (see
:func:`forgotten`).

The cursor is shared by every call on its connection, one call at a time: a dedicated
connection's checkout holds the store's lock for the whole call, a pooled connection is the
caller's alone while checked out, and psycopg's ``execute`` itself takes the connection's
lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Generic, TypeVar

import psycopg

from mos_lease.clock import MonotonicClock, default_clock
from mos_lease_pg import replication
from mos_lease_pg.deadline import WATCHDOG, Watch

Row = tuple[Any, ...]
C = TypeVar("C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])
# A cursor keeps its last result (libpq's copy of every row) until its next statement. After
# a reply this long (an audit page may hold up to a million rows) the sender takes a new
# cursor instead, so that the memory goes now; shorter replies are not worth the new cursor.
KEEP_RESULT_ROWS: Final = 1000


class _Sender(Generic[C]):
    """What both senders share: the connection, what reconciling needs to know of it, and
    the warnings its statements received (:func:`mos_lease_pg.replication.watch`, one
    handler per connection, looked at after each statement)."""

    def __init__(self, conn: C, *, prepare: bool, pid_names_backend: bool) -> None:
        self.conn: C = conn
        self.prepare = prepare
        self.notices = replication.watch(conn)
        # Noted now (public ``conn.info``, no round trip): once the connection is lost they
        # say which backend may still be running its last write (see reconcile.py). Only
        # where the startup's pid names the backend that runs the statements (the first-use
        # check compared the two): behind a transaction pooler, which a store built with the
        # pooler settings may be behind, the pid is the pooler's own key and names none of
        # them (nor does a pid of 0 or below), so none is noted and reconcile waits out the
        # role's transactions instead.
        info = conn.info
        pid = info.backend_pid
        self.backend_pid: int | None = pid if pid_names_backend and pid > 0 else None
        self.server: tuple[str, str, str] = (str(info.host), str(info.port), str(info.dbname))

    @property
    def closed(self) -> bool:
        return self.conn.closed


class Wire(_Sender[psycopg.Connection[Any]]):
    """One sync connection's statement sender."""

    def __init__(self, conn: psycopg.Connection[Any], *, prepare: bool,
                 pid_names_backend: bool, clock: MonotonicClock = default_clock) -> None:
        super().__init__(conn, prepare=prepare, pid_names_backend=pid_names_backend)
        self._cursor: psycopg.Cursor[Row] = conn.cursor(binary=True)
        # The connection's deadline watch, armed again for each call (deadline.py).
        self.watch = Watch(conn, clock, WATCHDOG)

    def execute(self, text: bytes, params: Mapping[str, object]) -> list[Row]:
        """Send ``text`` with ``params`` and return its rows (none for a command)."""
        cursor = self._cursor.execute(text, params, prepare=self.prepare)
        if cursor.rownumber is None:
            return []
        rows = cursor.fetchall()
        if len(rows) > KEEP_RESULT_ROWS:  # see KEEP_RESULT_ROWS
            cursor.close()
            self._cursor = self.conn.cursor(binary=True)
        return rows


class AsyncWire(_Sender[psycopg.AsyncConnection[Any]]):
    """The asyncio twin of :class:`Wire`."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], *, prepare: bool,
                 pid_names_backend: bool) -> None:
        super().__init__(conn, prepare=prepare, pid_names_backend=pid_names_backend)
        self._cursor: psycopg.AsyncCursor[Row] = conn.cursor(binary=True)

    async def execute(self, text: bytes, params: Mapping[str, object]) -> list[Row]:
        """As :meth:`Wire.execute`."""
        cursor = await self._cursor.execute(text, params, prepare=self.prepare)
        if cursor.rownumber is None:
            return []
        rows = await cursor.fetchall()
        if len(rows) > KEEP_RESULT_ROWS:  # see KEEP_RESULT_ROWS
            await cursor.close()
            self._cursor = self.conn.cursor(binary=True)
        return rows


AnyWire = Wire | AsyncWire


def forgotten(exc: psycopg.Error, wire: AnyWire) -> bool:
    """Whether ``exc`` says the server no longer knows a statement psycopg prepared on this
    connection. The server refuses such a call before running anything, so sending it again
    (on another connection) cannot apply anything twice."""
    return wire.prepare and isinstance(exc, psycopg.errors.InvalidSqlStatementName)
