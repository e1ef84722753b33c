"""Sending one statement with as little as possible between the store and libpq.

psycopg's cursor path costs ~25 µs per statement on top of the round trip, measured in place
(a new cursor and a new adaptation context per ``execute``, query conversion, the prepare
manager); a validation's whole budget is about that. The stores therefore send their single
statements through :class:`Wire`: one per connection, it keeps psycopg's adaptation (a
reused ``Transformer`` dumps parameters and loads rows exactly as a cursor would) and
psycopg's waiting (``conn.wait``, which also cancels the query on Ctrl-C), and drops the rest.

A statement is prepared on first use, once per connection and parameter-type signature (the
type of an int parameter depends on its size), under a name of our own. A server that lost
the prepared statement (``DISCARD ALL`` by a proxy or a pool's reset) answers 26000 before
running anything, so the statement is prepared again and sent once more.

Everything here is a psycopg generator: the sync store runs it with ``conn.wait(...)``, the
async store with ``await conn.wait(...)``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Generator, Mapping
from typing import Any, Final, Generic, TypeVar
from weakref import WeakKeyDictionary

import attrs
import psycopg
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer
from psycopg.errors import error_from_result
from psycopg.generators import execute

Row = tuple[Any, ...]
Conn = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
C = TypeVar("C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])
# What psycopg's ``conn.wait`` consumes: a generator of socket waits returning a value.
Gen = Generator[Any, Any, list[Row]]

_PLACEHOLDER: Final = re.compile(rb"%\((\w+)\)s|%%|%")
_MAX_PREPARED: Final = 64  # per connection; statement signatures beyond this run unprepared
_NAMES: Final = itertools.count(1)
_OK: Final = frozenset({pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK})
_UNDEFINED_PREPARED: Final = "26000"


@attrs.frozen(slots=True)
class Query:
    """A statement in the server's ``$n`` form, and the parameter names in ``$n`` order."""

    text: bytes
    names: tuple[str, ...]
    formats: tuple[PyFormat, ...]

    @classmethod
    def convert(cls, text: bytes) -> Query:
        """Convert psycopg's ``%(name)s`` placeholders; any other ``%`` use is refused (the
        statements are ours, so this is a check on the package, not on callers)."""
        names: list[str] = []

        def number(match: re.Match[bytes]) -> bytes:
            if match.group(0) == b"%%":
                return b"%"
            if match.group(1) is None:
                raise ValueError(f"unsupported placeholder at byte {match.start()}")
            name = match.group(1).decode("ascii")
            if name not in names:
                names.append(name)
            return b"$%d" % (names.index(name) + 1)

        positional = _PLACEHOLDER.sub(number, text)
        return cls(positional, tuple(names), (PyFormat.AUTO,) * len(names))


class Wire(Generic[C]):
    """Statement sending on one connection: its adaptation context and prepared names."""

    def __init__(self, conn: C, *, prepare: bool) -> None:
        self.conn: C = conn
        # Noted now (public ``conn.info``, no round trip): once the connection is lost they
        # say which backend may still be running its last write (see reconcile.py).
        info = conn.info
        self.backend_pid: int = info.backend_pid
        self.server: tuple[str, str, str] = (str(info.host), str(info.port), str(info.dbname))
        self._pgconn = conn.pgconn
        self._tx = Transformer(conn)
        self._encoding = conn.info.encoding
        self._prepare = prepare
        self._prepared = _prepared_names(conn)

    def execute(self, query: Query, params: Mapping[str, object]) -> Gen:
        """Send ``query`` with ``params`` and return its rows (none for a command)."""
        tx, pgconn = self._tx, self._pgconn
        values = tx.dump_sequence([params[name] for name in query.names], query.formats)
        types = tx.types or ()
        key = (query.text, types)
        for attempt in range(2):
            name = (yield from self._prepared_name(key, query)) if self._prepare else None
            if name is None:
                pgconn.send_query_params(query.text, values, types, tx.formats,
                                         pq.Format.BINARY)
            else:
                pgconn.send_query_prepared(name, values, tx.formats, pq.Format.BINARY)
            result = (yield from execute(pgconn))[-1]
            if (name is not None and attempt == 0
                    and result.status == pq.ExecStatus.FATAL_ERROR
                    and result.error_field(pq.DiagnosticField.SQLSTATE)
                    == _UNDEFINED_PREPARED.encode()):
                del self._prepared[key]  # the server forgot it: nothing ran, prepare again
                continue
            return self._rows(result)
        raise AssertionError("unreachable")

    def _prepared_name(self, key: tuple[bytes, tuple[int, ...]],
                       query: Query) -> Generator[Any, Any, bytes | None]:
        name = self._prepared.get(key)
        if name is not None or len(self._prepared) >= _MAX_PREPARED:
            return name
        # A fresh name every time: a prepare interrupted after the server ran it must not
        # collide with the next attempt.
        name = b"mos_lease_%d" % next(_NAMES)
        self._pgconn.send_prepare(name, query.text, key[1])
        result = (yield from execute(self._pgconn))[-1]
        self._check(result)
        self._prepared[key] = name
        return name

    def _check(self, result: pq.abc.PGresult) -> None:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            raise error_from_result(result, encoding=self._encoding)
        if result.status not in _OK:
            raise psycopg.ProgrammingError(
                f"unexpected result status {pq.ExecStatus(result.status).name}")

    def _rows(self, result: pq.abc.PGresult) -> list[Row]:
        self._check(result)
        if result.status == pq.ExecStatus.COMMAND_OK:
            return []
        tx = self._tx
        tx.set_pgresult(result, set_loaders=True, format=pq.Format.BINARY)
        rows: list[Row] = tx.load_rows(0, result.ntuples, tuple)
        tx.set_pgresult(None)  # do not keep the result's memory alive until the next call
        return rows


# Prepared names by connection, so that a pooled connection keeps its statements across
# checkouts. The values hold no reference to the connection, so an entry goes with it.
_BY_CONNECTION: WeakKeyDictionary[Conn, dict[tuple[bytes, tuple[int, ...]], bytes]] = (
    WeakKeyDictionary())


def _prepared_names(conn: Conn) -> dict[tuple[bytes, tuple[int, ...]], bytes]:
    return _BY_CONNECTION.setdefault(conn, {})

