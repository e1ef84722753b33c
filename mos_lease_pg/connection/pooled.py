"""Connections of a caller-owned pool: :class:`PooledConnection` and its asyncio twin, one
checkout per call, and :func:`make_pool` / :func:`open_async_pool`, which build a pool whose
connections suit the store.
"""

from __future__ import annotations

import asyncio
from typing import Any, Generic, TypeVar

import psycopg
import psycopg_pool

from mos_lease.clock import MonotonicClock, default_clock
from mos_lease.errors import ConfigurationError, StoreUnavailable
from mos_lease_pg.connection.settings import ConnectionSettings, connect_kwargs
from mos_lease_pg.connection.source import (
    AsyncCheckout,
    Checkout,
    Source,
    remaining,
    vet,
    vet_async,
)
from mos_lease_pg.finish import finish
from mos_lease_pg.translate import unavailable_on_checkout
from mos_lease_pg.wire import AsyncWire, Wire

P = TypeVar("P", psycopg_pool.ConnectionPool[Any], psycopg_pool.AsyncConnectionPool[Any])


def make_pool(conninfo: str, settings: ConnectionSettings | None = None, *,
              min_size: int = 1, max_size: int = 4,
              **pool_options: Any) -> psycopg_pool.ConnectionPool[Any]:
    """An open ``ConnectionPool`` whose connections suit the store."""
    settings = settings if settings is not None else ConnectionSettings()
    return psycopg_pool.ConnectionPool(
        conninfo, kwargs=connect_kwargs(conninfo, settings), min_size=min_size,
        max_size=max_size, timeout=settings.pool_timeout, open=True, **pool_options)


async def open_async_pool(conninfo: str, settings: ConnectionSettings | None = None, *,
                          min_size: int = 1, max_size: int = 4,
                          **pool_options: Any) -> psycopg_pool.AsyncConnectionPool:
    """An open ``AsyncConnectionPool`` whose connections suit the store."""
    settings = settings if settings is not None else ConnectionSettings()
    pool = psycopg_pool.AsyncConnectionPool(
        conninfo, kwargs=connect_kwargs(conninfo, settings), min_size=min_size,
        max_size=max_size, timeout=settings.pool_timeout, open=False, **pool_options)
    await pool.open()
    return pool


def _check_autocommit(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    # Outside autocommit a statement would leave a transaction open (and the pool would
    # spend a second round trip committing it): refuse a pool configured that way.
    if not conn.autocommit:
        raise ConfigurationError(
            "pooled connections must be in autocommit mode: build the pool with "
            "mos_lease_pg.make_pool or pass kwargs=connect_kwargs(conninfo, settings)")


async def _give_back(pool: psycopg_pool.AsyncConnectionPool[Any],
                     conn: psycopg.AsyncConnection[Any]) -> None:
    """Return ``conn`` to ``pool`` even if the caller is cancelled meanwhile: the return
    may wait for the pool's lock, and a return cut off there would lose the connection. A
    cancellation is delivered once the connection is back (:mod:`mos_lease_pg.finish`)."""
    await finish(pool.putconn(conn))


class _Pooled(Source, Generic[P]):
    """What both pooled sources share: the caller's pool and how long to wait for it."""

    def __init__(self, pool: P, settings: ConnectionSettings,
                 clock: MonotonicClock = default_clock) -> None:
        super().__init__(settings, clock)
        self._pool: P = pool
        self._timeout = settings.pool_timeout

    def _wait(self, deadline: float | None) -> float:
        # Never longer than the pool's own timeout, nor past the call's deadline.
        return min(self._timeout, remaining(deadline, self._bound, self._clock))

    def _unavailable(self, exc: psycopg.Error) -> StoreUnavailable | ConfigurationError:
        # PoolTimeout, PoolClosed, ... are psycopg errors too.
        return unavailable_on_checkout(exc, pool_timeout=self._timeout)


class PooledConnection(Checkout, _Pooled[psycopg_pool.ConnectionPool[Any]]):
    """Connections checked out of a caller-owned ``ConnectionPool`` for one call each."""

    def enter(self, deadline: float | None = None) -> Wire:
        """A connection of the pool for one call (:meth:`leave` gives it back)."""
        try:
            conn = self._pool.getconn(timeout=self._wait(deadline))
        except psycopg.Error as exc:
            raise self._unavailable(exc) from exc
        try:
            _check_autocommit(conn)
            vet(self, conn, deadline)
            return Wire(conn, prepare=self._prepare, pid_names_backend=self._pid_names_backend,
                        clock=self._clock)
        except BaseException:
            self._pool.putconn(conn)
            raise

    def leave(self, wire: Wire) -> None:
        # The pool replaces a connection that comes back broken.
        self._pool.putconn(wire.conn)

    def close(self) -> None:
        """The pool belongs to the caller, who closes it."""


class AsyncPooledConnection(AsyncCheckout, _Pooled[psycopg_pool.AsyncConnectionPool[Any]]):
    """The asyncio twin of :class:`PooledConnection`."""

    async def enter(self, deadline: float | None = None) -> AsyncWire:
        """As :meth:`PooledConnection.enter`."""
        task = asyncio.current_task()
        asked = 0 if task is None else task.cancelling()
        try:
            conn = await self._pool.getconn(timeout=self._wait(deadline))
        except psycopg.Error as exc:
            raise self._unavailable(exc) from exc
        if task is not None and task.cancelling() > asked:
            # The pool waits for a connection with asyncio.wait_for, which on 3.11 returns
            # the connection it just got and drops a cancellation arriving at that moment;
            # a cancellation that came in during the wait and was not delivered is
            # delivered here, after the connection went back.
            await _give_back(self._pool, conn)
            raise asyncio.CancelledError
        try:
            _check_autocommit(conn)
            await vet_async(self, conn, deadline)
            return AsyncWire(conn, prepare=self._prepare,
                             pid_names_backend=self._pid_names_backend)
        except BaseException:
            await _give_back(self._pool, conn)
            raise

    async def leave(self, wire: AsyncWire) -> None:
        await _give_back(self._pool, wire.conn)

    async def close(self) -> None:
        """The pool belongs to the caller, who closes it."""
