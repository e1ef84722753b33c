"""What every connection source shares: the checks a new connection passes before its first
statement (the schema check on the source's first, the replication re-check on every later
one), the checkout that brackets one call, and discarding a connection a call left mid-reply.
Apart from the dedicated and pooled sources, which only say where a connection comes from.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final

import psycopg
from psycopg.pq import TransactionStatus

from mos_lease.clock import MonotonicClock
from mos_lease_pg import preflight, replication
from mos_lease_pg.connection.settings import ConnectionSettings
from mos_lease_pg.deadline import WATCHDOG, AsyncWatch
from mos_lease_pg.wire import AsyncWire, Wire

_IDLE: Final = TransactionStatus.IDLE


def remaining(deadline: float | None, bound: float, clock: MonotonicClock) -> float:
    """Seconds left until ``deadline`` (read on ``clock``; ``None``: a whole ``bound`` from
    now), at least 0."""
    return bound if deadline is None else max(0.0, deadline - clock())


class _Check(enum.Enum):
    """Which check a connection needs before its first statement (see :class:`Source`)."""

    FIRST_USE = "schema check"
    RECHECK = "replication re-check"


class Source:
    """What every connection source shares: what a connection is judged by before its first
    statement, and which connections were judged. The source's first connection gets the
    schema check (:func:`mos_lease_pg.preflight.first_use`); every later new one the
    replication re-check (:func:`mos_lease_pg.replication.recheck`): after a failover it is
    another server. Either runs within the call's deadline, like a statement (a silent
    network cuts it off, ``deadline.py``). A dedicated connection that fails its check is
    closed; a pooled one goes back to its pool."""

    def __init__(self, settings: ConnectionSettings, clock: MonotonicClock) -> None:
        self._bound = settings.call_bound()
        self._clock = clock  # the monotonic clock deadlines are read on (the store's)
        self._prepare = settings.prepare
        self._schema = settings.schema
        self._needs = replication.needs_of(settings)
        # Behind a transaction pooler only these settings work (preflight.py refuses others).
        self._pooler_safe = not (settings.prepare or settings.session_options)
        # Otherwise the first connection's check proved the startup's pid is the backend's.
        self._pid_names_backend = not self._pooler_safe
        # Set by the first connection's schema check, which runs once.
        self.schema_check: preflight.SchemaCheck | None = None
        # Connections judged so far: a pool opens new ones after a failover, on whichever
        # server is the primary then.
        self._judged: weakref.WeakSet[Any] = weakref.WeakSet()

    def _due(self, conn: object) -> _Check | None:
        """The check ``conn`` needs before its first statement, if any."""
        if self.schema_check is None:
            return _Check.FIRST_USE
        return None if conn in self._judged else _Check.RECHECK

    def _passed(self, conn: object, schema_check: preflight.SchemaCheck | None) -> None:
        if schema_check is not None:
            self.schema_check = schema_check
        self._judged.add(conn)

    def _check_deadline(self, deadline: float | None) -> float:
        return self._clock() + self._bound if deadline is None else deadline


def vet(source: Source, conn: psycopg.Connection[Any], deadline: float | None) -> None:
    """Judge ``conn`` as :class:`Source` says, if it still needs it."""
    due = source._due(conn)
    if due is None:
        return
    # Watched like a statement, but not closed if the watch fired: a check that got its
    # answer passed, and the store's call then fails on the cut connection.
    watch = WATCHDOG.arm(conn, source._check_deadline(deadline), source._bound, source._clock)
    try:
        if due is _Check.FIRST_USE:
            source._passed(conn, preflight.first_use(conn, source._schema, needs=source._needs,
                                                     pooler_safe=source._pooler_safe))
        else:
            replication.recheck(conn, source._needs)
            source._passed(conn, None)
    finally:
        WATCHDOG.disarm(watch)


async def vet_async(source: Source, conn: psycopg.AsyncConnection[Any],
                     deadline: float | None) -> None:
    """The asyncio twin of :func:`vet`."""
    due = source._due(conn)
    if due is None:
        return
    watch = AsyncWatch(conn, source._check_deadline(deadline), source._bound,  # see vet
                       source._clock)
    try:
        if due is _Check.FIRST_USE:
            source._passed(conn, await preflight.first_use_async(
                conn, source._schema, needs=source._needs, pooler_safe=source._pooler_safe))
        else:
            await replication.recheck_async(conn, source._needs)
            source._passed(conn, None)
    finally:
        await watch.done()


def _mid_call(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether ``conn`` was left between a request and the end of its reply."""
    return not conn.closed and conn.info.transaction_status is not _IDLE


def discard_if_busy_sync(conn: psycopg.Connection[Any]) -> None:
    # A call interrupted by something other than a driver error (KeyboardInterrupt, a
    # cancellation) may leave its reply unread: the next call would read it as its own.
    if _mid_call(conn):
        conn.close()


async def discard_if_busy(conn: psycopg.AsyncConnection[Any]) -> None:
    """As :func:`discard_if_busy_sync`, for an asyncio connection (whose ``close`` does
    not suspend, so a second cancellation cannot stop it half way)."""
    if _mid_call(conn):
        await conn.close()


class Checkout:
    """``checkout``, the context-manager form of a sync source's ``enter`` and ``leave``
    (for calls that are not the store's fast path)."""

    def enter(self, deadline: float | None = None) -> Wire:
        raise NotImplementedError

    def leave(self, wire: Wire) -> None:
        raise NotImplementedError

    @contextmanager
    def checkout(self, deadline: float | None = None) -> Iterator[Wire]:
        wire = self.enter(deadline)
        try:
            yield wire
        except BaseException:
            discard_if_busy_sync(wire.conn)
            raise
        finally:
            self.leave(wire)


class AsyncCheckout:
    """As :class:`Checkout`, for an asyncio source."""

    async def enter(self, deadline: float | None = None) -> AsyncWire:
        raise NotImplementedError

    async def leave(self, wire: AsyncWire) -> None:
        raise NotImplementedError

    def taken(self) -> bool:
        """Whether a call would now wait for another's to take the connection."""
        return False

    async def free(self) -> None:
        """Returns once a call could take the connection without waiting for another's
        (at once for a pool: its calls do not take turns on one connection)."""

    @asynccontextmanager
    async def checkout(self, deadline: float | None = None) -> AsyncIterator[AsyncWire]:
        wire = await self.enter(deadline)
        try:
            yield wire
        except BaseException:
            await discard_if_busy(wire.conn)
            raise
        finally:
            await self.leave(wire)
